"""The reachability check every geotrain peer answers: how a peer looks from the outside (``geotrain doctor``).

The asking peer opens a stream to :data:`HANDLER_NAME` and sends one JSON line, the TCP ports it announces. The
answering peer replies at once with one line (its wall clock, and the address the stream came from: where the
others see the asking peer), then opens a TCP connection to that address at each port and sends the outcome as
a second line. It connects nowhere else: the check cannot be used to reach a third machine. Requests are small,
few ports are dialled, and one check runs at a time per peer.

Both sides run inside a DHT node's process (``DHT.run_coroutine``) on hivemind's public P2P stream API.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from functools import partial

from hivemind.p2p import PeerID

logger = logging.getLogger(__name__)

HANDLER_NAME = "geotrain.reachability.v1"
MAX_REQUEST_BYTES = 1024
MAX_PORTS = 4
DIAL_TIMEOUT_S = 3.0
REQUEST_TIMEOUT_S = 5.0  # for the asking peer to send its line

_one_at_a_time: asyncio.Semaphore | None = None


def serve_reachability_checks(dht) -> None:
    """Answer other peers' reachability checks from now on (until ``dht`` shuts down)."""
    dht.run_coroutine(_register)


async def _register(_dht, node) -> None:
    await node.p2p.add_binary_stream_handler(HANDLER_NAME, _answer)


def _host_and_port(multiaddr) -> tuple[str | None, int | None]:
    parts = str(multiaddr).split("/")
    host = parts[2] if len(parts) > 2 and parts[1] in ("ip4", "ip6", "dns", "dns4", "dns6") else None
    port = int(parts[4]) if len(parts) > 4 and parts[3] == "tcp" and parts[4].isdigit() else None
    return host, port


def requested_ports(line: bytes) -> list[int]:
    """The ports of a request line, or ValueError with what is wrong with it."""
    request = json.loads(line)
    ports = request.get("ports") if isinstance(request, dict) else None
    if not isinstance(ports, list) or not all(type(p) is int and 0 < p < 65536 for p in ports):
        raise ValueError("expected {\"ports\": [TCP ports]}")
    return sorted(set(ports))[:MAX_PORTS]


async def dial(host: str, port: int, timeout_s: float = DIAL_TIMEOUT_S) -> str | None:
    """None when a TCP connection to ``host:port`` opens within ``timeout_s``; else why it did not."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except asyncio.TimeoutError:
        return f"no answer within {timeout_s:.0f} s (a firewall drops it, or no route)"
    except OSError as error:
        return error.strerror or str(error)
    writer.close()
    return None


async def _answer(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    global _one_at_a_time
    if _one_at_a_time is None:
        _one_at_a_time = asyncio.Semaphore(1)
    try:
        line = await asyncio.wait_for(reader.readline(), REQUEST_TIMEOUT_S)
        if len(line) > MAX_REQUEST_BYTES:
            raise ValueError(f"request over {MAX_REQUEST_BYTES} bytes")
        ports = requested_ports(line)
        host, port = _host_and_port(stream_info.addr)
        writer.write(json.dumps({"time": time.time(), "seen_host": host, "seen_port": port}).encode() + b"\n")
        await writer.drain()
        async with _one_at_a_time:
            outcomes = {} if host is None else {str(p): await dial(host, p) for p in ports}
        writer.write(json.dumps({"dialed": outcomes}).encode() + b"\n")
        await writer.drain()
    except Exception as error:  # a bad or vanished asker: nothing of ours is at stake
        logger.debug("reachability check of %s not answered: %s", stream_info.peer_id, error)
    finally:
        writer.close()


@dataclass
class ReachabilityAnswer:
    """What one peer answered: where it sees the asking peer, its clock, and which ports it could connect to."""

    peer_id: str
    seen_host: str | None
    seen_port: int | None
    round_trip_s: float  # the request line out, the first answer line back
    clock_offset_s: float  # its wall clock minus ours, at the middle of the round trip
    dialed: dict[int, str | None]  # port -> None (connected) or why not


def clock_offset_s(sent_s: float, their_time_s: float, received_s: float) -> float:
    """Their clock minus ours, taking their reading as made halfway through the round trip (as NTP does);
    uncertain by half the round trip."""
    return their_time_s - (sent_s + received_s) / 2


async def _ask(peer_id: str, ports: list[int], timeout_s: float, _dht, node) -> dict:
    """The exchange, from inside the DHT process; a failure comes back as ``{"error": ...}`` (raised there, it
    would be logged by hivemind as a crash of the DHT's coroutine)."""
    try:
        _, reader, writer = await asyncio.wait_for(
            node.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), HANDLER_NAME), timeout_s)
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}".splitlines()[0]}
    try:
        sent_s = time.time()
        writer.write(json.dumps({"ports": ports}).encode() + b"\n")
        await writer.drain()
        first = await asyncio.wait_for(reader.readline(), timeout_s)
        received_s = time.time()
        second = await asyncio.wait_for(reader.readline(), timeout_s + DIAL_TIMEOUT_S * len(ports))
    except Exception as error:
        return {"error": f"{type(error).__name__} during the exchange: {error}".splitlines()[0]}
    finally:
        writer.close()
    return {"sent_s": sent_s, "received_s": received_s, "first": first.decode(), "second": second.decode()}


