"""`geotrain doctor`'s verdicts (what it tells a user to change) and the reachability check every peer answers.

The checks against a live coordinator, with real failures (a closed port, another peer at an address, an
announced port nobody can reach, NAT), are in tests/integration/test_doctor.py.
"""

from __future__ import annotations

import asyncio
import json
from functools import partial

import hivemind
import pytest
from hivemind.p2p import PeerID

from geotrain.doctor import (AddressCheck, Findings, InitialPeerCheck, exit_code, format_report, problems,
                             suggested_profile, tcp_probe)
from geotrain.hive.dht.reachability import (HANDLER_NAME, MAX_PORTS, ask_reachability, clock_offset_s,
                                            requested_ports, serve_reachability_checks)
from geotrain.hive.dht.multiaddrs import split_peer_address
from geotrain.ports import free_ports

COORDINATOR = "QmSeeUsCoordinatorPeerIdForTheVerdictTestsOnly1"


def healthy(**changes) -> Findings:
    """A peer that joined through one coordinator 2 ms away that sees it where it announces itself."""
    findings = Findings(network_profile="lan", request_timeout_s=1.0, client_mode=False, port_setting=31337,
                        initial_peers=[InitialPeerCheck(
                            address=f"/ip4/203.0.113.1/tcp/31337/p2p/{COORDINATOR}", host="203.0.113.1", port=31337,
                            peer_id=COORDINATOR, tcp_round_trip_s=0.002, round_trip_s=0.002, clock_offset_s=0.01,
                            seen_at="198.51.100.7:31337")],
                        addresses=[AddressCheck("198.51.100.7", 31337, dialed_by=COORDINATOR)])
    for key, value in changes.items():
        setattr(findings, key, value)
    return findings


def test_a_peer_that_joins_and_can_be_dialled_has_nothing_to_change():
    findings = healthy()
    assert problems(findings) == [] and exit_code(findings) == 0
    assert "ready: a peer started with these flags joins the swarm and the others can dial it" in format_report(findings)


@pytest.mark.parametrize("offset_s, way", [(5.0, "behind"), (-2.5, "ahead of")])
def test_a_clock_off_by_more_than_a_second_is_named_with_its_direction(offset_s, way):
    findings = healthy()
    findings.initial_peers[0].clock_offset_s = offset_s
    [problem] = problems(findings)
    assert f"clock is {abs(offset_s):.1f} s {way} {COORDINATOR}'s" in problem and "chrony" in problem
    assert exit_code(findings) == 3


def test_a_round_trip_too_long_for_the_network_profile_names_the_profile_to_use():
    findings = healthy()
    findings.initial_peers[0].round_trip_s = 0.6  # 4 round trips: 2.4 s > lan's 1 s, within continent's 3 s
    [problem] = problems(findings)
    assert "takes 600 ms, too long for network profile lan" in problem and "--network-profile continent" in problem
    assert suggested_profile(0.0001) == "loopback" and suggested_profile(2.0) == "intercontinental"


def test_an_announced_port_nobody_can_connect_to_says_open_it_or_use_client_mode():
    findings = healthy(addresses=[AddressCheck("198.51.100.7", 31337, dialed_by=COORDINATOR,
                                               problem="Connection refused")])
    [problem] = problems(findings)
    assert "no other peer can dial this one" in problem and "open TCP port 31337" in problem
    assert "--client-mode" in problem
    assert "FAIL 198.51.100.7:31337: Connection refused" in format_report(findings)


def test_behind_nat_with_a_forwarded_port_says_which_address_to_announce():
    findings = healthy(addresses=[AddressCheck("10.0.0.5", 31337, checked=False, seen_host="198.51.100.7",
                                               seen_host_works=True, problem="not checked")])
    [problem] = problems(findings)
    assert "--announce-host 198.51.100.7" in problem and "open TCP port" not in problem


def test_behind_nat_without_a_forwarded_port_and_a_random_port_says_to_fix_the_port_first():
    findings = healthy(port_setting=0, addresses=[AddressCheck("10.0.0.5", 40123, checked=False,
                                                               seen_host="198.51.100.7", problem="not checked")])
    [problem] = problems(findings)
    assert "open TCP port 40123" in problem and "if 198.51.100.7 forwards it here, --announce-host" in problem
    assert "give a fixed --port first" in problem


