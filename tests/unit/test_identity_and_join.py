"""A bad identity file, a wrong peer id in --initial-peers and Ctrl-C while joining: each is told apart and ends
with the right exit code (2, 3 and 0), with one clear line and no traceback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from geotrain.config import SwarmConfig
from geotrain.errors import EXIT_BAD_INPUT, EXIT_OK, SwarmUnreachableError
from geotrain.hive.dht.identity import IdentityError, check_identity_file, peer_id_of

GHOST_PEER_ID = "12D3KooWSR5Er8swms7XFXsxgUdTRxRYw2FSt6wucGdQTSSFf3cx"  # a valid id nobody here has
REPOSITORY = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def unreachable_peer() -> str:
    """Had a check run after joining, this address would make the command fail with exit 3 instead of 2."""
    return f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{GHOST_PEER_ID}"


@pytest.fixture
def geotrain_main(monkeypatch, run_cli):
    """``geotrain ARGV`` run in this process (``run_cli``): (exit code, stderr)."""
    monkeypatch.setenv("HIVEMIND_LOGLEVEL", "ERROR")  # (main sets these in the environment otherwise)
    monkeypatch.setenv("GOLOG_LOG_LEVEL", "error")

    def run(*argv: str) -> tuple[int, str]:
        result = run_cli(*argv)
        return result.returncode, result.stderr

    return run


# ---- 1. a key file hivemind could not use: exit 2 before the DHT starts, as `geotrain identity` says --------

def _corrupt(path: Path) -> None:
    path.write_bytes(b"\x08\x00\x12\x05hello not a key")


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _directory(path: Path) -> None:
    path.mkdir()


BAD_FILES = {  # how to spoil PATH -> (the path to give, what the message must say)
    "corrupt": (_corrupt, lambda path: (path, ["is not a peer's key file", "delete it to make a new key"])),
    "empty": (_empty, lambda path: (path, ["is empty, not a peer's key file", "delete it to make a new key"])),
    "directory": (_directory, lambda path: (path, ["is a directory, expected a key file", "identity.key"])),
    "under a file": (lambda path: path.write_text("notes\n"),
                     lambda path: (path / "id.key", [f"{path} is a file, not a directory"])),
}


def _one_clear_line(stderr: str, command: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith(f"geotrain {command}:")]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr and "protobuf" not in stderr.lower() and "ASN" not in stderr, stderr
    return lines[0]


@pytest.mark.parametrize("kind", BAD_FILES)
def test_a_peer_with_a_bad_identity_file_is_refused_before_joining(tmp_path, geotrain_main, kind):
    spoil, expected = BAD_FILES[kind]
    spoil(tmp_path / "afile.txt")
    given, words = expected(tmp_path / "afile.txt")
    code, stderr = geotrain_main("peer", "--identity", str(given), "--initial-peers", unreachable_peer(),
                                 "--bootstrap-timeout", "20", "--task", "cv", "--preset", "tiny",
                                 "--data-workers", "0", "--preemption", "none")
    assert code == EXIT_BAD_INPUT, stderr
    line = _one_clear_line(stderr, "peer")
    assert f"--identity {given}" in line
    for word in words:
        assert word in line


@pytest.mark.parametrize("kind", ["corrupt", "empty"])
def test_a_coordinator_with_a_corrupt_identity_in_its_state_dir_is_refused(tmp_path, geotrain_main, kind):
    state = tmp_path / "state"
    state.mkdir()
    BAD_FILES[kind][0](state / "identity.key")
    code, stderr = geotrain_main("coordinator", "--state-dir", str(state), "--no-state", "--port", "0",
                                 "--initial-peers", unreachable_peer(), "--bootstrap-timeout", "20")
    assert code == EXIT_BAD_INPUT, stderr
    line = _one_clear_line(stderr, "coordinator")
    assert f"{state / 'identity.key'} (the coordinator's identity, kept in --state-dir)" in line
    assert "delete it to make a new key" in line


@pytest.mark.parametrize("kind", BAD_FILES)
def test_geotrain_identity_gives_the_same_reason(tmp_path, geotrain_main, kind):
    spoil, expected = BAD_FILES[kind]
    spoil(tmp_path / "afile.txt")
    given, words = expected(tmp_path / "afile.txt")
    code, stderr = geotrain_main("identity", str(given))
    assert code == EXIT_BAD_INPUT, stderr
    line = _one_clear_line(stderr, "identity")
    for word in words:
        assert word in line
    with pytest.raises(IdentityError) as refused:
        check_identity_file(given)  # the check peer and coordinator run
    assert all(word in str(refused.value) for word in words)


def test_a_missing_identity_file_is_still_made_when_the_dht_starts(tmp_path):
    from geotrain.hive.dht.node import start_dht

    key = tmp_path / "new" / "dir" / "peer.key"
    check_identity_file(key)  # not an error: its directory is made, hivemind writes the key
    assert key.parent.is_dir() and not key.exists()
    dht = start_dht(SwarmConfig(identity_path=key, bootstrap_timeout_s=30))
    try:
        assert str(dht.peer_id) == peer_id_of(key)
    finally:
        dht.shutdown()


# ---- 2. a well-formed address whose /p2p/ id is not the listening peer's: said so (exit 3) ------------------

def test_a_wrong_peer_id_in_initial_peers_is_named(tmp_path):
    import hivemind
    from geotrain.hive.dht.node import other_peer_ids, start_dht

    coordinator = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        right = str(coordinator.get_visible_maddrs()[0])
        where = right.rpartition("/p2p/")[0]
        wrong = f"{where}/p2p/{GHOST_PEER_ID}"
        closed = unreachable_peer()
        assert other_peer_ids([closed, wrong]) == {wrong: str(coordinator.peer_id)}

        with pytest.raises(SwarmUnreachableError) as failed:
            start_dht(SwarmConfig(initial_peers=[wrong], bootstrap_timeout_s=30))
        message = str(failed.value)
        assert f"at {where} a peer answered, but with peer id {coordinator.peer_id}, not {GHOST_PEER_ID}" in message
        assert "`geotrain coordinator` prints" in message
        assert "TCP port" not in message and "token" not in message  # the port answered; no token involved
    finally:
        coordinator.shutdown()

    with pytest.raises(SwarmUnreachableError, match="none of the initial peers answered"):
        start_dht(SwarmConfig(initial_peers=[unreachable_peer()], bootstrap_timeout_s=30))


# ---- 3. Ctrl-C while joining: a stop request, exit 0 at once, nothing left running ---------------------------

def _processes_in_group(group: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == group and fields[0] != "Z":
                found.append(int(entry))
    return found


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    if text.encode() in handle.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


@pytest.mark.parametrize("to", ["the peer", "its process group (a terminal's Ctrl-C)"])
def test_ctrl_c_while_joining_stops_at_once_with_exit_0(tmp_path, to):
    port = free_port()
    address = f"/ip4/127.0.0.1/tcp/{port}/p2p/{GHOST_PEER_ID}"
    log_path = tmp_path / "peer.log"
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPOSITORY),
                                                                                os.environ.get("PYTHONPATH")]))}
    with open(log_path, "w") as log:
        peer = subprocess.Popen(
            [sys.executable, "-m", "geotrain", "peer", "--initial-peers", address, "--bootstrap-timeout", "60",
             "--task", "cv", "--preset", "tiny", "--data-workers", "0", "--preemption", "none"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=environment)
    try:
        deadline = time.monotonic() + 240
        while "joining the swarm" not in log_path.read_text():
            assert peer.poll() is None, f"exit {peer.returncode} before joining:\n{log_path.read_text()}"
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        if to == "the peer":
            peer.send_signal(signal.SIGINT)
        else:
            os.killpg(peer.pid, signal.SIGINT)
        signalled = time.monotonic()
        code = peer.wait(timeout=30)
        stopped_s = time.monotonic() - signalled
        log = log_path.read_text()
        assert code == EXIT_OK, log
        assert stopped_s < 5, f"{stopped_s:.1f} s to stop:\n{log}"
        assert "none of the initial peers answered" not in log and "Traceback" not in log, log
        deadline = time.monotonic() + 5  # (what it stopped may take a moment to be reaped)
        while (_processes_in_group(peer.pid) or _processes_mentioning(f"/tcp/{port}/")) and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _processes_in_group(peer.pid), "a child of the peer outlived it"
        assert not _processes_mentioning(f"/tcp/{port}/"), "a DHT process or p2pd outlived the peer"
    finally:
        if peer.poll() is None:
            os.killpg(peer.pid, signal.SIGKILL)
            peer.wait()


SIGNAL_STORM = """
import os, signal, subprocess, sys, time
import hivemind  # (switches torch to the file_system sharing strategy, as in a peer)
from geotrain.stopping.processes import start_shared_memory_manager
signal.signal(signal.SIGINT, lambda *_: None)  # a Python handler, as a peer's Stopper installs
storm = subprocess.Popen(["bash", "-c", f"while kill -INT {os.getpid()} 2>/dev/null; do sleep 0.0002; done"])
time.sleep(0.3)
start_shared_memory_manager()
storm.kill()
print("started", flush=True)
os._exit(0)
"""


def test_a_signal_while_torch_starts_its_shared_memory_manager_does_not_hang_the_peer():
    # torch's libshm retries a read that a signal interrupted without reading again: a Ctrl-C as a peer's
    # DHT started (hivemind's first shared tensor starts torch_shm_manager) left it spinning for good
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPOSITORY),
                                                                                os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", SIGNAL_STORM], capture_output=True, text=True, timeout=60,
                            env=environment, stdin=subprocess.DEVNULL)
    assert result.returncode == 0 and "started" in result.stdout, result.stderr[-2000:]
