"""A swarm of local OS processes: start a coordinator, wait for its address, start trainers, stop them all.

Used by ``geotrain local`` (loopback) and ``geotrain bench`` (each process inside its lab region through
``geotrain lab run``). Every process is the geotrain CLI as a user runs it, with its own log file in the
run directory and its own session, so a stop reaches its whole process tree. ``geotrain local`` forks its
processes from a fork server (:mod:`geotrain.fork_server`: torch and hivemind imported once, not once a peer)::

    launcher = ProcessLauncher(run_dir)
    initial_peers = launcher.start_coordinator(["coordinator", "--port", "0"], run_dir / "initial_peers.txt")
    launcher.spawn("peer-0", ["peer", "--initial-peers", initial_peers[0]], events_path=run_dir / "peer-0.jsonl")
    launcher.wait_for_trainers()
    launcher.stop_all()
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from geotrain.fork_server import ForkedProcess, ForkServer, ForkServerError
from geotrain.stopping.stopper import die_with_parent

logger = logging.getLogger(__name__)

COORDINATOR = "coordinator"
COORDINATOR_START_TIMEOUT_S = 90.0
STOP_GRACE_S = 30.0
POLL_INTERVAL_S = 0.2


class LaunchError(RuntimeError):
    """A process of the local swarm did not come up; the message has the end of its log."""


@dataclass
class PeerProcess:
    name: str
    process: subprocess.Popen | ForkedProcess
    log_path: Path
    events_path: Path | None = None

    @property
    def is_coordinator(self) -> bool:
        return self.name == COORDINATOR

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class ProcessLauncher:
    """Starts ``python -m geotrain ARGS`` processes logging to ``run_dir/NAME.log`` and stops them together;
    ``fork``: fork them from one fork server (started with the first), not a fresh Python each."""

    def __init__(self, run_dir: Path, fork: bool = False):
        self.run_dir = run_dir
        self.processes: list[PeerProcess] = []
        self._fork = fork
        self._fork_server: ForkServer | None = None

    @property
    def trainers(self) -> list[PeerProcess]:
        return [p for p in self.processes if not p.is_coordinator]

    def spawn(self, name: str, arguments: list[str], events_path: Path | None = None,
              threads: int | None = None) -> PeerProcess:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.run_dir / f"{name}.log"
        environment = dict(os.environ)
        if threads:
            environment["OMP_NUM_THREADS"] = str(threads)
        server = self._started_fork_server()
        if server is not None:
            log_path.write_text("")
            process = server.spawn(arguments, log_path, env=environment, append=True)
        else:
            with open(log_path, "w") as log:
                process = subprocess.Popen([sys.executable, "-m", "geotrain", *arguments], stdout=log,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=environment,
                                           start_new_session=True, preexec_fn=die_with_parent)
        peer = PeerProcess(name, process, log_path, events_path)
        self.processes.append(peer)
        return peer

    def _started_fork_server(self) -> ForkServer | None:
        if self._fork and self._fork_server is None:
            try:
                self._fork_server = ForkServer.start(label=str(self.run_dir))
            except ForkServerError as error:
                logger.warning("%s; starting each process as a Python of its own", error)
                self._fork = False
        return self._fork_server

    def start_coordinator(self, arguments: list[str], peers_file: Path,
                          timeout_s: float = COORDINATOR_START_TIMEOUT_S) -> list[str]:
        """Spawn the coordinator and return the join addresses it writes to ``peers_file``."""
        return self.wait_for_coordinator(self.spawn_coordinator(arguments, peers_file), peers_file, timeout_s)

    def spawn_coordinator(self, arguments: list[str], peers_file: Path) -> PeerProcess:
        """Spawn the coordinator, which writes its join addresses to ``peers_file`` once it listens."""
        peers_file.unlink(missing_ok=True)  # one left by an earlier run is not this coordinator's address
        return self.spawn(COORDINATOR, arguments)

    def wait_for_coordinator(self, coordinator: PeerProcess, peers_file: Path,
                             timeout_s: float = COORDINATOR_START_TIMEOUT_S) -> list[str]:
        """The join addresses in ``peers_file``; LaunchError when the coordinator exits or is not up in time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if peers_file.exists():
                return peers_file.read_text().split()
            if coordinator.process.poll() is not None:
                raise LaunchError(f"the coordinator exited (code {coordinator.process.returncode}):\n"
                                  f"{coordinator.log_tail()}")
            time.sleep(POLL_INTERVAL_S)
        raise LaunchError(f"the coordinator did not come up within {timeout_s:.0f} s:\n{coordinator.log_tail()}")

    def wait_for_trainers(self, timeout_s: float | None = None, poll_s: float = 0.5,
                          on_poll: Callable[[], None] | None = None) -> bool:
        """Until every trainer has exited (True) or ``timeout_s`` passed (False); ``on_poll`` runs each poll."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while any(p.process.poll() is None for p in self.trainers):
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(poll_s)
            if on_poll is not None:
                on_poll()
        return True

    def stop_all(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM trainers first (they say goodbye), then the coordinator; SIGKILL after ``grace_s``."""
        for group in (self.trainers, [p for p in self.processes if p.is_coordinator]):
            for peer in group:
                if peer.process.poll() is None:
                    peer.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for peer in group:
                try:
                    peer.process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    os.killpg(peer.process.pid, signal.SIGKILL)
                    peer.process.wait()
        if self._fork_server is not None:
            self._fork_server.close()
            self._fork_server = None
