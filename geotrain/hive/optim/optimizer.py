"""geotrain's hivemind.Optimizer and state averager (built from the config by
:func:`geotrain.hive.optim.factory.build_hivemind_optimizer`).

:class:`MeasuredOptimizer` reports how each gradient averaging round ended, gives up rounds no group will form
for, and loads the swarm's state when it missed its round. :class:`RecordingStateAverager` records the epoch of
each state download, keeps non-finite averaging results out, and lets a leaving peer give up its state round.
"""

from __future__ import annotations

import logging
import time
from functools import partial

import hivemind
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import AveragingStage
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.optim.state_averager import TrainingStateAverager

from geotrain.hive.averaging.local_gradients import LocalGradientsKeepingAverager
from geotrain.hive.averaging.missed_round import ALONE, LEAVING, MISSED, dht_is_running, reason_to_give_up, watch_round
from geotrain.hive.averaging.round_outcome import averaging_round_result, round_error
from geotrain.hive.dht.keys import read_progress
from geotrain.hive.averaging.handle_names import hivemind_handle_name
from geotrain.hive.guard.report import GuardReport
from geotrain.hive.optim.progress import GuardedProgressTracker
from geotrain.hive.guard.step import StepGuard, all_finite, reset_statistics

logger = logging.getLogger(__name__)

MIN_GROUP_SIZE = 2  # hivemind's averagers' default: the fewest peers an averaging group forms with


