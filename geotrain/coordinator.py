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
import tempfile
import time
from pathlib import Path

import yaml

from geotrain.checkpoint import CheckpointStore
from geotrain.config import GeotrainConfig
from geotrain.errors import SwarmUnreachableError, UserError
from geotrain.hive.dht.known_peers import joining_through, remember_peers
from geotrain.hive.dht.node import start_dht, visible_addresses
from geotrain.hive.dht.identity import check_identity_file
from geotrain.hive.dht.keys import swarm_epoch_and_trainers
from geotrain.hive.dht.metric_records import read_records
from geotrain.hive.optim.factory import build_hivemind_optimizer
from geotrain.hive.state.snapshot import capture_state, restore_state
from geotrain.stopping.stopper import Stopper
from geotrain.tasks import build_task
from geotrain.telemetry.metrics import SwarmMetrics
from geotrain.telemetry.reporter import MetricsReporter, PeerProgress
from geotrain.telemetry.swarm_view import SwarmView, export

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 2.0
# Newcomers load from the donor with the highest priority; trainers announce their epoch. Half an epoch
# more puts a coordinator that holds the current epoch's state first, and a stale one behind the trainers.
DONOR_PRIORITY_BONUS = 0.5


def refresh_due(swarm_epoch: int, epoch: int, trainer_in_region: bool, settings) -> bool:
    """Whether to download the swarm's state now to keep the state this coordinator offers current.

    Newcomers take a donor within one epoch of the newest by region, then round trip (geotrain.hive.state.donors):
    a coordinator one epoch behind wins over current trainers farther away, and its state leaves them one
    optimizer step behind the others. Seen in the churn soak: a trainer that rejoined next to the coordinator
    loaded its state of the last checkpoint, one epoch old, missed the swarm's round and downloaded again from
    another continent. While a trainer shares this region the download is a transfer inside one data centre, so the coordinator
    follows every epoch (``coordinator.refresh_in_region``); otherwise it downloads only for its checkpoints,
    and a far trainer's uplink is not spent on it every epoch.
    """
    return settings.refresh_in_region and trainer_in_region and swarm_epoch > epoch


def trainer_in_region(records: dict, region: str) -> bool:
    """Whether any trainer's metric record (geotrain.hive.dht.metric_records.read_records) names ``region``."""
    return any(peer.record.role == "trainer" and peer.record.region == region for peer in records.values())


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


# What a checkpoint's shape depends on: restoring one written under other values cannot work (other
# tensors or optimizer statistics), or belongs to another run.
STATE_DEFINING_KEYS = ("swarm.run_id", "task.name", "task.preset", "optimizer.optimizer", "optimizer.mode")


def _dotted(data: dict, key: str):
    for part in key.split("."):
        data = data.get(part) if isinstance(data, dict) else None
    return data


def config_differences(checkpoint_yaml: str, config: GeotrainConfig) -> list[str]:
    """``key: checkpoint value -> this config's value`` for each state-defining key that differs."""
    try:
        written = yaml.safe_load(checkpoint_yaml) or {}
    except yaml.YAMLError:
        return []  # a checkpoint without a readable config (written by hand): its tensors decide
    current = config.model_dump(mode="json")
    return [f"{key}: {_dotted(written, key)!r} in the checkpoint, {_dotted(current, key)!r} now"
            for key in STATE_DEFINING_KEYS
            if isinstance(written, dict) and _dotted(written, key) is not None
            and _dotted(written, key) != _dotted(current, key)]


