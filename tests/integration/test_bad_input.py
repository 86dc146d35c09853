"""Bad input gets a clear error, a non-zero exit and loses nothing: end to end, as processes. The refusals that
come before a peer joins are checked in-process: tests/unit/test_cli_refusals.py."""

from __future__ import annotations

import socket
import time

from swarm_helpers import geotrain

BAD_INPUT = 2
JOIN_FAILED = 3
GHOST_PEER_ID = "12D3KooWSR5Er8swms7XFXsxgUdTRxRYw2FSt6wucGdQTSSFf3cx"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_malformed_config_ends_the_process_with_exit_2_and_one_line(tmp_path):
    """End to end, once: what tests/unit/test_cli_refusals.py checks in-process gives a real process exit 2."""
    config = tmp_path / "config.yaml"
    config.write_text("optimizer:\n  target_batch_sise: 4096\n")
    result = geotrain("peer", "--config", str(config), timeout_s=60, fresh=True)
    assert result.returncode == BAD_INPUT
    assert "optimizer.target_batch_sise: unknown key" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_unreachable_initial_peer_fails_within_bounded_time():
    address = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{GHOST_PEER_ID}"
    started = time.monotonic()
    result = geotrain("peer", "--initial-peers", address, "--bootstrap-timeout", "20", timeout_s=120)
    elapsed_s = time.monotonic() - started
    assert result.returncode == JOIN_FAILED, result.stderr
    assert "initial peer" in result.stderr and "did not answer" in result.stderr or \
        "none of the initial peers answered" in result.stderr, result.stderr
    assert elapsed_s < 60


def test_status_without_a_swarm_says_what_to_give():
    missing = geotrain("status", "--once", timeout_s=60)
    assert missing.returncode == BAD_INPUT
    assert "--initial-peers" in missing.stderr
    address = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{GHOST_PEER_ID}"
    unreachable = geotrain("status", "--once", "--initial-peers", address, "--bootstrap-timeout", "10", timeout_s=120)
    assert unreachable.returncode == JOIN_FAILED
    assert "none of the initial peers answered" in unreachable.stderr or "no initial peer answered" in \
        unreachable.stderr, unreachable.stderr
