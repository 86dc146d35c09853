"""A private swarm (swarm token): its members train together; an outsider with the run id and a member's
address, but not the token, can neither join the DHT, nor an averaging group, nor download the state, nor
write or read records."""

from __future__ import annotations

import json
import re
import secrets
from pathlib import Path

import pytest

from geotrain.events import read_events
from swarm_helpers import IDLE_SWARM, Swarm, geotrain, last_epoch, run_script, wait_for

OUTSIDER = Path(__file__).parent / "outsider.py"


@pytest.fixture
def private_swarm(tmp_path):
    token_file = tmp_path / "swarm.token"
    token_file.write_text(secrets.token_hex(32) + "\n")
    swarm = Swarm(tmp_path)
    swarm.token_file = token_file
    swarm.start_coordinator("--no-state", "--token-file", str(token_file))
    try:
        yield swarm
    finally:
        swarm.stop()


def listen_address(log: str) -> str:
    match = re.search(r"listening on (/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+)", log)
    assert match, f"no listen address in the trainer's log:\n{log}"
    return match.group(1)


def test_an_outsider_without_the_token_gets_nothing_from_a_private_swarm(private_swarm):
    swarm = private_swarm
    token = ("--token-file", str(swarm.token_file))
    trainers = [swarm.start_trainer(f"trainer-{i}", *IDLE_SWARM, "--max-epochs", "50", "--wait-for-peers", "2",
                                    *token) for i in range(2)]
    events = [path for _, path in trainers]
    wait_for(lambda: all(last_epoch(path) >= 1 for path in events), 180, "the members' first epoch")

    result = run_script(OUTSIDER, "geotrain", listen_address(swarm.log("trainer-0")), timeout_s=120)
    assert result.returncode == 0, result.stderr
    outsider = json.loads(result.stdout.strip().splitlines()[-1])
    assert outsider["join_group"] == "PROTOCOL_VIOLATION", outsider
    assert outsider["download_state_messages"] == 0, outsider
    assert not isinstance(outsider["store"], list) or not any(outsider["store"]), outsider
    assert not isinstance(outsider["find"], list), outsider  # no answer at all, not even "not found"

    refused = [e for e in read_events(events[0]) if e["event"] == "request_refused"]
    assert {(e["request"], e["reason"]) for e in refused if e["from_peer"] == outsider["outsider"]} == {
        ("join_group", "not admitted"), ("download_state", "not admitted")}, refused

    # a peer without the token cannot even join the DHT, and is told why
    joined = geotrain("peer", *IDLE_SWARM, "--initial-peers", swarm.initial_peers[0], "--bootstrap-timeout", "10",
                      "--max-epochs", "1", "--preemption", "none", timeout_s=120)
    assert joined.returncode == 3, joined.stderr
    assert "needs its token" in joined.stderr

    # the members went on training together
    epoch_before = last_epoch(events[0])
    wait_for(lambda: all(last_epoch(path) > epoch_before for path in events), 120, "the members' next epoch")
    assert not [e for e in read_events(events[1]) if e["event"] in ("request_refused", "contribution_refused")]
