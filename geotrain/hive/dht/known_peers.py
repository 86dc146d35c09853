"""The peers a peer was connected to, kept in a file: after a restart it joins through them as well as through its
initial peers, so a trainer can rejoin a swarm whose coordinator is down, and a restarted coordinator finds its
swarm again (the trainers do not dial it back).

The file is this peer's own bookkeeping, rewritten whole (by a rename) as the swarm changes: an address in it
that no longer answers costs nothing but a failed dial, and a file that cannot be read is logged and ignored,
never a reason not to start.
"""

from __future__ import annotations

import logging
from pathlib import Path

from geotrain.hive.dht.multiaddrs import multiaddr_problem

logger = logging.getLogger(__name__)


def read_known_peers(path: Path | None) -> list[str]:
    """The addresses kept in ``path``, those that are peer addresses; [] when there is none yet."""
    if path is None or not path.exists():
        return []
    try:
        words = path.read_text().split()
    except (OSError, UnicodeDecodeError) as error:
        logger.warning("cannot read the known peers in %s (%s); joining through the initial peers only", path, error)
        return []
    addresses = [word for word in words if multiaddr_problem(word) is None]
    if len(addresses) < len(words):
        logger.warning("%d entries of %s are not peer addresses; ignored", len(words) - len(addresses), path)
    return addresses


def joining_through(initial_peers: list[str], known_peers_file: Path | None) -> list[str]:
    """The initial peers, then the known ones that are not among them."""
    return [*initial_peers, *(a for a in read_known_peers(known_peers_file) if a not in initial_peers)]


def remember_peers(dht, path: Path) -> None:
    """Write the addresses of the peers ``dht`` is connected to into ``path`` (whole or not at all); nothing when
    it is connected to none (a file of an earlier swarm is worth more than an empty one)."""
    from geotrain.hive.dht.node import connected_peer_addresses

    try:
        addresses = connected_peer_addresses(dht)
        if addresses:
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_name(path.name + ".tmp")
            temporary.write_text("\n".join(addresses) + "\n")
            temporary.rename(path)
    except Exception as error:  # bookkeeping: a full disk or a busy DHT must not stop training
        logger.warning("could not keep the known peers in %s: %s", path, error)
