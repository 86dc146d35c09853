"""Reachability against a live coordinator: what `geotrain doctor` says, before training, for a peer that would join
and be reachable, and for each way one would not (a closed port, another peer at the address, an announced port no
one can connect to, an announced address the swarm does not see it at); and a trainer no one can dial, which
trains in client mode. Verdicts in detail: tests/unit/test_doctor.py."""

from __future__ import annotations

import json

from geotrain.ports import free_ports
from swarm_helpers import IDLE_SWARM, geotrain, run_report, train_two

OTHER_PEER_ID = "QmbwQLybpb6T3zZhNuqy146pPqZUV3UksSSavHtEEFPLRU"  # a valid peer id that no peer here has


def doctor(*arguments: str):
    return geotrain("doctor", "--network-profile", "loopback", *arguments, timeout_s=120)


def test_a_peer_that_would_join_and_be_reachable_is_ready(bootstrap_coordinator):
    [coordinator] = bootstrap_coordinator.initial_peers
    result = doctor("--initial-peers", coordinator, "--json")
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    findings = json.loads(result.stdout)
    assert findings["ready"] is True and findings["problems"] == []
    [peer] = findings["initial_peers"]
    assert peer["tcp_problem"] is None and peer["check_problem"] is None
    assert 0 < peer["round_trip_s"] < 1 and abs(peer["clock_offset_s"]) < 1  # one machine: one clock
    [address] = findings["addresses"]
    assert address["problem"] is None and address["dialed_by"] == coordinator.rsplit("/", 1)[1]
    assert peer["seen_at"] == f"{address['host']}:{address['port']}"


def test_each_unusable_initial_peer_and_an_unreachable_announced_port_are_named(bootstrap_coordinator):
    [coordinator] = bootstrap_coordinator.initial_peers
    closed, unreachable = free_ports(2)
    wrong_peer = f"{coordinator.rsplit('/p2p/', 1)[0]}/p2p/{OTHER_PEER_ID}"
    result = doctor("--initial-peers", coordinator, "--initial-peers", f"/ip4/127.0.0.1/tcp/{closed}/p2p/{OTHER_PEER_ID}",
                    "--initial-peers", wrong_peer, "--announce-host", "127.0.0.1", "--announce-port", str(unreachable))
    assert result.returncode == 3, f"{result.stdout}\n{result.stderr}"
    report = result.stdout
    assert f"FAIL 127.0.0.1:{closed}: nothing listens there (connection refused)" in report
    assert f"another peer listens there: {coordinator.rsplit('/', 1)[1]}, not {OTHER_PEER_ID}" in report
    assert f"FAIL 127.0.0.1:{unreachable}: Connection refused" in report
    assert f"open TCP port {unreachable} to this machine" in report and "--client-mode" in report
    assert "join: ok" in report  # one good initial peer is enough to join
    assert "Traceback" not in result.stderr


def test_an_announced_address_the_swarm_does_not_see_this_peer_at_is_corrected(bootstrap_coordinator):
    [coordinator] = bootstrap_coordinator.initial_peers
    [port] = free_ports(1)
    result = doctor("--initial-peers", coordinator, "--port", str(port), "--announce-host", "127.0.0.2")
    assert result.returncode == 3, f"{result.stdout}\n{result.stderr}"
    assert "the peers see this one at 127.0.0.1, not 127.0.0.2" in result.stdout
    assert "--announce-host 127.0.0.1" in result.stdout  # a connection there at its port opened


def test_no_initial_peer_listening_is_said_at_once_without_joining(run_cli):
    [closed] = free_ports(1)
    result = run_cli("doctor", "--initial-peers", f"/ip4/127.0.0.1/tcp/{closed}/p2p/{OTHER_PEER_ID}")
    assert result.returncode == 3
    assert f"127.0.0.1:{closed}: nothing listens there" in result.stdout
    assert "join: FAIL no initial peer listens" in result.stdout


def test_a_trainer_no_one_can_dial_rejoins_in_client_mode_trains_and_contributes(bootstrap_coordinator):
    [unreachable] = free_ports(1)  # what it announces: nothing listens there, as behind a NAT or a closed port
    run = train_two(bootstrap_coordinator, "unreachable", *IDLE_SWARM, epochs=2,
                    second_arguments=("--announce-host", "127.0.0.1", "--announce-port", str(unreachable)))
    logs = run_report(run)
    assert run["exit_codes"] == [0, 0], logs
    dialable, hidden = ([e for e in events if e["event"] == "joined"][0]["reachability"] for events in run["events"])
    assert dialable.startswith("dialable: "), dialable
    assert hidden.startswith("client mode: ") and f"127.0.0.1:{unreachable}: Connection refused" in hidden, hidden
    assert "rejoining in client mode" in run["logs"]["unreachable-1"]
    finished = run["finished"]
    assert all(f is not None and f["epoch"] == 2 for f in finished), logs
    assert finished[0]["params_sha256"] == finished[1]["params_sha256"], logs
    # it contributed: the dialable trainer reduced every round and received the client's gradients for it (in a
    # round without the client it would have received nothing); the client reduced no part
    assert finished[1]["samples"] > 0, finished[1]
    assert finished[0]["averaging_payload_bytes"]["received"] > 0, finished[0]
    assert finished[1]["averaging_payload_bytes"] == {"received": 0, "sent": 0}, finished[1]
