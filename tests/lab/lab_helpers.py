"""Helpers of the lab tests: starting geotrain inside a lab's regions, a lab brought up from a topology, and the
mark that skips a test where no lab can run.

Tests that need a lab run only as root on a machine with ``ip`` and ``/dev/net/tun`` (CI runs them as
root); elsewhere they are skipped with the reason (``needs_lab``). Each lab is brought up and down with the
geotrain CLI, as an operator would, under its own name (``gtlabt...``) so that a lab an operator has up is
never touched.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from geotrain.lab.network import leftovers, missing_requirements
from waiting import wait_for

HERE = Path(__file__).resolve().parent
NETPROBE = HERE / "netprobe.py"

_missing = missing_requirements()
needs_lab = pytest.mark.skipif(bool(_missing), reason="the lab needs " + "; ".join(_missing))


def geotrain(*arguments: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "geotrain", *arguments], capture_output=True, text=True,
                          timeout=timeout_s, stdin=subprocess.DEVNULL)


def lab_run(lab: str, region: str, *command: str, **popen) -> subprocess.Popen:
    """Start ``command`` inside ``region`` with `geotrain lab run`, as a user would."""
    return subprocess.Popen([sys.executable, "-m", "geotrain", "lab", "run", "--lab", lab, region, "--", *command],
                            stdin=subprocess.DEVNULL, start_new_session=True, **popen)


def spawn_geotrain(lab: str, region: str, log_path, *arguments: str) -> subprocess.Popen:
    """``geotrain ARGUMENTS`` inside ``region``, its output in ``log_path``."""
    with open(log_path, "w") as log:
        return lab_run(lab, region, sys.executable, "-m", "geotrain", *arguments, stdout=log,
                       stderr=subprocess.STDOUT)


def start_coordinator(lab: str, region: str, address: str, directory: Path, *training: str):
    """A bootstrap coordinator in ``region`` (logs and state in ``directory``): its process and the addresses
    trainers join it by."""
    peers_file = directory / "initial_peers.txt"
    process = spawn_geotrain(lab, region, directory / "coordinator.log", "coordinator", "--host", address, "--port",
                             "0", "--no-state", "--state-dir", str(directory / "coord"), "--initial-peers-file",
                             str(peers_file), "--region", region, *training)
    wait_for(peers_file.exists, 90, "the coordinator's address")
    return process, [a for a in peers_file.read_text().split() if address in a]


def nothing_left(lab: str) -> dict:
    return {kind: found for kind, found in leftovers(lab).items() if found}


class Lab:
    """A lab brought up from a topology written by the test; ``down`` runs whatever happens."""

    def __init__(self, name: str, directory: Path):
        self.name = name
        self.directory = directory

    def up(self, topology_yaml: str) -> subprocess.CompletedProcess:
        path = self.directory / f"{self.name}.yaml"
        path.write_text(topology_yaml)
        if any(leftovers(self.name).values()):  # a test run killed before its teardown left this test's lab up
            down = self.down()
            assert down.returncode == 0, f"the lab a killed run left up would not go down:\n{down.stderr}"
        result = geotrain("lab", "up", "--lab", self.name, "--topology", str(path))
        assert result.returncode == 0, f"lab up failed:\n{result.stdout}\n{result.stderr}"
        return result

    def down(self) -> subprocess.CompletedProcess:
        return geotrain("lab", "down", "--lab", self.name)
