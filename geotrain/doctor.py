"""``geotrain doctor``: whether a peer started with these flags would join the swarm and be reachable, in a few
seconds and before anything trains. It takes the flags of ``geotrain peer`` and checks, in order:

1. each initial peer: is anything listening at its address (TCP, with the round trip of the handshake)?
2. the join: does this peer's DHT node start and join through them (port free, token, identity, peer ids)?
3. each initial peer that answers the reachability check (:mod:`geotrain.hive.dht.reachability`): the round
   trip over the swarm's connection, where it sees this peer, the clock offset, and whether it can open a TCP
   connection to each port this peer announces (which is what every other peer needs to dial this one).

Then it says what to change, one line per problem, and exits 0 (nothing to change) or 3.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from dataclasses import asdict, dataclass, field

from geotrain.config import NETWORK_PROFILES, GeotrainConfig
from geotrain.errors import EXIT_OK, EXIT_SWARM_UNREACHABLE, SwarmUnreachableError
from geotrain.hive.dht.multiaddrs import split_peer_address

TCP_TIMEOUT_S = 3.0
CHECK_TIMEOUT_S = 5.0
# hivemind's records (progress, metrics, membership) expire at wall-clock times written by their owners: a
# clock off by seconds makes this peer's records expire early or late for every other peer
CLOCK_OFFSET_LIMIT_S = 1.0
# a request over a new libp2p stream takes a few round trips (TCP, security and multiplexer handshakes)
ROUND_TRIPS_PER_REQUEST = 4


@dataclass
class InitialPeerCheck:
    address: str
    host: str
    port: int
    peer_id: str
    tcp_round_trip_s: float | None = None
    tcp_problem: str | None = None
    round_trip_s: float | None = None  # of a request over the swarm's connection (the reachability check)
    clock_offset_s: float | None = None  # its clock minus this machine's
    seen_at: str | None = None  # HOST:PORT: where it sees this peer come from
    check_problem: str | None = None


@dataclass
class AddressCheck:
    host: str
    port: int
    dialed_by: str | None = None  # the peer id of the initial peer that tried to connect
    problem: str | None = None  # None: it connected
    checked: bool = True
    seen_host: str | None = None  # not checked: where the peers see this one instead ...
    seen_host_works: bool = False  # ... and whether a connection there at this port opened


@dataclass
class Findings:
    network_profile: str
    request_timeout_s: float
    client_mode: bool
    port_setting: int  # 0: a free port, another one at each start
    initial_peers: list[InitialPeerCheck] = field(default_factory=list)
    join_problem: str | None = None
    addresses: list[AddressCheck] = field(default_factory=list)


def tcp_probe(host: str, port: int, timeout_s: float = TCP_TIMEOUT_S) -> tuple[float | None, str | None]:
    """(the TCP handshake's round trip, None) when something listens at ``host:port``; (None, why not) else."""
    started = time.perf_counter()
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return time.perf_counter() - started, None
    except socket.timeout:
        return None, f"no answer within {timeout_s:.0f} s (a firewall drops it, or the host is down)"
    except OSError as error:
        if isinstance(error, ConnectionRefusedError):
            return None, "nothing listens there (connection refused)"
        return None, error.strerror or str(error)


def examine(config: GeotrainConfig, stop=None) -> Findings:
    """Run the checks (this starts, and stops, a DHT node of this peer's)."""
    swarm = config.swarm
    findings = Findings(network_profile=config.optimizer.network_profile,
                        request_timeout_s=config.optimizer.request_timeout_s, client_mode=swarm.client_mode,
                        port_setting=swarm.announce_port or swarm.port)
    for address in swarm.initial_peers:
        host, port, peer_id = split_peer_address(address)
        check = InitialPeerCheck(address=address, host=host, port=port, peer_id=peer_id)
        check.tcp_round_trip_s, check.tcp_problem = tcp_probe(host, port)
        findings.initial_peers.append(check)
    if not any(check.tcp_problem is None for check in findings.initial_peers):
        findings.join_problem = "no initial peer listens"
        return findings
    from geotrain.hive.dht.node import other_peer_ids, start_dht  # hivemind: only when there is a peer to ask
    from geotrain.hive.dht.reachability import announced_addresses, ask_reachability

    try:
        dht = start_dht(swarm, stop)
    except SwarmUnreachableError as error:
        findings.join_problem = str(error)
        return findings
    try:
        own = [] if swarm.client_mode else announced_addresses(dht)
        ports = sorted({port for _, port in own})
        for check in findings.initial_peers:
            if check.tcp_problem is not None:
                continue
            try:
                answer = ask_reachability(dht, check.peer_id, ports, timeout_s=CHECK_TIMEOUT_S)
            except Exception as error:
                found = other_peer_ids([check.address], stop=stop) or {}
                if check.address in found:
                    check.check_problem = (f"another peer listens there: {found[check.address]}, not "
                                           f"{check.peer_id}")
                else:
                    check.check_problem = (f"its port answers, but it did not answer geotrain's check "
                                           f"({error}); an older geotrain, or not a geotrain peer")
                continue
            check.round_trip_s, check.clock_offset_s = answer.round_trip_s, answer.clock_offset_s
            check.seen_at = f"{answer.seen_host}:{answer.seen_port}" if answer.seen_host else None
            if not findings.addresses:  # the first peer that answers checks this peer's addresses
                findings.addresses = [_address_check(host, port, answer) for host, port in own]
    finally:
        dht.shutdown()
    return findings


def _address_check(host: str, port: int, answer) -> AddressCheck:
    """What the answering peer found at ``host:port``. It connects only to the address it sees this peer at:
    an announced address elsewhere (a private one behind NAT, or a wrong --announce-host) is not checked, and
    the connection to the seen address at that port says whether announcing that one instead would work."""
    outcome = answer.dialed.get(port, "not dialled")
    if host == answer.seen_host:
        return AddressCheck(host, port, dialed_by=answer.peer_id, problem=outcome)
    if _is_loopback(host) and not _is_loopback(answer.seen_host):
        return AddressCheck(host, port, checked=False, problem="only this machine can reach it")
    at_seen = "opened" if outcome is None else f"failed ({outcome})"
    return AddressCheck(host, port, checked=False, seen_host=answer.seen_host, seen_host_works=outcome is None,
                        problem=f"not checked: the peers see this one at {answer.seen_host}, not {host}; a "
                                f"connection to {answer.seen_host}:{port} {at_seen}")


def _is_loopback(host: str | None) -> bool:
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _closest_answer(findings: Findings) -> InitialPeerCheck | None:
    answered = [check for check in findings.initial_peers if check.round_trip_s is not None]
    return min(answered, key=lambda check: check.round_trip_s) if answered else None


def suggested_profile(round_trip_s: float) -> str:
    """The first network profile whose request timeout holds :data:`ROUND_TRIPS_PER_REQUEST` round trips."""
    for name, settings in NETWORK_PROFILES.items():
        if settings["request_timeout_s"] >= ROUND_TRIPS_PER_REQUEST * round_trip_s:
            return name
    return "intercontinental"


def problems(findings: Findings) -> list[str]:
    """What to change, one line each; empty when a peer started with these flags would join and be reachable."""
    found = []
    for check in findings.initial_peers:
        if check.tcp_problem is not None:
            found.append(f"{check.host}:{check.port}: {check.tcp_problem}; check that the peer runs and that its "
                         "TCP port is open from this machine")
        elif check.check_problem is not None:
            found.append(f"{check.address}: {check.check_problem}")
    if findings.join_problem is not None and findings.join_problem != "no initial peer listens":
        found.append(f"the join failed: {findings.join_problem}")
    if not any(check.tcp_problem is None for check in findings.initial_peers):
        found.append("no initial peer listens: give the address `geotrain coordinator` prints (--initial-peers)")
    closest = _closest_answer(findings)
    if closest is not None:
        if abs(closest.clock_offset_s) > CLOCK_OFFSET_LIMIT_S:
            way = "behind" if closest.clock_offset_s > 0 else "ahead of"
            found.append(f"this machine's clock is {abs(closest.clock_offset_s):.1f} s {way} {closest.peer_id}'s: "
                         "the swarm's records expire at wall-clock times, so this peer's would expire early or late "
                         "for the others; synchronise the clock (chrony or systemd-timesyncd)")
        if ROUND_TRIPS_PER_REQUEST * closest.round_trip_s > findings.request_timeout_s:
            found.append(f"a round trip to the nearest initial peer takes {closest.round_trip_s * 1e3:.0f} ms, too "
                         f"long for network profile {findings.network_profile} (requests time out after "
                         f"{findings.request_timeout_s:.1f} s): use --network-profile "
                         f"{suggested_profile(closest.round_trip_s)}")
    if findings.client_mode or closest is None or not findings.addresses:
        return found
    if not any(a.checked and a.problem is None for a in findings.addresses):
        seen_host = closest.seen_at.rsplit(":", 1)[0] if closest.seen_at else "?"
        announced = ", ".join(f"{a.host}:{a.port}" for a in findings.addresses)
        works_at_seen = [a for a in findings.addresses if a.seen_host_works]
        if works_at_seen:
            change = f"announce the address the peers see: --announce-host {seen_host}"
        else:
            change = f"open TCP port {findings.addresses[0].port} to this machine (firewall, security group)"
            if not any(a.checked for a in findings.addresses):
                change += f" and, if {seen_host} forwards it here, --announce-host {seen_host}"
        fixed = ("; give a fixed --port first (0 picks another free port at each start)"
                 if findings.port_setting == 0 and not all(_is_loopback(a.host) for a in findings.addresses) else "")
        found.append(f"no other peer can dial this one (it announces {announced}; the swarm sees it at "
                     f"{seen_host}): {change}{fixed}; or let it train dialling out only (--client-mode, which a trainer "
                     "nobody can dial also takes by itself when it joins): it is then never a state donor and reduces "
                     "no part of the averaging, and a coordinator must be dialable")
    return found


def _mark(problem: str | None) -> str:
    return "ok  " if problem is None else "FAIL"


def format_report(findings: Findings) -> str:
    lines = ["initial peers:"]
    for check in findings.initial_peers:
        where = f"{check.host}:{check.port}"
        if check.tcp_problem is not None:
            lines.append(f"  FAIL {where}: {check.tcp_problem}")
        elif check.check_problem is not None:
            lines.append(f"  FAIL {where}: {check.check_problem}")
        elif check.round_trip_s is None:
            lines.append(f"  ?    {where}: listens (TCP round trip {check.tcp_round_trip_s * 1e3:.1f} ms); not "
                         "checked further (the join failed)")
        else:
            lines.append(f"  ok   {where}: {check.peer_id}, round trip {check.round_trip_s * 1e3:.1f} ms, its clock "
                         f"{check.clock_offset_s:+.3f} s from this machine's, sees this peer at {check.seen_at}")
    lines.append(f"join: {_mark(findings.join_problem)} "
                 + ("joined the swarm's DHT" if findings.join_problem is None else findings.join_problem))
    if findings.client_mode:
        lines.append("this peer's addresses: none (--client-mode: it dials out only)")
    elif findings.addresses:
        lines.append("this peer's addresses, as the others dial them:")
        for check in findings.addresses:
            outcome = ("connected" if check.problem is None else check.problem) if check.checked else check.problem
            lines.append(f"  {_mark(check.problem) if check.checked else '-   '} {check.host}:{check.port}: {outcome}"
                         + (f" (dialled by {check.dialed_by})" if check.checked else ""))
    found = problems(findings)
    if found:
        lines.append("what to change:")
        lines += [f"  - {problem}" for problem in found]
    else:
        reach = ("it dials out only, so it is never a state donor and reduces no part of the averaging"
                 if findings.client_mode else "the others can dial it")
        lines.append(f"ready: a peer started with these flags joins the swarm and {reach} "
                     f"(network profile {findings.network_profile})")
    return "\n".join(lines)


def findings_json(findings: Findings) -> dict:
    return {**asdict(findings), "problems": problems(findings), "ready": not problems(findings)}


def exit_code(findings: Findings) -> int:
    return EXIT_OK if not problems(findings) else EXIT_SWARM_UNREACHABLE