class RecordingStateAverager(TrainingStateAverager):
    """hivemind's state averager that remembers the epoch of the last state it downloaded.

    After a download hivemind may move the local epoch one ahead to the swarm's ("catching up"), so the
    optimizer's epoch alone cannot tell which state a peer really loaded.
    """

    loaded_epoch: int | None = None
    guard_report: GuardReport | None = None  # GuardedStateAverager's (geotrain.hive.guard.report)
    _get_handle_name = classmethod(hivemind_handle_name)

    _loading_state = False
    skip_averaging_round = False  # set for an epoch whose gradient round was given up (MeasuredOptimizer)

    def step(self, *args, averaging_round: bool = False, averaging_control=None, averaging_opts=None, **kwargs):
        """hivemind's step, without the state averaging round when ``skip_averaging_round`` is set: the peer
        loads the swarm's state at its next step, and hivemind's load would first wait for that round, which
        only ends when the others average again (about an epoch later; the load then takes a state one epoch
        old). A peer that is leaving begins no state round either (:meth:`leave_rounds`)."""
        if averaging_round and (self.skip_averaging_round or self._leaving):
            if averaging_control is not None and not averaging_control.done():
                averaging_control.cancel()  # a round pre-scheduled for this epoch: the others go on without it
            averaging_round, averaging_control, averaging_opts = False, None, None
        return super().step(*args, averaging_round=averaging_round, averaging_control=averaging_control,
                            averaging_opts=averaging_opts, **kwargs)

    progress_run_id: str | None = None  # set by MeasuredOptimizer: the run whose progress records the watch reads
    missed_round_check_s = 1.0  # how often a state round looking for a group reads the swarm's progress

    def _do(self, wait_for_trigger, optimizer_step, zero_grad, averaging_round, averaging_control, grad_scaler,
            set_to_none, timeout=None, **kwargs):
        """hivemind's background step, with its state averaging round given up while it looks for a group that
        will not form (:func:`~geotrain.hive.averaging.missed_round.watch_round`): the others have stepped past its
        epoch, or no other trainer is left.

        hivemind runs each step's optimizer update and state round one after the other in one thread, so the next
        step's update waits for this round: a state round that finds no one holds this peer's next step for the
        whole averaging timeout, and the others' next gradient round with it. A peer whose progress record shows a
        later epoch has ended its round of this one (its own next step waited for it), so the round is given up as
        soon as one does. The control is made here when hivemind would make it, as it would (the round of the epoch
        the step moved to), so that the watch holds it.
        """
        if averaging_round and self.progress_run_id is not None and not self.delta_rule_averaging:
            if averaging_control is None or averaging_control.triggered or averaging_control.done():
                averaging_control = DecentralizedAverager.step(self, gather=self.local_epoch, require_trigger=True,
                                                               timeout=timeout, wait=False, **kwargs)
            self._state_round = averaging_control
            self._watch_state_round(averaging_control, self.local_epoch)
        return super()._do(wait_for_trigger, optimizer_step, zero_grad, averaging_round, averaging_control,
                           grad_scaler, set_to_none, timeout=timeout, **kwargs)

    _state_round = None  # the control of the last state round _do began
    _leaving = False
    _served_state = None  # once frozen (the end of a run): what this peer serves, instead of its live state

    def freeze_served_state(self, parameters) -> None:
        """Serve the state as it is now from here on, with ``parameters`` (the model's, whose hash this peer
        announces) in place of the optimizer's copy. hivemind serves that copy, and a state round that found its
        group just as it was given up still averages into it in place (hivemind's round does not stop for a
        cancel once its group has formed): what the end-of-run agreement's followers download must not change.
        (hivemind's state, not what the guard lets out: a guard in the bases withholds a non-finite state, this one
        included, on each download.)"""
        metadata, tensors, *rest = super().get_current_state()
        tensors = [tensor.detach().clone() for tensor in tensors]
        for index, parameter in enumerate(parameters):
            tensors[index] = parameter.detach().cpu().clone()
        self._served_state = (metadata, tensors, *rest)

    def get_current_state(self):
        if self._served_state is not None:
            return self._served_state
        return super().get_current_state()

    def leave_rounds(self) -> str | None:
        """When a stop is requested: the state round looking for a group is given up at once, and any later one
        too (hivemind's shutdown waits for the round in the background; a step that went on after the stop
        request began one that no other trainer joined, and the peer took 10 s to leave). A round that has its
        group goes on: the others are in it with this peer. Says what it did, for the log."""
        self._leaving = True
        control = self._state_round
        if control is None or control.done() or control.stage not in (AveragingStage.IDLE,
                                                                       AveragingStage.LOOKING_FOR_GROUP):
            return None
        control.cancel()
        return "state round: cancelled while looking for group"

    def shutdown(self):
        """The state round not ended yet is cancelled first: with the averager's process gone it could only end at
        its timeout, and the thread waiting for it holds this averager (its shared memory) until then; a process
        forked meanwhile (a later DHT or averager in the same Python) inherits that and frees it."""
        control = self._state_round
        if control is not None and not control.done():
            control.cancel()
        super().shutdown()

    def _watch_state_round(self, control, round_epoch: int) -> None:
        def reason() -> str | None:
            if self._leaving:
                return LEAVING
            return reason_to_give_up(self.dht, self.progress_run_id, str(self.dht.peer_id), round_epoch + 1)

        def on_given_up(reason: str) -> None:
            logger.info("gave up the state averaging round of epoch %d: %s", round_epoch,
                        {ALONE: "no other trainer is left in the swarm", LEAVING: "this peer is leaving"}.get(
                            reason, "the swarm had stepped past it without this peer"))

        # the first look after a period: hivemind's _do, which this control is handed to, makes a round of its own
        # (one no watch holds) for a control that is already done when it begins
        watch_round(control, reason, self.missed_round_check_s, on_given_up,
                    first_look_after_s=self.missed_round_check_s, dht_alive=partial(dht_is_running, self.dht))

    def load_state_from_peers(self, *args, **kwargs):
        epoch_before = self.local_epoch
        # the parameters the optimizer steps (offloaded or not) and the buffers (batch norm statistics)
        tensors = [p for group in self.optimizer.param_groups for p in group["params"]] + list(self.extra_tensors)
        with torch.no_grad():
            kept = [t.detach().clone() for t in tensors]  # what this peer had, should the state be poisoned
        self._loading_state = True
        try:
            result = super().load_state_from_peers(*args, **kwargs)
        finally:
            self._loading_state = False
        if self.local_epoch != epoch_before and not self._loaded_state_is_finite(tensors):
            self._restore(tensors, kept, epoch_before)
            return None
        if self.local_epoch != epoch_before:
            self.loaded_epoch = self.local_epoch
        return result

    @torch.no_grad()
    def _load_local_tensors_into_averager_(self):
        """hivemind's copy of the parameters into the averaged tensors; after a state download, also the end of
        any background averaging result not applied yet.

        With the delta rule (local updates with background state averaging) a round's result is applied later as
        ``parameters += averaged - before``, where ``before`` is the averaged tensors at the round's start. A
        download overwrites the averaged tensors with the loaded state, so that delta became ``loaded - before``:
        applied on top of the loaded parameters it gave ``2 x loaded - before``, neither this peer's model nor
        the swarm's. Seen at the end of a run: a trainer took the final state, its failed last round's result
        was applied at shutdown, and the run ended with two models. The loaded state supersedes the round.
        """
        super()._load_local_tensors_into_averager_()
        if self._loading_state and self.delta_rule_averaging:
            self._old_tensors = None  # a result that arrives later is then copied, not added (hivemind's rule)
            self.finished_averaging_round.clear()

    step_guard: StepGuard | None = None  # set by build_hivemind_optimizer: holds the last good parameters

    @torch.no_grad()
    def _apply_optimizer_parameters_(self):
        """hivemind's copy of the offloaded parameters into the model, unless they are not finite.

        With the offloaded optimizer hivemind averages state *in place* in the offloaded parameters
        (``reuse_tensors``), so a span reduced by a bad peer lands there directly: put the last good step's
        parameters (and buffers) back first, as after a failed round.
        """
        offloaded = [p for group in self.optimizer.param_groups for p in group["params"]]
        if not (all_finite(offloaded) and all_finite(self.extra_tensors)):
            restored = self.step_guard is not None and self.step_guard.restore(offloaded, self.extra_tensors)
            if restored:
                reset_statistics(self.optimizer)  # the same round averaged the statistics in place too
            logger.warning("non-finite parameters after a state averaging round; %s", "restored those of the last good "
                           "step" if restored else "no good copy is kept (guard.keep_last_good_parameters is off)")
            if self.guard_report is not None:
                self.guard_report.count("parameters", "non-finite state average")
                self.guard_report.event("state_average_refused", peer_id=self.peer_id.to_base58(),
                                        reason="non-finite", restored=restored)
        return super()._apply_optimizer_parameters_()

    @torch.no_grad()
    def _apply_averaging_results_(self):
        """hivemind's copy of a state averaging round's result into the parameters, unless it is not finite
        (a part reduced by a bad peer): then this peer keeps its own, as after a failed round."""
        with self.get_tensors() as averaged_tensors:
            finite = all_finite(averaged_tensors)
        if finite:
            return super()._apply_averaging_results_()
        logger.warning("the state averaging round returned non-finite values; this peer keeps its own parameters")
        if self.guard_report is not None:
            self.guard_report.count("parameters", "non-finite state average")
            self.guard_report.event("state_average_refused", peer_id=self.peer_id.to_base58(), reason="non-finite")

    def _loaded_state_is_finite(self, parameters) -> bool:
        statistics = [value for state in self.optimizer.state.values() for value in state.values()
                      if isinstance(value, torch.Tensor) and value.is_floating_point()]
        return all_finite(parameters) and all_finite(statistics)

    @torch.no_grad()
    def _restore(self, parameters, kept, epoch_before: int) -> None:
        for parameter, old in zip(parameters, kept):
            parameter.copy_(old)
        reset_statistics(self.optimizer)
        if self.offload_optimizer:
            self._apply_optimizer_parameters_()
        logger.warning("refused the downloaded state of epoch %d: it holds non-finite values; this peer keeps its "
                       "own parameters (optimizer statistics reset) and trains on", self.local_epoch)
        self.local_epoch = epoch_before
        if self.guard_report is not None:
            self.guard_report.count("parameters", "non-finite in loaded state")
            self.guard_report.event("state_refused", peer_id=self.peer_id.to_base58(), reason="non-finite")


