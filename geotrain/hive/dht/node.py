"""Joining the swarm: DHT construction, addresses, identity and record validators.

Both roles (trainer and coordinator) join through :func:`start_dht`, so a wrong address, a port
in use, a bad identity file or an initial peer that does not answer gives the same clear error everywhere,
and a stop request (Ctrl-C) while joining ends the join at once.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeoutError

import hivemind
from hivemind.dht.schema import RSASignatureValidator, SchemaValidator
from hivemind.optim.progress_tracker import TrainingProgressSchema
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from geotrain.config import SwarmConfig
from geotrain.errors import StopRequested, SwarmUnreachableError, UserError
from geotrain.hive.hivemind_contract import check_hivemind_version
from geotrain.hive.dht.identity import check_identity_file
from geotrain.ports import ensure_port_free
from geotrain.stopping.processes import start_shared_memory_manager
from geotrain.hive.dht.admission import (Admission, MembershipAnnouncer, SwarmTokenAuthorizer, load_allowed_peer_ids,
                                         load_swarm_token)
from geotrain.hive.dht.metric_records import MetricsSchema
from geotrain.hive.dht.reachability import check_dialable, serve_reachability_checks
from geotrain.hive.dht.record_limits import RecordLimits

logger = logging.getLogger(__name__)

JOIN_POLL_S = 0.2  # how often a join that is still waiting looks at the stop request
DIAGNOSIS_TIMEOUT_S = 10.0  # at most this long to find out why no initial peer could be dialed
# p2pd's words when the peer listening at an address is not the one its /p2p/ part names (go-libp2p's security
# handshake). hivemind's DHT only says "failed to connect to bootstrap peers"; a dial of our own shows them.
_PEER_ID_MISMATCH = re.compile(r"\[([^\]\s]+)\][^\n]*peer id mismatch: expected (\w+), but remote key matches (\w+)")


class ListenError(UserError):
    """This peer's identity is already used by a running peer."""


def record_validators(run_id: str):
    """Validators that make every peer reject unsigned or malformed progress and metric records, and bound the
    size, rate and number of the run's records (a flood grows no memory)."""
    return [SchemaValidator(TrainingProgressSchema, prefix=run_id), SchemaValidator(MetricsSchema, prefix=run_id),
            RSASignatureValidator(), RecordLimits(run_id)]


def start_dht(swarm: SwarmConfig, stop: threading.Event | None = None):
    """Start this peer's DHT node; raise a :class:`~geotrain.errors.UserError` or
    :class:`SwarmUnreachableError` with an operator's message, or :class:`~geotrain.errors.StopRequested` as
    soon as ``stop`` is set while joining (within :data:`JOIN_POLL_S`, the DHT's processes stopped)."""
    check_hivemind_version()  # the overrides geotrain installs are written for one hivemind
    ensure_port_free(swarm.host, swarm.port, "DHT", "--port")
    token = load_swarm_token(swarm)  # an unreadable or short token: exit 2 before anything starts
    admission = Admission(swarm.run_id, token, load_allowed_peer_ids(swarm))
    if swarm.identity_path is not None:
        check_identity_file(swarm.identity_path)  # hivemind makes a missing one; a corrupt one: exit 2 here
    start_shared_memory_manager()  # before a Ctrl-C can interrupt torch starting it inside hivemind.DHT
    _raise_if_stopped(stop)
    if swarm.initial_peers:
        logger.info("joining the swarm through %s (waiting up to %.0f s)", ", ".join(swarm.initial_peers),
                    swarm.bootstrap_timeout_s)
    else:
        logger.info("starting the swarm's DHT (no initial peers)")
    dht = hivemind.DHT(
        initial_peers=swarm.initial_peers or None,
        host_maddrs=swarm.host_maddrs(),
        announce_maddrs=swarm.announce_maddrs(),
        identity_path=str(swarm.identity_path) if swarm.identity_path else None,
        client_mode=swarm.client_mode,
        record_validators=record_validators(swarm.run_id),
        authorizer=None if token is None else SwarmTokenAuthorizer(token),
        start=True,
        await_ready=False,
    )
    try:
        _wait_until_ready(dht, swarm.bootstrap_timeout_s, stop)
    except StopRequested:
        _stop_dht(dht, at_once=True)
        raise
    except FutureTimeoutError:
        _stop_dht(dht)
        _raise_if_stopped(stop)
        raise SwarmUnreachableError(
            f"no initial peer answered within {swarm.bootstrap_timeout_s:.0f} s "
            f"({', '.join(swarm.initial_peers) or 'none given'}); check that the coordinator is running and "
            "that its TCP port is open from this machine") from None
    except Exception as error:  # hivemind reports bootstrap and daemon failures as plain exceptions
        _stop_dht(dht)
        _raise_if_stopped(stop)  # Ctrl-C while the join was failing: the user asked to stop, not to be told
        message = str(error)
        if "already taken" in message:
            raise ListenError(
                f"the identity in {swarm.identity_path} is already used by a running peer; each peer needs its "
                "own identity file") from None
        if "none of the initial_peers responded" in message or "failed to connect to bootstrap peers" in message:
            why = _join_failure(swarm, token is not None, dialed="failed to connect to bootstrap peers" in message,
                                stop=stop)
            _raise_if_stopped(stop)  # (finding out why takes a moment)
            raise SwarmUnreachableError(why) from None
        raise SwarmUnreachableError(f"could not start the DHT node: {message}") from None
    serve_reachability_checks(dht)  # `geotrain doctor` of other peers asks how this one sees them
    if token is not None:
        announcer = MembershipAnnouncer(dht, admission)
        if not announcer.announce() and swarm.initial_peers:
            logger.warning("could not store this peer's membership proof yet; retrying every %.0f s",
                           announcer.interval_s)
        announcer.start()
    return dht


