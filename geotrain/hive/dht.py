"""Joining the swarm: DHT construction, addresses, identity and record validators.

Both roles (trainer and coordinator) join through :func:`start_dht`, so a wrong address, a port
in use or an initial peer that does not answer gives the same clear error everywhere.
"""

from __future__ import annotations

import logging
from concurrent.futures import TimeoutError as FutureTimeoutError

import hivemind
from hivemind.dht.schema import RSASignatureValidator, SchemaValidator
from hivemind.optim.progress_tracker import TrainingProgressSchema

from geotrain.config import SwarmConfig
from geotrain.errors import SwarmUnreachableError, UserError
from geotrain.ports import ensure_port_free
from geotrain.hive.admission import (Admission, MembershipAnnouncer, SwarmTokenAuthorizer, load_allowed_peer_ids,
                                     load_swarm_token)
from geotrain.hive.metric_records import MetricsSchema
from geotrain.hive.record_limits import RecordLimits

logger = logging.getLogger(__name__)


class ListenError(UserError):
    """This peer's identity is already used by a running peer."""


def record_validators(run_id: str):
    """Validators that make every peer reject unsigned or malformed progress and metric records, and bound the
    size, rate and number of the run's records (a flood grows no memory)."""
    return [SchemaValidator(TrainingProgressSchema, prefix=run_id), SchemaValidator(MetricsSchema, prefix=run_id),
            RSASignatureValidator(), RecordLimits(run_id)]


def start_dht(swarm: SwarmConfig):
    """Start this peer's DHT node; raise a :class:`~geotrain.errors.UserError` or
    :class:`SwarmUnreachableError` with an operator's message."""
    ensure_port_free(swarm.host, swarm.port, "DHT", "--port")
    token = load_swarm_token(swarm)  # an unreadable or short token: exit 2 before anything starts
    admission = Admission(swarm.run_id, token, load_allowed_peer_ids(swarm))
    if swarm.identity_path is not None:
        swarm.identity_path.parent.mkdir(parents=True, exist_ok=True)
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
        dht.wait_until_ready(timeout=swarm.bootstrap_timeout_s)
    except FutureTimeoutError:
        _stop_dht(dht)
        raise SwarmUnreachableError(
            f"no initial peer answered within {swarm.bootstrap_timeout_s:.0f} s "
            f"({', '.join(swarm.initial_peers) or 'none given'}); check that the coordinator is running and "
            "that its TCP port is open from this machine") from None
    except Exception as error:  # hivemind reports bootstrap and daemon failures as plain exceptions
        _stop_dht(dht)
        message = str(error)
        if "none of the initial_peers responded" in message or "failed to connect to bootstrap peers" in message:
            raise SwarmUnreachableError(
                f"none of the initial peers answered ({', '.join(swarm.initial_peers)}); check that the "
                "coordinator is running and that its TCP port is open from this machine"
                + ("; this peer has a swarm token: check that it is the swarm's" if token is not None else
                   "; if the swarm is private, this peer needs its token (swarm.token_file)")) from None
        if "already taken" in message:
            raise ListenError(
                f"the identity in {swarm.identity_path} is already used by a running peer; each peer needs its "
                "own identity file") from None
        raise SwarmUnreachableError(f"could not start the DHT node: {message}") from None
    if token is not None:
        announcer = MembershipAnnouncer(dht, admission)
        if not announcer.announce() and swarm.initial_peers:
            logger.warning("could not store this peer's membership proof yet; retrying every %.0f s",
                           announcer.interval_s)
        announcer.start()
    return dht


def _stop_dht(dht) -> None:
    try:
        dht.shutdown()
    except Exception:  # the node may never have come up
        pass
    if dht.is_alive():
        dht.terminate()


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