def ask_reachability(dht, peer_id: str, ports: list[int], timeout_s: float = 10.0) -> ReachabilityAnswer:
    """Ask the peer ``peer_id`` (connected or dialable through the DHT) to check ``ports`` of this peer.
    Raises on no answer (the peer cannot be reached, or runs no geotrain that answers checks)."""
    raw = dht.run_coroutine(partial(_ask, peer_id, ports[:MAX_PORTS], timeout_s))
    if "error" in raw:
        raise ConnectionError(raw["error"])
    if not raw["first"] or not raw["second"]:
        raise ConnectionError("the peer closed the stream without an answer")
    first, second = json.loads(raw["first"]), json.loads(raw["second"])
    return ReachabilityAnswer(
        peer_id=peer_id, seen_host=first.get("seen_host"), seen_port=first.get("seen_port"),
        round_trip_s=raw["received_s"] - raw["sent_s"],
        clock_offset_s=clock_offset_s(raw["sent_s"], float(first["time"]), raw["received_s"]),
        dialed={int(port): outcome for port, outcome in second.get("dialed", {}).items()})


def announced_addresses(dht) -> list[tuple[str, int]]:
    """(host, port) of each IPv4 TCP address this peer gives the others to dial it."""
    found = []
    for address in dht.get_visible_maddrs():
        host, port = _host_and_port(address)
        if host is not None and port is not None and str(address).startswith("/ip4/") and (host, port) not in found:
            found.append((host, port))
    return found


@dataclass
class Dialability:
    dialable: bool | None  # None: no initial peer answered the check
    reason: str


def check_dialable(dht, initial_peers: list[str], timeout_s: float = 5.0) -> Dialability:
    """Whether the first initial peer that answers the check could connect to one of this peer's announced
    addresses, where it sees this peer (it connects nowhere else)."""
    announced = announced_addresses(dht)
    for address in initial_peers:
        peer_id = address.rsplit("/p2p/", 1)[-1]
        try:
            answer = ask_reachability(dht, peer_id, sorted({port for _, port in announced}), timeout_s)
        except Exception as error:
            logger.debug("%s did not answer the reachability check: %s", address, error)
            continue
        checked = [(host, port) for host, port in announced if host == answer.seen_host]
        for host, port in checked:
            if answer.dialed.get(port, "not dialled") is None:
                return Dialability(True, f"{peer_id} connected to {host}:{port}")
        if checked:
            why = "; ".join(f"{host}:{port}: {answer.dialed.get(port, 'not dialled')}" for host, port in checked)
        else:
            tried = "; ".join(f"{answer.seen_host}:{port}: {answer.dialed.get(port) or 'connected'}"
                              for port in sorted({port for _, port in announced}))
            why = (f"it sees this peer at {answer.seen_host}, which this peer does not announce "
                   f"({', '.join(f'{host}:{port}' for host, port in announced) or 'no address'})"
                   + (f"; there: {tried}" if tried else ""))
        return Dialability(False, f"{peer_id} could not connect to this peer ({why})")
    return Dialability(None, "no initial peer answered the reachability check")
