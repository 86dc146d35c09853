"""Reading what the deploy recipes produce with geotrain's own CLI, and running their scripts."""

from __future__ import annotations

import os
import shlex
import subprocess
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
                mock.patch("geotrain.cli.Stopper", Stopper):
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
