"""The coordinator peer: the swarm's stable bootstrap address and its durable state, on a durable VM.

Start it once, with the run's config (it builds the same model as the trainers), then point every
trainer at the address it prints::

    geotrain coordinator --config run.yaml --host 0.0.0.0 --port 31337 --announce-host 203.0.113.7
    # -> geotrain peer --initial-peers /ip4/203.0.113.7/tcp/31337/p2p/12D3KooW...

Its identity (and so its peer id and the printed address) is kept in ``STATE_DIR/identity.key``.

Durable state (``coordinator.hold_state``, on by default): every ``checkpoint_every_epochs`` epochs of
the swarm, or ``checkpoint_every_s`` seconds, the coordinator downloads the full training state from a
trainer (parameters, optimizer statistics, epoch; one state transfer, as a newcomer would) and writes an
atomic, verified checkpoint (:mod:`geotrain.checkpoint`), optionally mirrored to object storage. On
start it restores the newest checkpoint that verifies. It then offers that state to newcomers, ahead of
trainers at the same epoch (they are busy training), and when no trainer is left, the next trainers
start from it. The coordinator never trains and never blocks training: when it is down, trainers go on
among themselves; when it is back, it restores and catches up with the swarm.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from threading import Event

from geotrain.config import GeotrainConfig

logger = logging.getLogger(__name__)

DEFAULT_PORT = 31337
DEFAULT_STATE_DIR = Path("geotrain-state")
POLL_INTERVAL_S = 2.0
# Newcomers load from the donor with the highest priority; trainers announce their epoch. Half an epoch
# more puts a coordinator that holds the current epoch's state first, and a stale one behind the trainers.
DONOR_PRIORITY_BONUS = 0.5


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


class DurableState:
    """The swarm's training state held by the coordinator: restore, follow the swarm, checkpoint."""

    def __init__(self, config: GeotrainConfig, dht, state_dir: Path, metrics=None):
        from geotrain.checkpoint import CheckpointStore
        from geotrain.tasks import build_task
        from geotrain.trainer import build_hivemind_optimizer

        self.config = config
        settings = config.coordinator
        self.model = build_task(config.task).build_model()
        # an optimizer that never steps: it holds, downloads and shares the state the way trainers do
        self.optimizer = build_hivemind_optimizer(config, dht, self.model)
        self.store = CheckpointStore(state_dir / "checkpoints", keep=settings.keep_checkpoints,
                                     mirror_url=settings.mirror_url, config_yaml=config.to_yaml())
        self.saved_epoch = -1
        self.saved_monotonic_s = time.monotonic()
        self.metrics = metrics  # geotrain.metrics.SwarmMetrics: checkpoints written, and when

    @property
    def epoch(self) -> int:
        return self.optimizer.local_epoch

    def restore(self) -> None:
        from geotrain.state import restore_state

        restored = self.store.load_latest()
        if restored is None:
            logger.info("no checkpoint yet; the state will come from the trainers")
            return
        state, info = restored
        restore_state(self.optimizer, self.model, state)
        self.saved_epoch = info.epoch
        self._offer_state()
        logger.info("restored checkpoint version %d: epoch %d (%s)", info.version, info.epoch, info.path)

    def _offer_state(self) -> None:
        self.optimizer.state_averager.state_sharing_priority = self.epoch + DONOR_PRIORITY_BONUS

    def follow(self, swarm_epoch: int) -> None:
        """Download the swarm's state and checkpoint it when it is due."""
        settings = self.config.coordinator
        due_by_epochs = swarm_epoch >= self.saved_epoch + settings.checkpoint_every_epochs
        due_by_time = (time.monotonic() - self.saved_monotonic_s >= settings.checkpoint_every_s
                       and swarm_epoch > self.saved_epoch)
        if not (due_by_epochs or due_by_time):
            return
        if swarm_epoch > self.epoch:
            started = time.perf_counter()
            try:
                # a trainer's state, fetched the way a newcomer fetches it (never from ourselves)
                self.optimizer.state_averager.load_state_from_peers(timeout=self.config.optimizer.load_state_timeout_s)
            except Exception as error:  # a donor left mid-transfer; the next poll tries again
                logger.warning("could not download the swarm's state (%s); will retry", error)
                return
            if self.epoch <= self.saved_epoch:
                return
            logger.info("downloaded the swarm's state of epoch %d in %.1f s", self.epoch,
                        time.perf_counter() - started)
            self._offer_state()
        if self.epoch > self.saved_epoch:
            self.checkpoint()

    def checkpoint(self) -> None:
        from geotrain.state import capture_state

        samples_seen = self.epoch * self.config.optimizer.target_batch_size  # epochs hold at least this many
        info = self.store.save(capture_state(self.optimizer, self.model), epoch=self.epoch, samples_seen=samples_seen)
        self.saved_epoch = info.epoch
        self.saved_monotonic_s = time.monotonic()
        if self.metrics is not None:
            self.metrics.checkpoints.inc()
            self.metrics.set_optional(self.metrics.checkpoint_last_success, time.time())
        logger.info("checkpoint version %d written: epoch %d, %.1f MB, sha256 %s", info.version, info.epoch,
                    info.size_bytes / 1e6, info.sha256[:16])

    def shutdown(self) -> None:
        self.optimizer.shutdown()


