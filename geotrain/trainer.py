"""The trainer peer: joins the swarm and trains the task with hivemind's large shared batches.

Run it on every VM that should train::

    geotrain peer --initial-peers /ip4/203.0.113.7/tcp/31337/p2p/QmCoordinator... --task cv --preset resnet50

Each micro-step computes the gradients of ``batch_size_per_step`` samples; ``hivemind.Optimizer``
accumulates them until the whole swarm has processed ``target_batch_size`` samples, then the peers
average their gradients and step together: one *epoch*. Per epoch the trainer measures the time
spent computing (forward and backward) and the time spent communicating (inside the optimizer:
matchmaking, all-reduce, waiting for peers, loading state); their ratio is the *granularity*.

On a spot VM the trainer watches the cloud's metadata service for preemption notices
(:mod:`geotrain.stopping.notices`): on a notice it stops starting micro-steps, leaves the swarm (hivemind
tells the others it is gone, so they stop counting on its samples) and exits well before the VM goes.

Exit codes: 0 when ``--max-epochs`` was reached or a stop was requested (SIGINT/SIGTERM);
75 after a preemption notice (start the peer again elsewhere); 2 for anything the user must fix (config,
data path, port in use: checked before joining); 3 when no initial peer answered; 1 for anything
unexpected; 143 when a stop did not finish within its deadline and the watchdog ended the process
(:mod:`geotrain.errors`).
"""

from __future__ import annotations

import itertools
import logging
import math
import secrets
import time
from dataclasses import dataclass, field
from functools import partial
from threading import Event

import torch

from geotrain.compute import Compute, resolve_compute
from geotrain.config import GeotrainConfig
from geotrain.events import EventLog
from geotrain.hive.dht.known_peers import joining_through, remember_peers
from geotrain.hive.dht.node import start_dialable_dht, visible_addresses
from geotrain.hive.state.finalize import agree_on_final_state
from geotrain.hive.dht.keys import announce_trainer, announced_trainers, best_donor_epoch, read_progress
from geotrain.hive.optim.leave import leave_swarm, stop_offering_state, withdraw_from_rounds
from geotrain.hive.guard.report import GuardReport
from geotrain.hive.optim.factory import build_hivemind_optimizer
from geotrain.hive.state.snapshot import current_learning_rate, parameters_sha256
from geotrain.initial_peers_file import wait_for_initial_peers
from geotrain.stopping.stopper import Stopper
from geotrain.stopping.notices import EXIT_PREEMPTED, start_watcher
from geotrain.tasks import build_task
from geotrain.telemetry.metrics import PeerMetrics
from geotrain.telemetry.reporter import MetricsReporter, PeerProgress

logger = logging.getLogger(__name__)

PEER_WAIT_POLL_S = 0.5
LOAD_STATE_ATTEMPTS = 3


@dataclass
class EpochTotals:
    """What one peer did during one epoch (or, summed, during the whole run)."""

    samples: int = 0
    loss_sum: float = 0.0
    steps: int = 0
    compute_s: float = 0.0
    comm_s: float = 0.0
    data_s: float = 0.0
    overflows: int = 0  # fp16 micro-batches skipped because their gradients overflowed
    started: float = field(default_factory=time.perf_counter)

    @property
    def loss(self) -> float:
        return self.loss_sum / self.steps if self.steps else math.nan

    @property
    def granularity(self) -> float:
        return self.compute_s / self.comm_s if self.comm_s > 0 else math.inf

    def add(self, other: "EpochTotals") -> None:
        self.samples += other.samples
        self.loss_sum += other.loss_sum
        self.steps += other.steps
        self.compute_s += other.compute_s
        self.comm_s += other.comm_s
        self.data_s += other.data_s
        self.overflows += other.overflows


@dataclass
class TrainerResult:
    peer_id: str
    epoch: int
    totals: EpochTotals
    params_sha256: str
    stopped_by_request: bool