class DurableState:
    """The swarm's training state held by the coordinator: restore, follow the swarm, checkpoint.

    Built in two steps, so that a checkpoint that does not fit the config is refused before joining:
    the constructor builds the model and reads the newest checkpoint; :meth:`attach` joins the state to
    the swarm (an optimizer that never steps: it holds, downloads and shares the state as trainers do).
    """

    def __init__(self, config: GeotrainConfig, state_dir: Path, metrics=None):
        self.config = config
        settings = config.coordinator
        # the mirror first: a URL or driver that cannot work is reported before a large model is built
        self.store = CheckpointStore(state_dir / "checkpoints", keep=settings.keep_checkpoints,
                                     mirror_url=settings.mirror_url, config_yaml=config.shareable_yaml(),
                                     storage_options=settings.mirror_options)
        self.model = build_task(config.task).build_model()
        self.optimizer = None
        self.saved_epoch = -1
        self.saved_monotonic_s = time.monotonic()
        self.metrics = metrics  # geotrain.telemetry.metrics.SwarmMetrics: checkpoints written, and when
        self._restored = self._read_checkpoint()

    def _read_checkpoint(self):
        restored = self.store.load_latest()
        if restored is None:
            return None
        state, info = restored
        differences = config_differences(info.config_yaml, self.config)
        if differences:
            raise UserError(
                f"checkpoint version {info.version} in {self.store.directory} was written for another config "
                f"({'; '.join(differences)}); start the coordinator with that run's config, or give another "
                "--state-dir for a new run (the checkpoints were left as they are)")
        try:
            self.model.load_state_dict(state["model"])  # the tensors must fit this model, too
        except (KeyError, RuntimeError) as error:
            first_line = (str(error).strip().splitlines() or [""])[0]
            raise UserError(f"checkpoint version {info.version} ({info.path}) does not fit the model of task "
                            f"{self.config.task.name}/{self.config.task.preset}: {first_line}; start the "
                            "coordinator with that run's config, or give another --state-dir (the checkpoints "
                            "were left as they are)") from None
        return restored

    @property
    def epoch(self) -> int:
        return self.optimizer.local_epoch

    def attach(self, dht) -> None:
        """Build the state's optimizer in the swarm and restore the checkpoint read at start, if any."""
        self.optimizer = build_hivemind_optimizer(self.config, dht, self.model)
        if self._restored is None:
            logger.info("no checkpoint yet; the state will come from the trainers")
            return
        state, info = self._restored
        self._restored = None
        restore_state(self.optimizer, self.model, state)
        self.saved_epoch = info.epoch
        self._offer_state()
        logger.info("restored checkpoint version %d: epoch %d (%s)", info.version, info.epoch, info.path)

    def _offer_state(self) -> None:
        self.optimizer.state_averager.state_sharing_priority = self.epoch + DONOR_PRIORITY_BONUS

    def follow(self, swarm_epoch: int, trainer_in_region: bool = False) -> None:
        """Download the swarm's state when a checkpoint is due, or every epoch while a trainer in this region
        can send it (:func:`refresh_due`); checkpoint when due."""
        settings = self.config.coordinator
        due_by_epochs = swarm_epoch >= self.saved_epoch + settings.checkpoint_every_epochs
        due_by_time = (time.monotonic() - self.saved_monotonic_s >= settings.checkpoint_every_s
                       and swarm_epoch > self.saved_epoch)
        checkpoint_due = due_by_epochs or due_by_time
        if not (checkpoint_due or refresh_due(swarm_epoch, self.epoch, trainer_in_region, settings)):
            return
        if swarm_epoch > self.epoch:
            started, epoch_before = time.perf_counter(), self.epoch
            averager = self.optimizer.state_averager
            # only a newer state: one of the epoch it holds (a trainer that has not stepped yet, or one caught
            # mid-step) would replace, unlogged, the state it offers and has checkpointed under that epoch
            if averager.guard_report is not None:
                averager.guard_report.own_epoch.note(epoch_before, newer_only=True)
            try:
                # a trainer's state, fetched the way a newcomer fetches it (never from ourselves)
                averager.load_state_from_peers(timeout=self.config.optimizer.load_state_timeout_s)
            except Exception as error:  # a donor left mid-transfer; the next poll tries again
                logger.warning("could not download the swarm's state (%s); will retry", error)
                return
            if self.epoch > epoch_before:
                logger.info("downloaded the swarm's state of epoch %d in %.1f s", self.epoch,
                            time.perf_counter() - started)
                self._offer_state()
        if checkpoint_due and self.epoch > self.saved_epoch:
            self.checkpoint()

    def checkpoint(self) -> None:
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
        if self.optimizer is not None:
            self.optimizer.shutdown()