def test_a_client_mode_peer_is_ready_without_being_dialled_and_is_told_what_it_cannot_do():
    findings = healthy(client_mode=True, addresses=[])
    assert problems(findings) == []
    assert "never a state donor" in format_report(findings)


def test_no_initial_peer_listening_is_a_problem_for_each_and_for_the_join():
    findings = healthy(join_problem="no initial peer listens", addresses=[])
    findings.initial_peers[0] = InitialPeerCheck(address="/ip4/127.0.0.1/tcp/9/p2p/" + COORDINATOR,
                                                 host="127.0.0.1", port=9, peer_id=COORDINATOR,
                                                 tcp_problem="nothing listens there (connection refused)")
    found = problems(findings)
    assert len(found) == 2 and "127.0.0.1:9: nothing listens there" in found[0]
    assert "give the address `geotrain coordinator` prints" in found[1]
    assert exit_code(findings) == 3


def test_tcp_probe_of_a_free_port_says_nothing_listens():
    round_trip_s, problem = tcp_probe("127.0.0.1", free_ports(1)[0])
    assert round_trip_s is None and problem == "nothing listens there (connection refused)"


def test_split_peer_address():
    assert split_peer_address(f"/ip4/10.1.2.3/tcp/31337/p2p/{COORDINATOR}") == ("10.1.2.3", 31337, COORDINATOR)
    assert split_peer_address(f"/dns4/coord.example/tcp/4001/p2p/{COORDINATOR}")[:2] == ("coord.example", 4001)


def test_clock_offset_takes_the_answer_as_made_halfway_through_the_round_trip():
    assert clock_offset_s(100.0, 103.5, 101.0) == pytest.approx(3.0)
    assert clock_offset_s(100.0, 100.5, 101.0) == pytest.approx(0.0)


@pytest.mark.parametrize("line", [b"not json\n", b"[1, 2]\n", b'{"ports": "80"}\n', b'{"ports": [0]}\n',
                                  b'{"ports": [70000]}\n', b'{"ports": [true]}\n'])
def test_a_malformed_request_is_refused(line):
    with pytest.raises(ValueError):
        requested_ports(line)


def test_a_request_is_cut_to_a_few_ports():
    assert requested_ports(json.dumps({"ports": list(range(1000, 1010))}).encode()) == list(range(1000, 1000 + MAX_PORTS))


async def _send_raw(line: bytes, peer_id: str, _dht, node) -> bytes:
    _, reader, writer = await node.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), HANDLER_NAME)
    writer.write(line)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


@pytest.fixture(scope="module")
def answering_peer_and_asker():
    answering = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    serve_reachability_checks(answering)
    asker = hivemind.DHT(initial_peers=[str(a) for a in answering.get_visible_maddrs()],
                         host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    yield answering, asker
    asker.shutdown()
    answering.shutdown()


def test_a_peer_answers_where_it_sees_the_asker_and_which_of_its_ports_it_can_connect_to(answering_peer_and_asker):
    answering, asker = answering_peer_and_asker
    listening = int(str(asker.get_visible_maddrs()[0]).split("/")[4])
    closed = free_ports(1)[0]
    answer = ask_reachability(asker, str(answering.peer_id), [listening, closed])
    assert answer.seen_host == "127.0.0.1"
    assert answer.dialed == {listening: None, closed: "Connection refused"}
    assert 0 < answer.round_trip_s < 5 and abs(answer.clock_offset_s) < 1


def test_a_garbage_or_oversized_request_gets_no_answer_and_the_next_check_is_answered(answering_peer_and_asker):
    answering, asker = answering_peer_and_asker
    for line in (b"\x00\xffgarbage\n", b'{"ports": [' + b"1," * 2000 + b"1]}\n"):
        assert asker.run_coroutine(partial(_send_raw, line, str(answering.peer_id))) == b""
    assert ask_reachability(asker, str(answering.peer_id), []).seen_host == "127.0.0.1"


def test_a_peer_that_does_not_answer_checks_is_an_error_not_a_hang():
    silent = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)  # stock hivemind: no handler
    asker = hivemind.DHT(initial_peers=[str(a) for a in silent.get_visible_maddrs()], start=True)
    try:
        with pytest.raises(ConnectionError, match="protocol"):
            ask_reachability(asker, str(silent.peer_id), [], timeout_s=5)
    finally:
        asker.shutdown()
        silent.shutdown()
