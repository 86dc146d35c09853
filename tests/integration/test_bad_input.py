"""Bad input gets a clear error, a non-zero exit and loses nothing."""

from __future__ import annotations

import socket
import time

import pytest

from swarm_helpers import geotrain

BAD_INPUT = 2
JOIN_FAILED = 3
GHOST_PEER_ID = "12D3KooWSR5Er8swms7XFXsxgUdTRxRYw2FSt6wucGdQTSSFf3cx"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("text, expected", [
    ("optimizer:\n\ttarget_batch_size: 4096\n", "not valid YAML at line 2"),
    ("optimizer:\n  target_batch_sise: 4096\n", "optimizer.target_batch_sise: unknown key"),
    ("optimizer:\n  target_batch_size: lots\n", "optimizer.target_batch_size: input should be a valid integer"),
    ("optimizer:\n  target_batch_size: 16\n  batch_size_per_step: 32\n",
     "optimizer.target_batch_size (16) is below optimizer.batch_size_per_step (32)"),
    ("task:\n  name: cv\n  preset: resnet9000\n", "task.preset: unknown preset 'resnet9000'"),
    ("optimizer:\n  network_profile: moon\n", "optimizer.network_profile"),
    ("- just\n- a list\n", "expected a mapping"),
])
def test_malformed_config_names_the_key(tmp_path, text, expected):
    config = tmp_path / "config.yaml"
    config.write_text(text)
    result = geotrain("peer", "--config", str(config), timeout_s=60)
    assert result.returncode == BAD_INPUT
    assert expected in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_task_lists_the_choices():
    result = geotrain("peer", "--task", "chess", timeout_s=60)
    assert result.returncode == BAD_INPUT
    assert "task.name" in result.stderr and "'cv', 'nlp', 'asr'" in result.stderr


def test_initial_peer_that_is_not_a_multiaddr():
    result = geotrain("peer", "--initial-peers", "127.0.0.1:31337", timeout_s=60)
    assert result.returncode == BAD_INPUT
    assert "/ip4/HOST/tcp/PORT/p2p/PEER_ID" in result.stderr


def test_unreachable_initial_peer_fails_within_bounded_time():
    address = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{GHOST_PEER_ID}"
    started = time.monotonic()
    result = geotrain("peer", "--initial-peers", address, "--bootstrap-timeout", "20", timeout_s=120)
    elapsed_s = time.monotonic() - started
    assert result.returncode == JOIN_FAILED, result.stderr
    assert "initial peer" in result.stderr and "did not answer" in result.stderr or \
        "none of the initial peers answered" in result.stderr, result.stderr
    assert elapsed_s < 60


@pytest.mark.parametrize("flag, what", [("--metrics-port", "metrics port"), ("--port", "DHT port")])
def test_port_already_in_use(flag, what):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = geotrain("peer", flag, str(port), timeout_s=120)
    assert result.returncode == BAD_INPUT
    assert f"{what} {port} on 127.0.0.1 is already in use" in result.stderr, result.stderr
    assert flag in result.stderr


def test_status_without_a_swarm_says_what_to_give():
    missing = geotrain("status", "--once", timeout_s=60)
    assert missing.returncode == BAD_INPUT
    assert "--initial-peers" in missing.stderr
    address = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{GHOST_PEER_ID}"
    unreachable = geotrain("status", "--once", "--initial-peers", address, "--bootstrap-timeout", "10", timeout_s=120)
    assert unreachable.returncode == JOIN_FAILED
    assert "none of the initial peers answered" in unreachable.stderr or "no initial peer answered" in \
        unreachable.stderr, unreachable.stderr
