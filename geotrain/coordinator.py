"""The coordinator peer: the swarm's stable bootstrap address, on a durable (on-demand) VM.

Start it once, then point every trainer at the address it prints::

    geotrain coordinator --host 0.0.0.0 --port 31337 --announce-host 203.0.113.7
    # -> geotrain peer --initial-peers /ip4/203.0.113.7/tcp/31337/p2p/QmXyZ...

Its identity (and so its peer id and the printed address) is kept in ``STATE_DIR/identity.key``,
so a restarted coordinator is reachable at the same address. It validates the swarm's progress
records like every trainer does, and logs the swarm's epoch and size when they change.
"""

from __future__ import annotations

import logging
from pathlib import Path
from threading import Event

from geotrain.config import GeotrainConfig

logger = logging.getLogger(__name__)

DEFAULT_PORT = 31337
DEFAULT_STATE_DIR = Path("geotrain-state")
STATUS_INTERVAL_S = 10.0


def join_command(addresses: list[str]) -> str:
    return "geotrain peer " + " ".join(f"--initial-peers {address}" for address in addresses)


def public_addresses(addresses: list[str], announce_host: str | None) -> list[str]:
    """The addresses worth printing: the announced one if set, else all but loopback (unless only loopback)."""
    if announce_host:
        announced = [a for a in addresses if a.startswith(f"/ip4/{announce_host}/")]
        if announced:
            return announced
    remote = [a for a in addresses if not a.startswith("/ip4/127.")]
    return remote or addresses


def read_swarm_progress(dht, run_id: str) -> tuple[int, int]:
    """(global epoch, trainer peers) from the signed progress records in the DHT."""
    from geotrain.swarm import read_progress

    progress = read_progress(dht, run_id)
    return max((p.epoch for p in progress.values()), default=0), len(progress)


class Coordinator:
    def __init__(self, config: GeotrainConfig, state_dir: Path, initial_peers_file: Path | None = None):
        self.config = config
        self.state_dir = state_dir
        self.initial_peers_file = initial_peers_file

    def run(self, stop: Event) -> None:
        from geotrain.swarm import start_dht, visible_addresses

        swarm = self.config.swarm
        if swarm.identity_path is None:
            swarm = swarm.model_copy(update={"identity_path": self.state_dir / "identity.key"})
        self.state_dir.mkdir(parents=True, exist_ok=True)
        dht = start_dht(swarm)
        try:
            addresses = public_addresses(visible_addresses(dht), swarm.announce_host)
            print("geotrain coordinator is up. Join this swarm with:", flush=True)
            print(f"  {join_command(addresses)}", flush=True)
            if self.initial_peers_file is not None:
                self.initial_peers_file.parent.mkdir(parents=True, exist_ok=True)
                temporary = self.initial_peers_file.with_suffix(".tmp")
                temporary.write_text("\n".join(addresses) + "\n")
                temporary.rename(self.initial_peers_file)  # readers never see half a file
            last = None
            while not stop.wait(STATUS_INTERVAL_S):
                status = read_swarm_progress(dht, swarm.run_id)
                if status != last:
                    logger.info("swarm %r: epoch %d, %d trainers", swarm.run_id, *status)
                    last = status
        finally:
            dht.shutdown()
        logger.info("coordinator stopped")