class Trainer:
    """One trainer peer. ``run`` returns when max_epochs is reached or ``stop`` is set."""

    def __init__(self, config: GeotrainConfig):
        self.config = config
        self.metrics = PeerMetrics(config.swarm.run_id, role="trainer", config=config.metrics)
        self.progress = PeerProgress()
        self.events = EventLog(None)
        self._remember_peers = lambda: None  # with swarm.known_peers_file: keep the connected peers' addresses

    def run(self, stopper: Stopper) -> TrainerResult:
        """Prepare everything a user can get wrong (task, data, ports, files), then join and train."""
        config = self.config
        if config.training.threads is not None:
            torch.set_num_threads(config.training.threads)
        compute = resolve_compute(config.training)  # a GPU this machine lacks: exit 2 before anything starts
        task = build_task(config.task)
        model = task.build_model().to(compute.device)
        data_seed = config.training.data_seed
        if data_seed is None:
            data_seed = secrets.randbits(32)  # peers read their data in orders of their own
        # Worker processes read and decode the data; they fork here, before hivemind starts its threads, and
        # a missing or unreadable data source fails with the first batch, before this peer joins the swarm.
        loader = task.build_loader(config.optimizer.batch_size_per_step, data_seed,
                                   workers=config.training.data_workers, pin_memory=compute.pin_memory,
                                   part=config.task.data.part_index_and_count())
        try:
            first_batch = next(loader)
            self.events = EventLog(config.training.events_path)
            try:
                return self._join_and_train(stopper, task, model, compute, itertools.chain([first_batch], loader),
                                            data_seed)
            finally:
                self.events.close()
        finally:
            loader.close()

    def _join_and_train(self, stopper: Stopper, task, model, compute: Compute, batches,
                        data_seed: int) -> TrainerResult:
        config = self.config
        stop = stopper.stop
        metrics_port = self.metrics.serve(config.metrics)
        watcher = start_watcher(config.preemption, lambda notice: self._on_notice(notice, stopper))
        if config.swarm.initial_peers_file is not None:  # started next to its coordinator: wait for its address
            addresses = wait_for_initial_peers(config.swarm.initial_peers_file, config.swarm.bootstrap_timeout_s, stop)
            swarm = config.swarm.model_copy(update={"initial_peers": [*config.swarm.initial_peers, *addresses]})
            self.config = config = config.model_copy(update={"swarm": swarm})
        known_peers_file = config.swarm.known_peers_file
        dht, joined_as, reachability = start_dialable_dht(config.swarm.model_copy(update={  # Ctrl-C: exit 0
            "initial_peers": joining_through(config.swarm.initial_peers, known_peers_file)}), stop)
        if joined_as.client_mode != config.swarm.client_mode:  # no one could dial it: it trains in client mode
            swarm = config.swarm.model_copy(update={"client_mode": True})
            self.config = config = config.model_copy(update={"swarm": swarm})
        if known_peers_file is not None:
            self._remember_peers = lambda: remember_peers(dht, known_peers_file)
            self._remember_peers()
        peer_id = str(dht.peer_id)
        logger.info("joined swarm %r as %s (%s; %s); training on %s; data order seed %d",
                    config.swarm.run_id, peer_id,
                    "dialling out only" if config.swarm.client_mode
                    else f"listening on {', '.join(visible_addresses(dht))}", reachability,
                    compute.describe(), data_seed)
        parameters = sum(p.numel() for p in model.parameters())
        self.metrics.set_compute(str(compute.device), compute.precision)
        self.events.write("joined", peer_id=peer_id, metrics_port=metrics_port, parameters=parameters,
                          reachability=reachability,
                          data_seed=data_seed, device=str(compute.device), precision=compute.precision)

        self.guard_report = GuardReport(config.training.events_path)
        self.metrics.watch_guard(self.guard_report)
        optimizer = build_hivemind_optimizer(config, dht, model, on_averaging_round=self.metrics.averaging_round,
                                             guard_report=self.guard_report)
        if config.optimizer.mode == "diloco":
            optimizer.on_outer_round = partial(self._on_outer_round, peer_id)
        stopper.reclaim_signals()  # hivemind's averagers set SIGINT to SIG_IGN in this process
        stopper.on_stop(partial(withdraw_from_rounds, optimizer))  # no new group may count on a leaving peer
        stopper.on_stop(partial(stop_offering_state, optimizer))  # nor a new downloader
        self.reporter = MetricsReporter(dht, config.swarm.run_id, "trainer", config.metrics, self.progress, self.metrics)
        self.reporter.start()
        agreed = False
        try:
            # Trainers that start together first wait to see each other, or each would run its first epochs
            # alone. hivemind publishes a peer's progress only after its first step, so trainers first
            # announce themselves under a key of their own, then meet again after one step (see _train).
            announce_trainer(dht, config.swarm.run_id, peer_id)
            if config.training.wait_for_peers > 1:
                logger.info("waiting for %d trainers to join", config.training.wait_for_peers)
            self._wait_for_peers(dht, stop, announced_trainers, "joined")
            self._load_state_if_behind(optimizer, dht, model, peer_id)
            if config.optimizer.mode == "diloco":  # state loads from here on: behind, or off a round's majority
                optimizer.on_outer_state_loaded = partial(self._on_outer_state_loaded, peer_id)
            totals = self._train(task, model, compute, batches, optimizer, stop, peer_id, dht)
            if config.optimizer.mode == "diloco" and not stop.is_set():
                optimizer.finish_outer_round()  # the last round's outer step, when it ran in the background
            if not stop.is_set() and config.training.max_epochs is not None:
                _, agreed = agree_on_final_state(dht, optimizer, model, config.swarm.run_id, optimizer.local_epoch,
                                                 config.swarm.client_mode, config.training.final_agreement_timeout_s,
                                                 guard_report=self.guard_report, region=config.metrics.region)
        finally:
            watcher.stop()
            try:
                self.reporter.count_traffic()  # the run's last bytes, for the finished event
            except Exception as error:
                logger.debug("traffic not counted at the end: %s", error)
            leave_swarm(dht, optimizer, config.swarm.run_id, stopper, self.reporter)
        params_sha256 = parameters_sha256(model)
        result = TrainerResult(peer_id, optimizer.local_epoch, totals, params_sha256, stop.is_set())
        since_stop_s = stopper.seconds_since_request()
        self.events.write("finished", peer_id=peer_id, epoch=result.epoch, samples=totals.samples,
                          compute_s=totals.compute_s, comm_s=totals.comm_s, data_s=totals.data_s,
                          fp16_overflows=totals.overflows, device=str(compute.device), precision=compute.precision,
                          params_sha256=params_sha256, final_state_agreed=agreed, stopped_by_request=result.stopped_by_request,
                          sent_bytes_by_region=self.reporter.sent_bytes_by_region,
                          received_bytes=self.reporter.received_bytes_total,
                          averaging_payload_bytes=self.guard_report.averaging_bytes(),
                          stop_reason=stopper.reason, seconds_since_stop_request=since_stop_s)
        logger.info("left the swarm at epoch %d after %d samples%s (parameters sha256 %s)",
                    result.epoch, totals.samples,
                    f", {since_stop_s:.1f} s after: {stopper.reason}" if since_stop_s is not None else "",
                    params_sha256[:16])
        return result

    def _on_outer_round(self, peer_id: str, result: str, duration_s: float, group_size: int,
                        pseudo_gradient_norm: float | None, sent_bytes: float) -> None:
        self.metrics.outer_round(result, duration_s, group_size, pseudo_gradient_norm, sent_bytes)
        self.events.write("outer_round", peer_id=peer_id, result=result, seconds=duration_s, group_size=group_size,
                          pseudo_gradient_norm=pseudo_gradient_norm, sent_bytes=sent_bytes)

    def _on_outer_state_loaded(self, peer_id: str, donor: str | None, epoch: int) -> None:
        """A DiLoCo trainer took the swarm's outer state during training: it was behind, or off the majority."""
        self.metrics.state_loads.inc()
        self.events.write("outer_state_loaded", peer_id=peer_id, donor=donor, state_epoch=epoch)

    def _on_notice(self, notice, stopper: Stopper) -> None:
        """A preemption notice: leave within the budget, and before the cloud takes the VM."""
        budget_s = self.config.preemption.exit_budget_s
        seconds_left = notice.seconds_left()
        if seconds_left is not None:
            budget_s = max(1.0, min(budget_s, seconds_left - 5.0))
        logger.warning("preemption notice: %s", notice.describe())
        self.events.write("preemption_notice", cloud=notice.cloud, action=notice.action,
                          seconds_left=seconds_left, budget_s=budget_s)
        self.metrics.preemption_notices.inc()
        stopper.request_stop(f"{notice.cloud} preemption notice", budget_s, exit_code=EXIT_PREEMPTED)

    def _wait_for_peers(self, dht, stop: Event, key_reader, what: str, deadline: float | None = None) -> bool:
        """Block until ``key_reader(dht, run_id)`` lists ``wait_for_peers`` trainers (True), or until
        ``deadline`` (``time.monotonic()``; by default ``wait_for_peers_timeout_s`` from now) or a stop (False)."""
        wanted = self.config.training.wait_for_peers
        timeout_s = self.config.training.wait_for_peers_timeout_s
        if wanted <= 1:
            return True
        run_id = self.config.swarm.run_id
        if deadline is None:
            deadline = time.monotonic() + timeout_s
        seen = 0
        while not stop.is_set() and time.monotonic() < deadline:
            seen = len(key_reader(dht, run_id))
            if seen >= wanted:
                return True
            time.sleep(PEER_WAIT_POLL_S)
        if not stop.is_set():
            logger.warning("only %d of %d trainers %s within %.0f s; training anyway", seen,
                           wanted, what, timeout_s)
        return False

    def _meet_after_the_first_samples(self, dht, stop: Event, optimizer) -> None:
        """Wait until the other trainers' progress records are in the DHT and in hivemind's own view.

        Called once, after the first step that left samples in this peer's progress: hivemind publishes a
        peer's progress only from then on. A first step that loaded the swarm's state (this peer was behind)
        leaves none, and a peer that waited there would wait for others that wait for its record too.
        hivemind's tracker alone decides whether a round has anyone to average with, from its own view,
        refreshed every few seconds: until it counts the others, each trainer would step alone. Both waits
        together last at most ``wait_for_peers_timeout_s``.
        """
        deadline = time.monotonic() + self.config.training.wait_for_peers_timeout_s
        if self._wait_for_peers(dht, stop, read_progress, "reported progress", deadline):
            self._wait_for_peers(dht, stop, lambda *_: range(optimizer.tracker.global_progress.num_peers),
                                 "counted in hivemind's view of the swarm", deadline)

    def _load_state_if_behind(self, optimizer, dht, model, peer_id: str) -> None:
        """A peer that joins late downloads parameters and optimizer state before its first step.

        "Late" means behind the trainers' progress, or behind a state donor such as the coordinator,
        which holds the last checkpoint when no trainer is left.
        """
        optimizer.tracker.fetched_global_progress_this_epoch.wait(timeout=self.config.optimizer.matchmaking_time_s)
        swarm_epoch = max(optimizer.tracker.global_epoch, int(best_donor_epoch(dht, self.config.swarm.run_id)))
        if swarm_epoch <= optimizer.local_epoch:
            return
        logger.info("swarm is at epoch %d; loading its state from peers", swarm_epoch)
        epoch_before = optimizer.local_epoch
        for attempt in range(1, LOAD_STATE_ATTEMPTS + 1):
            started = time.perf_counter()
            optimizer.load_state_from_peers()
            elapsed_s = time.perf_counter() - started
            if optimizer.local_epoch > epoch_before:
                break
            # hivemind returns quietly when no donor answered in time (busy averaging, or slow chunks)
            logger.warning("state download %d of %d brought nothing after %.1f s", attempt, LOAD_STATE_ATTEMPTS,
                           elapsed_s)
        else:
            logger.warning("could not load the swarm's state; starting at epoch %d (hivemind tries again when "
                           "this peer notices it is behind)", optimizer.local_epoch)
            self.events.write("state_load_failed", peer_id=peer_id, epoch=optimizer.local_epoch)
            return
        self.metrics.state_loads.inc()
        state_epoch = optimizer.state_averager.loaded_epoch
        if state_epoch is None:
            state_epoch = optimizer.local_epoch
        donor, donor_region = self.guard_report.last_donor()
        self.events.write("state_loaded", peer_id=peer_id, epoch=optimizer.local_epoch, state_epoch=state_epoch,
                          seconds=elapsed_s, params_sha256=parameters_sha256(model), donor=donor,
                          donor_region=donor_region)
        if state_epoch == optimizer.local_epoch:
            logger.info("loaded the state of epoch %d in %.1f s", state_epoch, elapsed_s)
        else:
            # hivemind moves a peer that is one epoch behind the swarm's progress records up to it
            logger.info("loaded the state of epoch %d in %.1f s; continuing at epoch %d, the newest epoch in the "
                        "swarm's progress records", state_epoch, elapsed_s, optimizer.local_epoch)

    def _train(self, task, model, compute: Compute, batches, optimizer, stop: Event, peer_id: str,
               dht) -> EpochTotals:
        config = self.config
        max_epochs = config.training.max_epochs
        batch_size = config.optimizer.batch_size_per_step
        diloco = config.optimizer.mode == "diloco"
        model.train()

        run_totals = EpochTotals()
        met_the_swarm = False  # see _meet_after_the_first_samples
        epoch = optimizer.local_epoch
        epoch_totals = EpochTotals()
        self.progress.epoch = epoch
        self.events.write("training", peer_id=peer_id, epoch=epoch)
        compute.start_memory_window()
        while not stop.is_set() and (max_epochs is None or epoch < max_epochs):
            data_started = time.perf_counter()
            batch = next(batches)
            compute_started = time.perf_counter()
            with compute.autocast():
                loss = task.loss(model, batch)
            compute.scaled(loss).backward()
            finite = compute.unscale_gradients(model)
            loss_value = float(loss.detach())  # waits for the GPU: compute time is compute time
            comm_started = time.perf_counter()
            if not finite:  # fp16 overflow, or worse: this micro-batch adds nothing to the swarm's gradients
                if compute.loss_scale is None:
                    logger.warning("non-finite gradients in this micro-batch (loss %s); dropped, not sent to the "
                                   "swarm", loss_value)
                    self.guard_report.count("microstep", "non-finite")
                    self.events.write("microstep_skipped", peer_id=peer_id, epoch=epoch, reason="non-finite",
                                      loss=loss_value if math.isfinite(loss_value) else str(loss_value))
                else:
                    epoch_totals.overflows += 1
                epoch_totals.data_s += compute_started - data_started
                epoch_totals.compute_s += comm_started - compute_started
                continue
            if stop.is_set():
                break  # no step after a stop request: it could start a round that the swarm would wait for
            communication_before_s = optimizer.blocking_communication_s if diloco else 0.0
            optimizer.step()
            optimizer.zero_grad()
            finished = time.perf_counter()
            # DiLoCo: the step is this peer's own (inner) optimizer step, compute, but for an outer round or a
            # state load in it
            inner_step_s = max(0.0, finished - comm_started - (optimizer.blocking_communication_s -
                                                                communication_before_s)) if diloco else 0.0

            epoch_totals.samples += batch_size
            epoch_totals.loss_sum += loss_value
            epoch_totals.steps += 1
            epoch_totals.data_s += compute_started - data_started
            epoch_totals.compute_s += comm_started - compute_started + inner_step_s
            epoch_totals.comm_s += finished - comm_started - inner_step_s
            self.metrics.samples.inc(batch_size)
            self.progress.samples_total += batch_size
            if not met_the_swarm and optimizer.tracker.local_progress.samples_accumulated > 0:
                met_the_swarm = True  # from here on its samples count toward the swarm's batch
                self.events.write("contributing", peer_id=peer_id, epoch=optimizer.local_epoch,
                                  samples=optimizer.tracker.local_progress.samples_accumulated)
                self._meet_after_the_first_samples(dht, stop, optimizer)

            if optimizer.local_epoch != epoch:
                self._finish_epoch(optimizer, compute, epoch_totals, peer_id)
                run_totals.add(epoch_totals)
                epoch = optimizer.local_epoch
                epoch_totals = EpochTotals()
                compute.start_memory_window()
        run_totals.add(epoch_totals)
        return run_totals

    def _finish_epoch(self, optimizer, compute: Compute, totals: EpochTotals, peer_id: str) -> None:
        wall_s = time.perf_counter() - totals.started
        samples_per_second = totals.samples / wall_s if wall_s > 0 else 0.0
        peers = optimizer.tracker.global_progress.num_peers
        epoch = optimizer.local_epoch
        peak_memory_bytes = compute.peak_memory_bytes()
        learning_rate = current_learning_rate(optimizer)
        memory = f", peak GPU memory {peak_memory_bytes / 2**30:.2f} GiB" if peak_memory_bytes is not None else ""
        overflows = f", {totals.overflows} fp16 overflows skipped" if totals.overflows else ""
        logger.info("epoch %d: %.1f samples/s, loss %.4f, %d peers, granularity %.2f "
                    "(compute %.1f s, communication %.1f s, waiting for data %.1f s%s%s), learning rate %.3g",
                    epoch, samples_per_second, totals.loss, peers, totals.granularity, totals.compute_s,
                    totals.comm_s, totals.data_s, memory, overflows, learning_rate)
        self.events.write("epoch", peer_id=peer_id, epoch=epoch, samples=totals.samples, wall_s=wall_s,
                          samples_per_second=samples_per_second, loss=totals.loss, peers=peers,
                          compute_s=totals.compute_s, comm_s=totals.comm_s, data_s=totals.data_s,
                          granularity=None if math.isinf(totals.granularity) else totals.granularity,
                          peak_gpu_memory_bytes=peak_memory_bytes, fp16_overflows=totals.overflows,
                          learning_rate=learning_rate)
        self._remember_peers()
        m = self.metrics
        m.data_seconds.inc(totals.data_s)
        m.set_optional(m.peak_gpu_memory, peak_memory_bytes)
        m.compute_seconds.inc(totals.compute_s)
        m.communication_seconds.inc(totals.comm_s)
        m.samples_per_second.set(samples_per_second)
        m.local_epoch.set(epoch)
        m.global_epoch.set(optimizer.tracker.global_epoch)
        m.loss.set(totals.loss)
        m.peers.set(peers)
        if not math.isinf(totals.granularity):
            m.granularity.set(totals.granularity)
        progress = self.progress
        progress.epoch = epoch
        progress.samples_per_second = samples_per_second
        progress.granularity = None if math.isinf(totals.granularity) else totals.granularity
        progress.compute_seconds_total += totals.compute_s
        progress.communication_seconds_total += totals.comm_s