def start_dialable_dht(swarm: SwarmConfig, stop: threading.Event | None = None):
    """:func:`start_dht`, then (``swarm.check_reachability``) the reachability check: a peer that no initial peer
    can connect back to rejoins in client mode. Returns the DHT, the swarm config it runs with and how it
    stands ("dialable: ...", "client mode: ...", "not checked: ...")."""
    dht = start_dht(swarm, stop)
    if swarm.client_mode:
        return dht, swarm, "client mode: swarm.client_mode is set"
    if not swarm.check_reachability or not swarm.initial_peers:
        return dht, swarm, "not checked: " + ("swarm.check_reachability is off" if swarm.initial_peers else
                                               "no initial peers")
    verdict = check_dialable(dht, swarm.initial_peers)
    if verdict.dialable is None:
        return dht, swarm, f"not checked: {verdict.reason}"
    if verdict.dialable:
        return dht, swarm, f"dialable: {verdict.reason}"
    logger.warning("%s: the others could not dial this peer and would wait for it in vain; rejoining in client mode "
                   "(it dials out, trains and contributes, but is never a state donor and reduces no part). "
                   "`geotrain doctor` says what to open or announce", verdict.reason)
    _stop_dht(dht)
    _raise_if_stopped(stop)
    client = swarm.model_copy(update={"client_mode": True})
    return start_dht(client, stop), client, f"client mode: {verdict.reason}"


