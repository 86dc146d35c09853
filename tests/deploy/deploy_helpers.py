"""Reading what the deploy recipes produce with geotrain's own CLI, and running their scripts."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from unittest import mock

from deploy_tools import REPO


class GeotrainCommandLine:
    """A ``geotrain peer|coordinator ...`` command line, resolved exactly as geotrain would run it.

    The arguments go through geotrain's parser and its command's own handler (``geotrain.cli.HANDLERS``),
    with the trainer or coordinator it would start replaced by a stand-in that records the config it was
    given. So the config here is the one the real command would run with, defaults and quirks included,
    and a recipe that passes a flag geotrain does not know, or a value it refuses, fails here.
    """

    def __init__(self, argv: list[str], config_paths: dict[str, Path] | None = None):
        from geotrain import cli

        self.argv = list(argv)
        arguments = list(argv)
        # A config the recipes install elsewhere (/etc/geotrain/...) is read from its source in the repo.
        for installed, source in (config_paths or {}).items():
            arguments = [str(source) if word == installed else word for word in arguments]
        self.args = cli.build_parser().parse_args(arguments)
        started = {}

        class Trainer:
            def __init__(self, config):
                started.update(config=config)

            def run(self, stopper):
                pass

        class Coordinator:
            def __init__(self, config, initial_peers_file=None):
                started.update(config=config, state_dir=config.coordinator.state_dir,
                               initial_peers_file=initial_peers_file)

            def run(self, stopper):
                pass

        class Stopper:  # no signal handlers in the test process
            stop = None
            exit_code = None

            def install_signal_handlers(self):
                return self

        with mock.patch("geotrain.trainer.Trainer", Trainer), \
                mock.patch("geotrain.coordinator.Coordinator", Coordinator), \
                mock.patch("geotrain.cli.Stopper", Stopper), \
                mock.patch("geotrain.hive.dht.identity.check_identity_file", lambda *_: None):  # the VM's key file
            cli.HANDLERS[self.args.command](self.args)
        self.config = started["config"]
        self.state_dir = started.get("state_dir")
        self.initial_peers_file = started.get("initial_peers_file")

    @property
    def command(self) -> str:
        return self.argv[0]

    def value(self, flag: str) -> str | None:
        """The value given to ``flag`` (None when absent)."""
        if flag not in self.argv:
            return None
        return self.argv[self.argv.index(flag) + 1]

    @classmethod
    def from_shell(cls, line: str, **kwargs) -> "GeotrainCommandLine":
        words = shlex.split(line)
        assert Path(words[0]).name == "geotrain", f"expected a geotrain command, got {line!r}"
        return cls(words[1:], **kwargs)


def parse_key_values(text: str) -> dict[str, str]:
    """``key=value`` lines (the dry-run output of the startup scripts) as a dict."""
    values = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.isidentifier():
            values[key] = value
    return values


def run_script(script: str | Path, *arguments: str, env: dict[str, str] | None = None, timeout_s: float = 60,
               cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run a shell script of the repository with only PATH plus ``env`` in its environment, as a VM would."""
    clean = {"PATH": os.environ["PATH"], "LANG": "C.UTF-8", **(env or {})}
    return subprocess.run(["bash", str(REPO / script), *arguments], env=clean, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout_s)


# ---- a VM's GPUs and geotrain itself, faked on PATH -------------------------------------------------------

def fake_bin(folder: Path, gpus: int | None = None, nvidia_smi_fails: bool = False) -> Path:
    """A folder to put first on PATH: ``python3`` is this interpreter (with PyYAML, as on a VM), and
    ``nvidia-smi`` lists ``gpus`` Tesla T4s the way the real one does (none: no nvidia-smi at all), or fails
    the way it does on a VM whose driver is not loaded."""
    folder.mkdir(parents=True, exist_ok=True)
    python3 = folder / "python3"
    python3.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python3.chmod(0o755)
    if gpus is not None or nvidia_smi_fails:
        if nvidia_smi_fails:
            body = ('echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver. Make sure '
                    'that the latest NVIDIA driver is installed and running."\nexit 9\n')
        else:
            listing = "".join(f"GPU {index}: Tesla T4 (UUID: GPU-1b2c3d4e-5f60-7182-93a4-b5c6d7e8f9{index:02d})\n"
                              for index in range(gpus))
            body = ('[ "$1" = --list-gpus ] || { echo "fake nvidia-smi: only --list-gpus" >&2; exit 2; }\n'
                    f"cat <<'LISTING'\n{listing}LISTING\n")
        nvidia_smi = folder / "nvidia-smi"
        nvidia_smi.write_text("#!/bin/sh\n" + body)
        nvidia_smi.chmod(0o755)
    return folder


def path_without_nvidia_smi(folder: Path) -> str:
    """This machine's PATH, but with every folder that holds an nvidia-smi replaced by a copy (of links)
    without it: a VM without GPUs, even when the tests run on one with GPUs."""
    entries = []
    for index, entry in enumerate(os.environ["PATH"].split(os.pathsep)):
        if entry and (Path(entry) / "nvidia-smi").exists():
            shadow = folder / f"path-{index}"
            shadow.mkdir(parents=True, exist_ok=True)
            for item in Path(entry).iterdir():
                if item.name != "nvidia-smi" and not (shadow / item.name).exists():
                    (shadow / item.name).symlink_to(item)
            entry = str(shadow)
        entries.append(entry)
    return os.pathsep.join(entries)


def vm_path(folder: Path, gpus: int | None = None, nvidia_smi_fails: bool = False) -> str:
    """PATH of a VM with ``gpus`` GPUs (None: no nvidia-smi; see fake_bin)."""
    bin_folder = fake_bin(folder / "bin", gpus, nvidia_smi_fails)
    return os.pathsep.join([str(bin_folder), path_without_nvidia_smi(folder / "shadow")])


def fake_geotrain(path: Path, record: Path) -> Path:
    """A stand-in for the geotrain executable that appends its arguments to ``record`` (one JSON line each),
    prints a line, and then does what FAKE_GEOTRAIN (JSON: its --device value, or "cpu" without one, ->
    "exit:CODE" or "sleep:SECONDS") says; default exit:0. On SIGTERM it says so and exits 0, as geotrain
    does. A ``python`` next to it makes its folder look like geotrain's venv."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"""#!{sys.executable}
import json, os, signal, sys, time
arguments = sys.argv[1:]
device = arguments[arguments.index("--device") + 1] if "--device" in arguments else "cpu"
with open({str(record)!r}, "a") as handle:
    handle.write(json.dumps({{"argv": arguments, "pid": os.getpid()}}) + "\\n")

def stop(signum, frame):
    print(f"{{device}}: stopping on signal {{signum}}", flush=True)
    with open({str(record)!r} + ".stopped", "a") as handle:
        handle.write(device + "\\n")
    sys.exit(0)

signal.signal(signal.SIGTERM, stop)
print(f"{{device}}: training", flush=True)
kind, _, value = json.loads(os.environ.get("FAKE_GEOTRAIN", "{{}}")).get(device, "exit:0").partition(":")
if kind == "sleep":
    time.sleep(float(value))
    sys.exit(0)
sys.exit(int(value))
""")
    path.chmod(0o755)
    python = path.parent / "python"
    if not python.exists():
        python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        python.chmod(0o755)
    return path


def recorded(record: Path) -> list[list[str]]:
    """The argument lists fake_geotrain recorded, in the order the fakes started."""
    if not record.exists():
        return []
    return [json.loads(line)["argv"] for line in record.read_text().splitlines() if line.strip()]