class MeasuredOptimizer(hivemind.Optimizer):
    """hivemind.Optimizer that reports how each gradient averaging round ended and how long it took.

    The duration is how long this peer waited for the round once its own gradients were ready
    (matchmaking that was still going on, then all-reduce); with delayed updates that wait runs in
    the background, next to the next epoch's compute.

    When a round that had started fails, this peer steps with its own gradients of the epoch, as
    hivemind intends, and not with the zeros hivemind 1.1.12 loads there (see
    :class:`LocalGradientsKeepingAverager`). It says so in the log: that epoch, its parameters moved
    apart from the others' until the next state averaging round.
    """

    on_averaging_round = None  # callable(result, duration_s)
    swarm_step_poll_s = 0.2  # how often a load that waits for the swarm's step looks at hivemind's view of it
    catch_up_poll_s = 0.5  # how often a loaded peer that waits for the swarm's step reads the progress records
    _missed_round_of_epoch = None  # the epoch of a round given up because the swarm had stepped past it
    _round_being_used = None  # the StepControl whose results _average_gradients_and_load_into_optimizer uses

    def __init__(self, *args, state_averager_class: type = RecordingStateAverager, missed_round_check_s: float = 1.0,
                 **kwargs):
        self.state_averager_class = state_averager_class
        self.missed_round_check_s = missed_round_check_s  # how often a round looking for a group reads the progress
        super().__init__(*args, **kwargs)
        report = getattr(self.state_averager, "guard_report", None)
        if report is not None and isinstance(self.tracker, GuardedProgressTracker):
            self.tracker.bans = report.bans  # the swarm's progress without the peers this one banned

    def _make_progress_tracker(self, target_batch_size: int, **kwargs) -> ProgressTracker:
        return GuardedProgressTracker(dht=self.dht, prefix=self.run_id, target_batch_size=target_batch_size,
                                      client_mode=self.client_mode, status_loglevel=self.status_loglevel, start=True,
                                      **kwargs)

    def _make_state_averager(self, **kwargs) -> TrainingStateAverager:
        # hivemind's construction (hivemind/optim/optimizer.py:283-298) with geotrain's class, which hivemind's
        # hard-codes
        averager = self.state_averager_class(
            dht=self.dht, prefix=f"{self.run_id}_state_averager", min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout, shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer, custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel, next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode, auxiliary=self.auxiliary, start=True, **kwargs)
        if isinstance(averager, RecordingStateAverager) and not self.auxiliary:
            averager.progress_run_id = self.run_id  # its state rounds are given up when no group will form
            averager.missed_round_check_s = self.missed_round_check_s
        return averager

    def _should_load_state_from_peers(self) -> bool:
        """hivemind's rule, and: a peer that missed the swarm's gradient round of its epoch loads the state.

        hivemind checks a peer's epoch against the swarm's once per epoch, at its first step after a fresh look at
        the swarm's progress; otherwise it tolerates one epoch behind, and a peer one behind begins a round at once.
        That round cannot be the one it missed (the swarm's has ended, and rounds carry no epoch): it joins the
        swarm's next round, ends it one epoch behind again, and stays there, contributing a micro-batch an epoch.
        Without delayed updates, a peer that took part in the swarm's round is still in it when the swarm's epoch
        moves on, so one epoch behind at a step means the round was missed. With delayed updates the others move
        their epoch on when they start the round, so one behind is also the normal way into a round: hivemind's rule
        alone. A round given up by :func:`~geotrain.hive.averaging.missed_round.watch_round` is a missed round too.
        """
        if super()._should_load_state_from_peers():
            return True
        missed = self._missed_round_of_epoch
        self._missed_round_of_epoch = None
        if missed is None and (self.auxiliary or not self.use_gradient_averaging or self.delay_grad_averaging
                               or self.tracker.global_epoch <= self.local_epoch):
            return False
        logger.info("this peer missed the swarm's averaging round of epoch %d (the swarm is at epoch %d): loading "
                    "the swarm's state", self.local_epoch if missed is None else missed, self.tracker.global_epoch)
        return True

    def load_state_from_peers(self, **kwargs):
        self._missed_round_of_epoch = None  # (whatever asked for this load: it covers a round given up)
        if self.use_gradient_averaging and not self.auxiliary:
            if self.scheduled_grads is not None and not self.scheduled_grads.done():
                self._tag_along_with_zero_weight(self.scheduled_grads)  # (hivemind's first move, made before the wait)
                self.scheduled_grads = None
            self._wait_while_the_swarm_steps()
        report = getattr(self.state_averager, "guard_report", None)
        if report is not None:  # a donor at this peer's own epoch has nothing new for it
            report.own_epoch.note(self.local_epoch)
        result = super().load_state_from_peers(**kwargs)
        self._catch_up_with_the_swarm()
        # hivemind moves a peer that loaded a state one epoch old up to the swarm's epoch ("catching up") without
        # stepping the learning rate schedule: that epoch would run at the previous epoch's rate
        self.state_averager._update_scheduler()
        return result

    def _catch_up_with_the_swarm(self) -> None:
        """hivemind's catching up after a load, with the swarm's epoch read afresh (sync mode).

        hivemind moves a peer whose loaded state is one epoch behind the swarm up to the swarm's epoch: it joins the
        next round, and the state averaging round after it evens out the step its parameters missed. But hivemind
        compares with its tracker's view from before the load (the tracker does not update while a load runs), so a
        download that ends after the swarm's step left the peer one epoch behind; at its next step it had missed the
        round and downloaded the state again (docs/state-transfer.md). Here the swarm's progress records are read
        again once the load is done. When the swarm's round of this peer's epoch is under way without it (the
        others' records hold the whole batch and they are enough for a group), it waits for that step first, at most
        the matchmaking time plus the averaging timeout, and then catches up: the round is lost to it either way,
        and a second download would cost more than the wait.
        """
        if self.auxiliary or not self.use_gradient_averaging or self.delay_grad_averaging:
            return  # (with delayed updates one epoch behind is the normal way into a round: hivemind's rule holds)
        own = self.dht.peer_id.to_base58()
        deadline = time.monotonic() + self.matchmaking_time + self.averaging_timeout
        waited_from = None
        while True:
            try:
                others = [progress for peer, progress in read_progress(self.dht, self.run_id).items() if peer != own]
            except Exception as error:  # the DHT did not answer: hivemind's own catching up is what there is
                logger.warning("could not read the swarm's progress after the load: %r", error)
                return
            swarm_epoch = max((progress.epoch for progress in others), default=self.local_epoch)
            at_epoch = [progress.samples_accumulated for progress in others if progress.epoch == swarm_epoch]
            stepping = (swarm_epoch == self.local_epoch and len(at_epoch) >= MIN_GROUP_SIZE
                        and sum(at_epoch) >= self.tracker.target_batch_size)
            if not stepping or time.monotonic() >= deadline:
                break
            if waited_from is None:
                waited_from = time.monotonic()
                logger.info("the swarm is averaging the gradients of epoch %d, this peer's epoch, without it: "
                            "waiting for its step to catch up with it", swarm_epoch)
            time.sleep(self.catch_up_poll_s)
        if waited_from is not None:
            logger.info("waited %.1f s for the swarm's step (the swarm is at epoch %d)", time.monotonic() - waited_from,
                        swarm_epoch)
        if swarm_epoch != self.local_epoch + 1:
            return
        logger.info("the swarm stepped to epoch %d while this peer loaded the state of epoch %d: catching up (its "
                    "parameters miss one step until the next state averaging round)", swarm_epoch, self.local_epoch)
        self.state_averager.local_epoch = swarm_epoch
        with self.tracker.pause_updates():  # the tracker's view moves to the new epoch too, as at a step
            self.tracker.update_epoch(new_epoch=swarm_epoch)
        if not self.client_mode:
            self.state_averager.state_sharing_priority = swarm_epoch
            if self.use_gradient_averaging:
                self.grad_averager.state_sharing_priority = swarm_epoch

    def _wait_while_the_swarm_steps(self) -> None:
        """Before a download: while the swarm's gradient round is under way, wait until it has stepped.

        The swarm's progress records holding its whole batch mean its round has begun. A state downloaded then
        is one step old when the swarm's step lands, and this peer comes too late for the group. Waiting for
        the swarm's new epoch costs the rest of its all-reduce, and this peer downloads the state the others
        step from next. Bounded by the matchmaking and averaging timeouts, and over as soon as the records that
        hold the swarm's samples expire (a swarm that left). A download that begins before the round and ends
        after its group forms catches up afterwards (:meth:`_catch_up_with_the_swarm`). It does not wait merely
        because the step is near: with a single other trainer no group forms without this peer, and both would
        stall until the other gave up its round.
        """
        tracker = self.tracker
        progress = tracker.global_progress
        if not self._swarm_is_stepping(progress):
            return
        epoch, started = progress.epoch, time.monotonic()
        logger.info("the swarm is averaging the gradients of epoch %d: loading its state once it has stepped", epoch)
        deadline = started + self.matchmaking_time + self.averaging_timeout
        while time.monotonic() < deadline:
            progress = tracker.global_progress
            if progress.epoch > epoch or not self._swarm_is_stepping(progress):
                break
            time.sleep(self.swarm_step_poll_s)
        logger.info("waited %.1f s for the swarm's step (the swarm is at epoch %d)", time.monotonic() - started,
                    tracker.global_progress.epoch)

    def _swarm_is_stepping(self, progress) -> bool:
        """Whether the swarm's gradient round has begun: its records hold the whole batch."""
        return progress.samples_accumulated >= self.tracker.target_batch_size

    def _update_global_epoch(self, grad_scaler) -> None:
        try:
            super()._update_global_epoch(grad_scaler)
        finally:
            self.state_averager.skip_averaging_round = False  # (set for this epoch only)

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control):
        started = time.perf_counter()
        self._round_being_used = maybe_step_control
        given_up = []  # (epoch, reason) of a round given up by the watch
        if maybe_step_control is not None:
            self._watch_for_a_missed_round(maybe_step_control, given_up)
        try:
            super()._average_gradients_and_load_into_optimizer(maybe_step_control)
        finally:
            self._round_being_used = None
        if maybe_step_control is None:
            return
        result = averaging_round_result(maybe_step_control)
        duration_s = time.perf_counter() - started
        if given_up and given_up[0][1] == ALONE:
            result = ALONE
            logger.info("gave up the gradient averaging round of epoch %d after %.1f s: no other trainer is left in "
                        "the swarm; this peer stepped with its own gradients", given_up[0][0], duration_s)
        elif given_up:
            logger.info("gave up the gradient averaging round of epoch %d after %.1f s: the swarm had stepped past "
                        "it without this peer", given_up[0][0], duration_s)
            if not self.delay_grad_averaging:  # (with it, this epoch's state round has begun already)
                self.state_averager.skip_averaging_round = True  # the next step loads the swarm's state
        elif result != "ok":
            logger.warning("gradient averaging round %s after %.1f s; this peer stepped with its own gradients "
                           "of the epoch (%s)", "timed out" if result == "timeout" else "failed", duration_s,
                           round_error(maybe_step_control))
        if self.on_averaging_round is not None:
            self.on_averaging_round(result, duration_s)

    def _watch_for_a_missed_round(self, control, given_up: list) -> None:
        """Give ``control`` up while it looks for a group the swarm no longer forms (:mod:`.missed_round`):
        appends (the round's epoch, the reason) to ``given_up``.

        Without delayed updates the others move to the next epoch when their round has ended; with them, when
        it starts (and this peer's epoch has moved on already), so only two epochs on means it is over.
        """
        round_epoch = self.local_epoch - 1 if self.delay_grad_averaging else self.local_epoch
        past_it = round_epoch + (2 if self.delay_grad_averaging else 1)
        own_peer_id = str(self.dht.peer_id)

        def on_given_up(reason: str) -> None:
            given_up.append((round_epoch, reason))
            if reason == MISSED:
                self._missed_round_of_epoch = round_epoch

        watch_round(control, partial(reason_to_give_up, self.dht, self.run_id, own_peer_id, past_it),
                    self.missed_round_check_s, on_given_up, dht_alive=partial(dht_is_running, self.dht))

    def _load_local_gradients_into_optimizer(self):
        """hivemind's fallback to local gradients, with this peer's kept gradients when its round had started."""
        averager = self.grad_averager
        if (isinstance(averager, LocalGradientsKeepingAverager)
                and averager.load_kept_gradients_into_averager_(self._round_being_used)):
            self._load_averaged_gradients_into_optimizer_()  # from the averaged tensors on, as hivemind does
            return
        super()._load_local_gradients_into_optimizer()  # the accumulators were not reset: hivemind's way is right
