"""Helpers for tests that start real peers as OS processes on loopback (nothing mocked)."""

from __future__ import annotations

import atexit
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from geotrain.events import read_events
from geotrain.fork_server import ForkedProcess, ForkServer
from geotrain.stopping.processes import is_alive as alive
from stopping import stop_processes
from waiting import wait_for

# Small enough for 2 shared cores, large enough that an epoch takes a few seconds and peers meet in it.
FAST_SWARM = ["--task", "cv", "--preset", "tiny", "--target-batch-size", "1024", "--batch-size", "32"]
# For tests of what goes around training (metrics, signals, notices, admission), not of what it learns: the
# emulated task's tiny model sleeps its compute (5 ms a sample, so an epoch takes as long as FAST_SWARM's) and
# loads no timm, so the processes the test runs next to its swarm get the CPU.
IDLE_SWARM = ["--task", "emulated", "--preset", "tiny", "--target-batch-size", "1024", "--batch-size", "32"]


def geotrain(*arguments: str, timeout_s: float = 300, cwd: Path | None = None,
             fresh: bool = False) -> subprocess.CompletedProcess:
    """Run one geotrain command to its end, as a user would: its exit code, stdout and stderr.

    Forked by the session's fork server (see :func:`spawn`: what the child runs is ``python -m geotrain``'s
    command line, without paying 2-4 s of imports per command), or with ``fresh`` a new Python: for `geotrain
    local` (it starts a fork server of its own) and for the one check that a real command line exits so."""
    if fresh:
        return subprocess.run([sys.executable, "-m", "geotrain", *arguments], capture_output=True, text=True,
                              timeout=timeout_s, cwd=cwd, stdin=subprocess.DEVNULL)
    return _run_forked(list(arguments), timeout_s, cwd)


def run_script(script: Path, *arguments: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGUMENTS`` to its end (a helper program of the tests, such as an attacker that joins
    the swarm), forked by the session's fork server: torch and hivemind are imported already."""
    return _run_forked(list(arguments), timeout_s, None, script=script)


def _run_forked(arguments: list[str], timeout_s: float, cwd: Path | None,
                script: Path | None = None) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="geotrain-command-") as directory:
        stdout_path, stderr_path = Path(directory) / "stdout", Path(directory) / "stderr"
        process = _fork_server().spawn(arguments, log_path=stdout_path, stderr_path=stderr_path, cwd=cwd,
                                       script=script)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise
        return subprocess.CompletedProcess(process.args + arguments if script else process.args,
                                           process.returncode, stdout_path.read_text(errors="replace"),
                                           stderr_path.read_text(errors="replace"))


def spawn(*arguments: str, log_path: Path, env: dict[str, str] | None = None,
          whole_env: dict[str, str] | None = None, script: Path | None = None) -> ForkedProcess:
    """A geotrain process in a session of its own (``os.killpg(process.pid, ...)`` reaches all of its children);
    ``env``: variables added to this process's environment, ``whole_env``: its environment instead.

    Forked by the session's fork server (geotrain.fork_server, as `geotrain local` starts its peers), which has
    imported torch and hivemind once for all of them: a peer's start costs a fork, not 2.4 CPU-s of imports. The
    process runs the CLI as ``python -m geotrain`` would, and its command line in /proc says so
    (tests/integration/test_fork_server.py checks both). ``script``: ``python SCRIPT ARGUMENTS`` instead."""
    log_path.write_text("")  # there before the child opens it, as with subprocess.Popen
    return _fork_server().spawn(list(arguments), log_path=log_path, append=True, script=script,
                                env=whole_env if whole_env is not None else {**os.environ, **(env or {})})


_started_fork_server: ForkServer | None = None


def _fork_server() -> ForkServer:
    global _started_fork_server
    if _started_fork_server is None or _started_fork_server.process.poll() is not None:
        _started_fork_server = ForkServer.start(label="geotrain-tests")
        atexit.register(_started_fork_server.close)
    return _started_fork_server


def last_epoch(events_path: Path) -> int:
    return max((e["epoch"] for e in read_events(events_path) if e["event"] == "epoch"), default=0)


def shared_memory_files() -> set[str]:
    """Names of the files torch shares tensors through (``torch_<pid>_...`` in /dev/shm)."""
    return {path.name for path in Path("/dev/shm").glob("torch_*")}