class Coordinator:
    def __init__(self, config: GeotrainConfig, state_dir: Path, initial_peers_file: Path | None = None):
        self.config = config
        self.state_dir = state_dir
        self.initial_peers_file = initial_peers_file

    def run(self, stop: Event) -> None:
        from geotrain.metrics import SwarmMetrics
        from geotrain.reporting import MetricsReporter, PeerProgress
        from geotrain.swarm import visible_addresses
        from geotrain.swarm_view import SwarmView

        config = self.config
        swarm = config.swarm
        if swarm.identity_path is None:
            swarm = swarm.model_copy(update={"identity_path": self.state_dir / "identity.key"})
        self.state_dir.mkdir(parents=True, exist_ok=True)
        metrics = SwarmMetrics(swarm.run_id, config.metrics)
        metrics_port = metrics.serve(config.metrics)
        dht = self._rejoin_or_start(swarm)
        durable = None
        progress = PeerProgress()
        reporter = MetricsReporter(dht, swarm.run_id, "coordinator", config.metrics, progress)
        view = SwarmView(config.cost, config.optimizer.target_batch_size,
                         config.metrics.target_epoch or config.training.max_epochs)
        try:
            if config.coordinator.hold_state:
                durable = DurableState(config, dht, self.state_dir, metrics)
                durable.restore()
            self._announce(visible_addresses(dht), swarm.announce_host)
            if metrics_port is not None:
                logger.info("swarm metrics on http://%s:%d/metrics", config.metrics.host, metrics_port)
            reporter.start()
            last_status = None
            while not stop.wait(POLL_INTERVAL_S):
                swarm_epoch, trainers = read_swarm_progress(dht, swarm.run_id)
                if (swarm_epoch, trainers) != last_status:
                    logger.info("swarm %r: epoch %d, %d trainers", swarm.run_id, swarm_epoch, trainers)
                    last_status = (swarm_epoch, trainers)
                    self._remember_peers(dht)
                if durable is not None and trainers:
                    durable.follow(swarm_epoch)
                    progress.epoch = durable.epoch
                self._aggregate(dht, view, metrics)
        finally:
            reporter.leave()
            if durable is not None:
                durable.shutdown()
            dht.shutdown()
        logger.info("coordinator stopped")

    def _aggregate(self, dht, view, metrics) -> None:
        """Fold the peers' metric records into the swarm metrics this coordinator exports."""
        from geotrain.metric_records import read_records
        from geotrain.swarm_view import export

        try:
            records = read_records(dht, self.config.swarm.run_id)
        except Exception as error:  # a busy DHT: keep the last figures, try again next poll
            logger.debug("could not read metric records: %s", error)
            return
        snapshot = view.update({owner: peer.record for owner, peer in records.items()})
        export(snapshot, metrics, self.config.cost)

    @property
    def _known_peers_path(self) -> Path:
        return self.state_dir / "known_peers.txt"

    def _remember_peers(self, dht) -> None:
        """Keep the trainers' addresses: a restarted coordinator dials them to find its swarm again."""
        from geotrain.swarm import connected_peer_addresses

        addresses = connected_peer_addresses(dht)
        if addresses:
            temporary = self._known_peers_path.with_suffix(".tmp")
            temporary.write_text("\n".join(addresses) + "\n")
            temporary.rename(self._known_peers_path)

    def _rejoin_or_start(self, swarm):
        """After a restart the trainers do not dial the coordinator again: it dials the peers it knew."""
        from geotrain.swarm import SwarmJoinError, start_dht

        known = self._known_peers_path.read_text().split() if self._known_peers_path.exists() else []
        if known:
            try:
                return start_dht(swarm.model_copy(update={"initial_peers": swarm.initial_peers + known}))
            except SwarmJoinError:
                logger.info("none of the %d peers seen before the restart answered; waiting for new ones",
                            len(known))
        return start_dht(swarm)

    def _announce(self, visible: list[str], announce_host: str | None) -> None:
        addresses = public_addresses(visible, announce_host)
        print("geotrain coordinator is up. Join this swarm with:", flush=True)
        print(f"  {join_command(addresses)}", flush=True)
        if self.initial_peers_file is not None:
            self.initial_peers_file.parent.mkdir(parents=True, exist_ok=True)
            temporary = self.initial_peers_file.with_suffix(".tmp")
            temporary.write_text("\n".join(addresses) + "\n")
            temporary.rename(self.initial_peers_file)  # readers never see half a file
