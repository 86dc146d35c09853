"""The fork server (geotrain/fork_server.py): what it starts is the geotrain a user starts with
``python -m geotrain``, only without paying torch's and hivemind's imports again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from geotrain.fork_server import ForkServer, ForkServerError
from swarm_helpers import alive, wait_for


@pytest.fixture(scope="module")
def server():
    started = ForkServer.start(label="test-fork-server")
    yield started
    started.close()
    assert started.process.poll() is not None, "the fork server outlived close()"


@pytest.mark.parametrize("arguments, environment, says", [
    (["peer", "--task", "nope", "--batch-size", "0"], {}, "task.name"),
    (["peer"], {"GEOTRAIN_SWARM_TOKEN": "short"}, "GEOTRAIN_SWARM_TOKEN"),  # its environment's
])
def test_a_forked_refusal_says_and_exits_as_the_command_line_does(server, tmp_path, arguments, environment, says):
    forked = server.spawn(arguments, log_path=tmp_path / "forked.log", env={**os.environ, **environment})
    assert forked.wait(timeout=60) == 2
    fresh = subprocess.run([sys.executable, "-m", "geotrain", *arguments], capture_output=True, text=True,
                           timeout=120, stdin=subprocess.DEVNULL, env={**os.environ, **environment})
    assert fresh.returncode == 2
    assert (tmp_path / "forked.log").read_text() == fresh.stdout + fresh.stderr
    assert says in fresh.stderr


def test_a_forked_peer_has_its_command_line_session_and_directory(server, tmp_path):
    peers_file = tmp_path / "initial_peers.txt"
    arguments = ["coordinator", "--port", "0", "--no-state", "--initial-peers-file", peers_file.name]  # in cwd
    process = server.spawn(arguments, log_path=tmp_path / "coordinator.log", cwd=tmp_path)
    try:
        wait_for(peers_file.exists, 60, "the coordinator's address")
        command_line = Path(f"/proc/{process.pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        assert command_line == [os.fsencode(word) for word in (sys.executable, "-m", "geotrain", *arguments)]
        assert os.getsid(process.pid) == process.pid  # os.killpg(pid) reaches all it starts
        assert "geotrain coordinator is up" in (tmp_path / "coordinator.log").read_text()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


SCRIPT = """import os, sys
import helper_beside_the_script
print(sys.argv[1:], helper_beside_the_script.NAME, os.getcwd())
sys.exit(int(sys.argv[1]))
"""


def test_a_forked_script_runs_as_python_script_would(server, tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    (tmp_path / "helper_beside_the_script.py").write_text("NAME = 'found'\n")
    log, elsewhere = tmp_path / "script.log", tmp_path / "elsewhere"
    elsewhere.mkdir()
    process = server.spawn(["3", "a b"], log_path=log, script=tmp_path / "script.py", cwd=elsewhere)
    assert process.wait(timeout=60) == 3
    fresh = subprocess.run([sys.executable, str(tmp_path / "script.py"), "3", "a b"], capture_output=True, text=True,
                           timeout=60, cwd=elsewhere)
    assert fresh.returncode == 3 and log.read_text() == fresh.stdout + fresh.stderr
    assert log.read_text() == f"['3', 'a b'] found {elsewhere}\n"


def test_a_killed_child_reports_its_signal_and_one_left_by_a_dead_server_gets_sigterm(tmp_path):
    server = ForkServer.start(label="test-fork-server-dies")
    try:
        peers_file = tmp_path / "initial_peers.txt"
        first = server.spawn(["coordinator", "--port", "0", "--no-state", "--initial-peers-file", str(peers_file)],
                             log_path=tmp_path / "first.log")
        wait_for(peers_file.exists, 60, "the first coordinator's address")
        first.kill()
        assert first.wait(timeout=30) == -signal.SIGKILL
        peers_file.unlink()
        second = server.spawn(["coordinator", "--port", "0", "--no-state", "--initial-peers-file", str(peers_file)],
                              log_path=tmp_path / "second.log")
        wait_for(peers_file.exists, 60, "the second coordinator's address")
        server.process.kill()  # the fork server dies hard: the coordinator it forked gets SIGTERM and leaves
        wait_for(lambda: not alive(second.pid), 30, "the orphaned coordinator to leave")
        assert "SIGTERM received" in (tmp_path / "second.log").read_text()
        with pytest.raises(ForkServerError, match="the fork server is gone"):
            second.poll()
    finally:
        server.close()


RENEWED_LOCKS = """
import importlib, json, sys
from geotrain import fork_server
for name in fork_server.PRELOADED_MODULES:
    importlib.import_module(name)
locations = fork_server.find_import_time_locks()
from hivemind.utils.mpfuture import MPFuture
MPFuture._update_lock.acquire()  # as a sibling killed while sending a result leaves it
fork_server.renew_import_time_locks(locations)
future = MPFuture()
future.set_result(7)  # sends its update under the lock
print(json.dumps({"found": sorted(f"{getattr(n, '__name__', n)}.{a}" for n, a in locations),
                  "result": future.result(timeout=10)}))
"""


def test_a_child_makes_its_own_import_time_locks_so_a_killed_sibling_blocks_nothing():
    result = subprocess.run([sys.executable, "-c", RENEWED_LOCKS], capture_output=True, text=True, timeout=120,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert {"MPFuture._update_lock", "MPFuture._initialization_lock"} <= set(report["found"]), report
    assert report["result"] == 7