def processes_mentioning(text: str) -> list[int]:
    """PIDs of live processes whose command line contains ``text`` (hivemind's forks keep their parent's)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                command = handle.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in command and alive(int(entry)):
            found.append(int(entry))
    return found


class Swarm:
    """A coordinator and trainers started by hand, for tests that need to act in the middle of a run."""

    def __init__(self, directory: Path):
        self.directory = directory
        # pids come round again (pid_max is 32768 here): files a dead process of an earlier test left under a
        # pid that a peer of this test now has are not this peer's
        self.shared_memory_at_start = shared_memory_files()
        self.processes: list[subprocess.Popen | ForkedProcess] = []
        self.initial_peers: list[str] = []

    def start_coordinator(self, *arguments: str) -> list[str]:
        """A bootstrap-only coordinator unless ``arguments`` say otherwise (durable state has its own tests)."""
        peers_file = self.directory / "initial_peers.txt"
        self.processes.append(spawn("coordinator", "--port", "0", "--state-dir", str(self.directory / "coord"),
                                    "--initial-peers-file", str(peers_file), *(arguments or ("--no-state",)),
                                    log_path=self.directory / "coordinator.log"))
        wait_for(peers_file.exists, 90, "the coordinator's address")
        self.initial_peers = peers_file.read_text().split()
        return self.initial_peers

    def start_trainer(self, name: str, *arguments: str, env: dict[str, str] | None = None,
                      initial_peers_file: Path | None = None) -> tuple[ForkedProcess, Path]:
        """A trainer that joins through the coordinator, or, given ``initial_peers_file``, one that loads torch
        and builds its model now and joins once :meth:`let_join` writes the coordinator's address there."""
        events = self.directory / f"{name}.jsonl"
        command = ["peer", "--events", str(events), "--threads", "1", "--network-profile", "loopback",
                   "--preemption", "signal"]
        if initial_peers_file is not None:
            command += ["--initial-peers-file", str(initial_peers_file)]
        else:
            for address in self.initial_peers:
                command += ["--initial-peers", address]
        process = spawn(*command, *arguments, log_path=self.directory / f"{name}.log", env=env)
        self.processes.append(process)
        return process, events

    def let_join(self, initial_peers_file: Path) -> None:
        """Write the coordinator's address where a trainer started with ``initial_peers_file`` waits for it."""
        partial = initial_peers_file.with_name(initial_peers_file.name + ".partial")
        partial.write_text("\n".join(self.initial_peers) + "\n")
        partial.rename(initial_peers_file)  # whole or not at all, as the coordinator writes it

    def log(self, name: str) -> str:
        return (self.directory / f"{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        stop_processes(self.processes)


def agreement_report(summary: dict) -> str:
    """Each trainer's end of a `geotrain local` run, for an assertion's message: whether it agreed on the final
    state, its parameters' hash, and what its log says about the agreement."""
    lines = []
    for peer in summary["peers"]:
        lines.append(f"{peer['name']}: agreed {peer.get('final_state_agreed')}, parameters "
                     f"{(peer['params_sha256'] or '-')[:16]}, exit {peer['exit_code']}")
        log = Path(summary["run_dir"]) / f"{peer['name']}.log"
        if log.exists():
            lines += [f"    {line}" for line in log.read_text(errors="replace").splitlines()
                      if "final state" in line or "agree" in line or "left the swarm" in line]
    return "\n".join(lines)


def run_local(directory: Path, *arguments: str, timeout_s: float = 400) -> tuple[dict, subprocess.CompletedProcess]:
    summary_path = directory / "summary.json"
    result = geotrain("local", "--run-dir", str(directory / "run"), "--json", str(summary_path), *arguments,
                      timeout_s=timeout_s, fresh=True)
    assert summary_path.exists(), f"no summary written:\n{result.stdout}\n{result.stderr}"
    assert not processes_mentioning(str(directory)), "a peer process outlived `geotrain local`"
    return json.loads(summary_path.read_text()), result


def train_two(swarm: Swarm, run_id: str, *arguments: str, epochs: int, timeout_s: float = 240,
              env: dict[str, str] | None = None, second_arguments: tuple[str, ...] = ()) -> dict:
    """Two trainers (data seeds 1 and 2) of a swarm of their own (``run_id``) next to ``swarm``'s coordinator,
    from start to the end-of-run agreement after ``epochs`` (``second_arguments``: the second one's own flags);
    what their events and logs say: exit codes, each one's events and ``finished`` event, the swarm's loss per
    epoch (weighted by samples), averaging bytes per sample."""
    names = [f"{run_id}-{index}" for index in range(2)]
    started = [swarm.start_trainer(name, "--run-id", run_id, "--max-epochs", str(epochs), "--wait-for-peers", "2",
                                   "--data-seed", str(index + 1), "--set", "optimizer.group_size=2",  # rounds end
                                   *arguments, *(second_arguments if index else ()),             # once both are in
                                   env=env)
               for index, name in enumerate(names)]
    for process, _ in started:
        process.wait(timeout=timeout_s)
    events = [read_events(path) for _, path in started]
    finished = [next((e for e in peer if e["event"] == "finished"), None) for peer in events]
    losses = []
    for epoch in range(1, epochs + 1):
        of_epoch = [e for peer in events for e in peer if e["event"] == "epoch" and e["epoch"] == epoch]
        losses.append(sum(e["loss"] * e["samples"] for e in of_epoch) / max(1, sum(e["samples"] for e in of_epoch)))
    samples = sum(f["samples"] for f in finished if f is not None)
    averaging_bytes = sum(sum(f["averaging_payload_bytes"].values()) for f in finished if f is not None)
    return {"exit_codes": [process.returncode for process, _ in started], "events": events, "finished": finished,
            "losses": losses,
            "averaging_bytes_per_sample": averaging_bytes / samples if samples else math.nan,
            "logs": {name: swarm.log(name) for name in names}}


def run_report(run: dict) -> str:
    """The end of each trainer's log in a :func:`train_two` run, for an assertion's message."""
    return "\n".join(f"--- {name}\n{log[-3000:]}" for name, log in run["logs"].items())