def check_writable_directory(directory: Path, flag: str) -> None:
    """Fail before joining the swarm, naming the flag, when ``directory`` cannot hold the coordinator's files."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-test-"):
            pass
    except OSError as error:
        raise UserError(f"{flag} {directory}: cannot write there ({error.strerror}); give a directory this user "
                        "can write, on a durable disk") from None


class Coordinator:
    def __init__(self, config: GeotrainConfig, initial_peers_file: Path | None = None):
        self.config = config
        self.state_dir = config.coordinator.state_dir
        self.initial_peers_file = initial_peers_file

    @property
    def identity_path(self) -> Path:
        """``--identity`` if given, else ``STATE_DIR/identity.key``: the key behind the coordinator's peer id."""
        return self.config.swarm.identity_path or self.state_dir / "identity.key"

    def check_files(self) -> None:
        """Refuse, before anything starts, a state dir or join-address file that cannot be written and an
        identity file that cannot be used (a missing one is made when the DHT starts)."""
        check_writable_directory(self.state_dir, "--state-dir")
        if self.initial_peers_file is not None:
            check_writable_directory(self.initial_peers_file.parent, "--initial-peers-file")
        if self.config.swarm.identity_path is not None:
            label = f"--identity {self.identity_path}"
        else:
            label = f"{self.identity_path} (the coordinator's identity, kept in --state-dir)"
        check_identity_file(self.identity_path, label)

    def run(self, stopper: Stopper) -> None:
        config = self.config
        stop = stopper.stop
        swarm = config.swarm.model_copy(update={"port": config.coordinator_port(),
                                                "identity_path": self.identity_path})
        self.check_files()
        metrics = SwarmMetrics(swarm.run_id, config.metrics)
        durable = DurableState(config, self.state_dir, metrics) if config.coordinator.hold_state else None
        view = SwarmView(config.cost, config.optimizer.target_batch_size,  # reads the price files
                         config.metrics.target_epoch or config.training.max_epochs)
        metrics_port = metrics.serve(config.metrics)
        dht = self._rejoin_or_start(swarm, stop)
        progress = PeerProgress()
        reporter = MetricsReporter(dht, swarm.run_id, "coordinator", config.metrics, progress)
        try:
            if durable is not None:
                durable.attach(dht)
                stopper.reclaim_signals()
            self._announce(visible_addresses(dht), swarm.announce_host)
            if metrics_port is not None:
                logger.info("swarm metrics on http://%s:%d/metrics", config.metrics.host, metrics_port)
            reporter.start()
            last_status = None
            while not stop.wait(POLL_INTERVAL_S):
                swarm_epoch, trainers = swarm_epoch_and_trainers(dht, swarm.run_id)
                if (swarm_epoch, trainers) != last_status:
                    logger.info("swarm %r: epoch %d, %d trainers", swarm.run_id, swarm_epoch, trainers)
                    last_status = (swarm_epoch, trainers)
                    self._remember_peers(dht)
                records = self._read_records(dht)
                if durable is not None and trainers:
                    durable.follow(swarm_epoch, trainer_in_region(records or {}, config.metrics.region))
                    progress.epoch = durable.epoch
                if records is not None:
                    self._aggregate(records, view, metrics)
        finally:
            reporter.leave()
            if durable is not None:
                durable.shutdown()
            dht.shutdown()
        logger.info("coordinator stopped")

    def _read_records(self, dht) -> dict | None:
        try:
            return read_records(dht, self.config.swarm.run_id)
        except Exception as error:  # a busy DHT: keep the last figures, try again next poll
            logger.debug("could not read metric records: %s", error)
            return None

    def _aggregate(self, records: dict, view, metrics) -> None:
        """Fold the peers' metric records into the swarm metrics this coordinator exports."""
        snapshot = view.update({owner: peer.record for owner, peer in records.items()})
        export(snapshot, metrics, self.config.cost)

    @property
    def _known_peers_path(self) -> Path:
        return self.config.swarm.known_peers_file or self.state_dir / "known_peers.txt"

    def _remember_peers(self, dht) -> None:
        """Keep the trainers' addresses: a restarted coordinator dials them to find its swarm again."""
        remember_peers(dht, self._known_peers_path)

    def _rejoin_or_start(self, swarm, stop=None):
        """After a restart the trainers do not dial the coordinator again: it dials the peers it knew."""
        known = joining_through(swarm.initial_peers, self._known_peers_path)
        if len(known) > len(swarm.initial_peers):
            try:
                return start_dht(swarm.model_copy(update={"initial_peers": known}), stop)
            except SwarmUnreachableError:
                logger.info("none of the %d peers seen before the restart answered; waiting for new ones",
                            len(known) - len(swarm.initial_peers))
        return start_dht(swarm, stop)

    def _announce(self, visible: list[str], announce_host: str | None) -> None:
        addresses = public_addresses(visible, announce_host)
        print("geotrain coordinator is up. Join this swarm with:", flush=True)
        print(f"  {join_command(addresses)}", flush=True)
        if self.initial_peers_file is not None:
            self.initial_peers_file.parent.mkdir(parents=True, exist_ok=True)
            temporary = self.initial_peers_file.with_suffix(".tmp")
            temporary.write_text("\n".join(addresses) + "\n")
            temporary.rename(self.initial_peers_file)  # readers never see half a file