def _raise_if_stopped(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise StopRequested("a stop was requested while joining the swarm")


def _wait_until_ready(dht, timeout_s: float, stop: threading.Event | None) -> None:
    """``dht.wait_until_ready(timeout_s)``, giving up as soon as ``stop`` is set (StopRequested)."""
    deadline = time.monotonic() + timeout_s
    while True:
        _raise_if_stopped(stop)
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            raise FutureTimeoutError()
        try:
            dht.wait_until_ready(timeout=min(left_s, JOIN_POLL_S) if stop is not None else left_s)
            return
        except FutureTimeoutError:
            continue


def _join_failure(swarm: SwarmConfig, has_token: bool, dialed: bool, stop: threading.Event | None) -> str:
    """Why no initial peer let this one join, for the operator. ``dialed``: p2pd could not even connect to any
    of them (a closed port, or another peer at the address), rather than connecting and getting no DHT answer."""
    addresses = ", ".join(swarm.initial_peers)
    mismatches = other_peer_ids(swarm.initial_peers, stop=stop) if dialed else None
    if mismatches:
        found = "; ".join(f"at {address.rsplit('/p2p/', 1)[0]} a peer answered, but with peer id {actual}, not "
                          f"{address.rsplit('/p2p/', 1)[1]}" for address, actual in mismatches.items())
        rest = [address for address in swarm.initial_peers if address not in mismatches]
        return (f"{found}: the address's /p2p/ part names another peer than the one listening there; give the "
                "address `geotrain coordinator` prints now (a coordinator restarted without its identity.key, e.g. "
                "with another --state-dir, has a new peer id)"
                + (f"; the other initial peers did not answer ({', '.join(rest)})" if rest else ""))
    return (f"none of the initial peers answered ({addresses}); check that the coordinator is running, that its "
            "TCP port is open from this machine"
            + (" and that each address ends with the peer id the coordinator printed" if mismatches is None and dialed
               else "")
            + ("; this peer has a swarm token: check that it is the swarm's" if has_token else
               "; if the swarm is private, this peer needs its token (swarm.token_file)"))


def other_peer_ids(addresses: list[str], timeout_s: float = DIAGNOSIS_TIMEOUT_S,
                   stop: threading.Event | None = None) -> dict[str, str] | None:
    """For each of ``addresses`` where a peer answers with another peer id than the address's /p2p/ part, that
    peer id (``{address: actual peer id}``); None when it could not be found out within ``timeout_s``.

    Dials each address from a p2pd of its own, started for this and stopped after: hivemind's DHT reports only
    that no bootstrap peer could be dialed, while p2pd's answer to a dial says why (here: the key the remote
    peer proved does not match the peer id asked for).
    """
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["found"] = asyncio.run(_dial_each(addresses, timeout_s))
        except Exception as error:  # the diagnosis is a courtesy: the join failed either way
            logger.debug("could not dial the initial peers to see why the join failed: %s", error)

    worker = threading.Thread(target=run, name="dial-initial-peers", daemon=True)
    worker.start()
    deadline = time.monotonic() + timeout_s
    while worker.is_alive() and time.monotonic() < deadline and not (stop is not None and stop.is_set()):
        worker.join(JOIN_POLL_S)
    return outcome.get("found")


async def _dial_each(addresses: list[str], timeout_s: float) -> dict[str, str]:
    p2p = await P2P.create()
    try:
        found = {}
        for address in addresses:
            where, _, expected = address.rpartition("/p2p/")
            try:
                # P2P has no public "dial this address"; hivemind's own identity check dials like this
                await asyncio.wait_for(p2p._client.connect(PeerID.from_base58(expected), [Multiaddr(where)]),
                                       timeout_s / 2)
            except Exception as error:
                # one line per address dialed: "* [ADDRESS] failed to negotiate security protocol: peer id
                # mismatch: expected ID, but remote key matches OTHER_ID" (a DNS address shows as its IP)
                answers = [m.groups() for m in _PEER_ID_MISMATCH.finditer(str(error)) if m.group(2) == expected]
                answers = [a for a in answers if a[0] == where] or answers
                if answers:
                    found[address] = answers[0][2]
        return found
    finally:
        await p2p.shutdown()


def _stop_dht(dht, at_once: bool = False) -> None:
    """Stop a DHT node: ask it, give it hivemind's grace period, then terminate it.

    ``at_once`` (a stop request while joining): terminate it now, without the grace period it would spend in
    vain (a node still joining reads no requests); its process then stops its p2pd and exits (see
    geotrain.stopping.stopper). Not after it has reported its outcome: a process terminated while it still holds
    hivemind's lock shared by all of this peer's processes (MPFuture's, taken to report) keeps it held, and the
    next DHT node started here would wait for it forever.
    """
    if not at_once:
        try:
            dht.shutdown()
        except Exception:  # the node may never have come up
            pass
    if dht.is_alive():
        dht.terminate()
        dht.join(5.0)


def visible_addresses(dht) -> list[str]:
    """Full multiaddrs (with /p2p/PEER_ID) that other peers can pass as --initial-peers."""
    return [str(address) for address in dht.get_visible_maddrs()]


async def _connected_peer_addresses(_dht, node) -> list[str]:
    peers = await node.p2p.list_peers()
    return sorted({f"{address}/p2p/{info.peer_id}" for info in peers for address in info.addrs
                   if str(address).startswith("/ip4/") and "/tcp/" in str(address)})


def connected_peer_addresses(dht) -> list[str]:
    """Full multiaddrs of the peers this node is connected to (libp2p dials from its listen port)."""
    return dht.run_coroutine(_connected_peer_addresses)
