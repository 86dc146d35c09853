"""DiLoCo mode (``optimizer.mode: diloco``): local inner steps, an outer step on the swarm's pseudo-gradient.

DiLoCo (Douillard et al., arXiv 2311.08105; on hivemind: OpenDiLoCo, arXiv 2407.07852) trains with two
optimizers. Every peer steps its *inner* optimizer (the config's, e.g. AdamW, with its schedule) on its own
gradients at every micro-step, with no communication at all. Every *outer round* the peers all-reduce the
*pseudo-gradient* (the outer parameters minus this peer's local ones: how far the inner steps moved it),
and every peer applies the same *outer* step (SGD with Nesterov momentum, the paper's lr 0.7 and momentum 0.9)
to the outer parameters, which then become the local ones again. One outer round is one epoch of the swarm.

How geotrain runs it on hivemind:

- hivemind.Optimizer with local updates steps the inner optimizer each micro-step and counts the swarm's
  samples (its progress tracker); :class:`RoundTracker` sets the round's size to ``inner_steps x
  batch_size_per_step x trainers``, so a round comes after ``inner_steps`` micro-steps per trainer on
  average (a faster trainer does more, a slower one fewer: nobody idles waiting for the others).
- hivemind pre-schedules the round's matchmaking at the estimated end of the round, so the trainers meet
  in one group; a trainer that comes late is not waited for past ``optimizer.averaging_timeout_s``.
- With ``optimizer.diloco.overlap_rounds`` (the default) a round does not stop the trainer: its pseudo-gradient
  is taken at the round's boundary, the all-reduce runs in the background while the next inner steps run on
  (hivemind's delayed state averaging), and the outer step lands at the first micro-step after the all-reduce,
  at the latest before the next round's pseudo-gradient is taken. The swarm's step then replaces this peer's own
  progress of the finished round and keeps the inner steps taken since: local += new outer - local at the
  boundary (the outer step arrives one part of a round late; "overlapping communication" in Streaming DiLoCo,
  arXiv 2501.18512). Without it, the trainer waits for the round, as in the DiLoCo paper.
- :class:`OuterStateAverager` (hivemind's state averager) averages the pseudo-gradient instead of the
  parameters (``optimizer.grad_compression``, fp16 by default; buffers such as batch norm statistics are
  averaged as values), then applies the outer step. A newcomer downloads the *outer* parameters, both
  optimizers' state and the epoch, never a donor's half-way local parameters.
- Every member of a round tells the group a fingerprint of the outer parameters it steps from (hivemind's
  ``gather``). A trainer that missed a round (its round failed, or it was lost from the group: hivemind
  issue #624) stepped alone and holds other outer parameters than the rest; at its next round the
  members whose fingerprint is not the group's majority's load the outer state of a majority member
  (the smallest peer id; ties go to the fingerprint of the smallest peer id) before their next micro-step,
  so every trainer steps from the same outer parameters again.
- Each received part is checked (:mod:`geotrain.hive.guard.contributions`) for non-finite values, a weight other than
  the 1 every member sends, and a norm over 100 x ``guard.contribution_norm_factor`` times this peer's own
  (checked only when this peer did a quarter of ``inner_steps`` in the round: pseudo-gradients grow with
  a peer's inner steps and differ far more than gradients do). An average that is not finite, or whose norm is over
  :data:`MAX_PSEUDO_GRADIENT_TO_PARAMETERS` times the parameters' norm and over 100 times this peer's own
  pseudo-gradient's, is refused: this peer applies its own pseudo-gradient instead, and re-syncs as above.

Memory: the outer parameters, the outer momentum and hivemind's averaging buffer, each one fp32 copy of the
parameters in host memory (3x the parameters' size, on the CPU); with overlapped rounds one more, the local
parameters at the round's boundary, while the round is in flight.
"""

from __future__ import annotations

import ctypes
import logging
import math
import multiprocessing
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from hivemind.compression import CompressionInfo, TensorRole
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.utils import get_dht_time
from hivemind.optim.state_averager import (TrainingStateAverager, dump_optimizer_state, initialize_optimizer_state_,
                                           load_optimizer_state)

from geotrain.hive.averaging.round_outcome import averaging_round_result
from geotrain.hive.optim.progress import GuardedProgressTracker
from geotrain.hive.guard.step import all_finite, total_norm
from geotrain.hive.optim.optimizer import MeasuredOptimizer, RecordingStateAverager

logger = logging.getLogger(__name__)

# An honest round moves the parameters by a fraction of their norm (up to 20% in the first rounds of a tiny CV
# model at lr 0.01; trainers that stepped apart for a few rounds were 1.2x apart); a pseudo-gradient average, or a
# majority's state, 10 times the parameters' norm away comes from a scaled or forged contribution.
MAX_PSEUDO_GRADIENT_TO_PARAMETERS = 10.0
ALONE_REFRESH_S = 2.0  # before a round alone: how long to wait for a fresh look at the swarm's progress
# Members of a round tell each other FINGERPRINT_VALUES of their outer parameters, evenly spread over them (an
# outer step moves all of them). Equal up to FINGERPRINT_TOLERANCE (relative L2): the compression's rounding
# leaves ~1e-5; a round taken apart moves parameters by ~1e-2 of their norm.
FINGERPRINT_VALUES = 64
FINGERPRINT_TOLERANCE = 1e-3


class RoundTracker(GuardedProgressTracker):
    """hivemind's progress tracker with a round of ``samples_per_trainer x trainers`` samples.

    hivemind counts only trainers that have reported samples (the coordinator never does), so the number
    of progress records is the number of trainers.
    """

    samples_per_trainer: int = 1

    def _parse_swarm_progress_data(self, metadata):
        metadata = self.without_banned(metadata)  # a banned trainer's samples make no round here
        trainers = 0
        if isinstance(metadata, dict):
            trainers = sum(1 for record in metadata.values() if getattr(record, "value", None) is not None)
        self.target_batch_size = self.samples_per_trainer * max(1, trainers)
        return super()._parse_swarm_progress_data(metadata)


NON_FINITE = "non-finite values"


@dataclass(frozen=True)
class StateProblem:
    """Why a downloaded DiLoCo state is refused. ``behind``: it is of an older epoch, which an honest donor's
    state can be (late: its round's outer step not applied yet), unlike the other problems."""

    reason: str
    behind: bool = False

    def __str__(self) -> str:
        return self.reason


class OuterStateAverager(TrainingStateAverager):
    """hivemind's state averager for DiLoCo: it all-reduces pseudo-gradients and applies the outer optimizer.

    Set up after construction by :meth:`init_outer` (the averager's process has forked by then; the outer
    state lives in the trainer's process only, where hivemind also serves and applies states).
    """

    outer_parameters: list[torch.Tensor]
    outer_optimizer: torch.optim.Optimizer
    outer_fingerprint: list[float]  # sampled outer parameters; about equal on trainers stepping from the same
    outer_rounds_applied: int = 0
    loaded_epoch: int | None = None  # as RecordingStateAverager's: the epoch of the last state downloaded
    last_pseudo_gradient_norm: float | None = None
    own_pseudo_gradient_norm: float | None = None
    refused_average: bool = False
    resyncing: bool = False  # set by the optimizer while it loads the state of its round's majority
    refused_state: str | None = None  # why the last downloaded state was refused
    refused_state_behind: bool = False  # ... because it was of an older epoch: late, which an honest peer can be
    guard_report = None  # GuardedDiLoCoStateAverager's (geotrain.hive.guard.report)
    min_inner_steps_for_norm_check: float = 1.0  # a quarter of optimizer.diloco.inner_steps
    overlap_rounds: bool = False  # optimizer.diloco.overlap_rounds
    _round_prepared: bool = False  # the round's pseudo-gradient is in the averaging buffers (prepare_round)
    _boundary_parameters: list[torch.Tensor] | None = None  # local parameters at the round's boundary (overlap)
    # Honest pseudo-gradients of one round differ far more in norm than honest gradients do (up to 43x in a
    # loopback CV run, with every member past a quarter of H): the guard's factor is widened 100-fold, which
    # still refuses a contribution scaled a million times
    contribution_norm_slack = 100

    def __init__(self, *args, min_inner_steps_for_norm_check: float = 1.0, overlap_rounds: bool = False, **kwargs):
        # shared with the averager's process (it forks in hivemind's __init__), where the guard reads them
        self.min_inner_steps_for_norm_check = min_inner_steps_for_norm_check
        self.overlap_rounds = overlap_rounds
        self.own_inner_steps = multiprocessing.Value(ctypes.c_double, 0.0, lock=False)
        super().__init__(*args, **kwargs)
        if self.overlap_rounds:
            # a round in the background holds one worker for its whole all-reduce; the inner steps need another
            # (hivemind gives two only with its delta rule, which would make every inner step wait for the round)
            self.step_executor.shutdown(wait=True)
            self.step_executor = ThreadPoolExecutor(max_workers=2)

    def contribution_norm_applies(self) -> bool:
        """Whether the guard (geotrain.hive.guard.contributions) compares received parts with this peer's own
        pseudo-gradient: pseudo-gradients grow with a peer's inner steps, so a peer with few steps this round (it just
        joined or re-synced) has no fair scale to compare with."""
        return self.own_inner_steps.value >= self.min_inner_steps_for_norm_check

    @torch.no_grad()
    def init_outer(self, learning_rate: float, momentum: float, nesterov: bool) -> None:
        self.outer_parameters = [p.detach().to("cpu", torch.float32, copy=True).requires_grad_(True)
                                 for p in self._local_parameters()]
        self.outer_optimizer = torch.optim.SGD(self.outer_parameters, lr=learning_rate, momentum=momentum,
                                               nesterov=nesterov and momentum > 0)
        if momentum > 0:
            initialize_optimizer_state_(self.outer_optimizer)  # zero momentum buffers: a fixed state layout
        for parameter in self.outer_parameters:
            parameter.grad = None
        self._update_fingerprint()

    @torch.no_grad()
    def _update_fingerprint(self) -> None:
        flat = torch.cat([p.detach().reshape(-1) for p in self.outer_parameters])
        stride = max(1, flat.numel() // FINGERPRINT_VALUES)
        self.outer_fingerprint = [float(value) for value in flat[::stride][:FINGERPRINT_VALUES]]

    def schedule_step(self, scheduled_time=None, **kwargs):
        """hivemind's pre-scheduled round, with this peer's outer parameters' fingerprint in what the group
        gathers: after the round every member knows whose outer parameters the others stepped from."""
        if hasattr(self, "outer_fingerprint"):
            kwargs["gather"] = {"epoch": kwargs.get("gather"), "outer": self.outer_fingerprint}
        return super().schedule_step(scheduled_time, **kwargs)

    def _local_parameters(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    @torch.no_grad()
    def prepare_round(self) -> None:
        """Take the round's pseudo-gradient now, in the trainer's thread: with overlapped rounds hivemind would
        take it in its background thread, while the next inner steps already move the local parameters. The
        local parameters at the boundary are kept until the outer step lands (see _outer_step)."""
        self._load_local_tensors_into_averager_()
        self._boundary_parameters = [p.detach().to("cpu", torch.float32, copy=True) for p in self._local_parameters()]
        self._round_prepared = True

    @torch.no_grad()
    def _load_local_tensors_into_averager_(self):
        """Before a round: this peer's pseudo-gradient (outer minus local parameters) and its buffers."""
        if not hasattr(self, "outer_parameters"):  # hivemind's own call during construction
            return super()._load_local_tensors_into_averager_()
        if self._round_prepared:  # taken by prepare_round at the round's boundary
            self._round_prepared = False
            return
        local = list(self._local_tensors())
        count = len(self.outer_parameters)
        with self.get_tensors() as averaged:
            for index, (local_tensor, averaged_tensor) in enumerate(zip(local, averaged)):
                averaged_tensor.copy_(local_tensor, non_blocking=False)
                if index < count:
                    averaged_tensor.neg_().add_(self.outer_parameters[index])
            self.own_pseudo_gradient_norm = total_norm(averaged[:count])
            self._own_pseudo_gradient = [t.clone() for t in averaged[:count]]

    @torch.no_grad()
    def _apply_averaging_results_(self):
        """After a round: the outer step with the averaged pseudo-gradient, then local = outer parameters."""
        count = len(self.outer_parameters)
        with self.get_tensors() as averaged:
            pseudo_gradients, buffers = list(averaged[:count]), list(averaged[count:])
            norm = total_norm(pseudo_gradients)
            bound = self.average_norm_bound()
            reason = None
            if not all_finite(pseudo_gradients) or not all_finite(buffers):
                reason = "non-finite"
            elif norm > bound:
                reason = "norm"
            self.refused_average = reason is not None
            if reason is not None:
                logger.warning("refused the swarm's pseudo-gradient average (%s: norm %.4g, at most %.4g: %g times the "
                               "parameters' norm or %g times this peer's own pseudo-gradient's); stepping with this "
                               "peer's own and loading the swarm's state next", reason, norm, bound,
                               MAX_PSEUDO_GRADIENT_TO_PARAMETERS, self.contribution_norm_slack)
                if self.guard_report is not None:
                    self.guard_report.count("pseudo_gradient", reason)
                    self.guard_report.event("pseudo_gradient_refused", peer_id=self.peer_id.to_base58(),
                                            reason=reason, norm=norm if math.isfinite(norm) else str(norm),
                                            bound=bound)
                pseudo_gradients = self._own_pseudo_gradient
                buffers = None
            self._outer_step(pseudo_gradients, keep_local_progress=self.overlap_rounds)
            if buffers is not None:
                for local_buffer, averaged_buffer in zip(self.extra_tensors, buffers):
                    local_buffer.copy_(averaged_buffer)
        self.last_pseudo_gradient_norm = total_norm(pseudo_gradients) if reason else norm

    def average_norm_bound(self) -> float:
        """The largest norm an honest round's average can have: 10 times the outer parameters' norm, or, when this
        peer moved further (long rounds of an adaptive inner optimizer move every parameter by about its learning
        rate per step, in a consistent direction early in training: 12.8 times the parameters' norm after 256
        AdamW steps of the lab's emulated model), as far as the guard lets a received part be
        (``contribution_norm_slack`` times this peer's own pseudo-gradient; an average is no larger than its
        largest part)."""
        own = self.own_pseudo_gradient_norm or 0.0
        return max(MAX_PSEUDO_GRADIENT_TO_PARAMETERS * total_norm(self.outer_parameters),
                   self.contribution_norm_slack * own if math.isfinite(own) else 0.0)

    @torch.no_grad()
    def apply_own_pseudo_gradient_(self) -> None:
        """The outer step of a round without peers: this peer's own pseudo-gradient (DiLoCo with one worker)."""
        self._load_local_tensors_into_averager_()
        self._outer_step(self._own_pseudo_gradient)
        self.last_pseudo_gradient_norm = self.own_pseudo_gradient_norm

    @torch.no_grad()
    def _outer_step(self, pseudo_gradients, keep_local_progress: bool = False) -> None:
        """The outer step; then local = outer parameters, or with ``keep_local_progress`` (an overlapped round)
        local += new outer - local at the round's boundary: the inner steps taken since the boundary stay."""
        with self.lock_optimizer:
            boundary = self._boundary_parameters if keep_local_progress else None
            self._boundary_parameters = None
            for parameter, pseudo_gradient in zip(self.outer_parameters, pseudo_gradients):
                parameter.grad = pseudo_gradient
            self.outer_optimizer.step()
            for parameter in self.outer_parameters:
                parameter.grad = None
            if boundary is None:
                self._copy_outer_into_local()
            else:  # (outer + exactly 0 when no inner step came since: the run's last round ends on the outer ones)
                for local, outer, at_boundary in zip(self._local_parameters(), self.outer_parameters, boundary):
                    drift = local.detach().to("cpu", torch.float32) - at_boundary
                    local.copy_(outer + drift)
        self._update_fingerprint()
        self.outer_rounds_applied += 1

    @torch.no_grad()
    def _copy_outer_into_local(self) -> None:
        for local, outer in zip(self._local_parameters(), self.outer_parameters):
            local.copy_(outer)

    def freeze_served_state(self, parameters) -> None:
        """Nothing to freeze (the end-of-run agreement's call): what this peer serves is a copy of its outer
        parameters, taken under the averager's lock, and only an outer round changes them."""

    def get_current_state(self):
        """What a newcomer downloads: the outer parameters (not this peer's local ones), buffers, the inner and
        the outer optimizer's state, the epoch."""
        if not hasattr(self, "outer_parameters"):
            return super().get_current_state()
        with torch.no_grad(), self.lock_averaged_tensors, self.lock_optimizer:
            parameters = tuple(p.detach().clone() for p in self.outer_parameters)
            extras = tuple(t.detach().cpu() for t in self.extra_tensors)
            inner_metadata, inner_tensors = dump_optimizer_state(self.optimizer)
            outer_metadata, outer_tensors = dump_optimizer_state(self.outer_optimizer)
        infos = [CompressionInfo.from_tensor(p, key=key, role=TensorRole.PARAMETER)
                 for p, key in zip(parameters, self.parameter_names)]
        infos += [CompressionInfo.from_tensor(t, key=i, role=TensorRole.UNSPECIFIED) for i, t in enumerate(extras)]
        infos += [CompressionInfo.from_tensor(t, key=i, role=TensorRole.OPTIMIZER)
                  for i, t in enumerate(inner_tensors + outer_tensors)]
        metadata = dict(epoch=self.local_epoch, group_bits=self.get_group_bits(), optimizer_metadata=inner_metadata,
                        outer_optimizer_metadata=outer_metadata, inner_optimizer_tensors=len(inner_tensors))
        return metadata, [*parameters, *extras, *inner_tensors, *outer_tensors], infos

    def load_state_from_peers(self, **kwargs):
        """Download a donor's outer state (see :meth:`get_current_state`); a state that does not fit this model
        or holds non-finite values is refused whole, before anything of it is applied."""
        if not hasattr(self, "outer_parameters"):
            return super().load_state_from_peers(**kwargs)
        loaded = super(TrainingStateAverager, self).load_state_from_peers(**kwargs)  # DecentralizedAverager's
        if loaded is None:
            return None
        metadata, tensors = loaded
        problem = self._state_problem(metadata, tensors)
        if problem is not None:
            logger.warning("refused the downloaded DiLoCo state: %s; this peer keeps its own", problem)
            self.refused_state, self.refused_state_behind = problem.reason, problem.behind
            if problem.reason == NON_FINITE and self.guard_report is not None:
                self.guard_report.count("parameters", "non-finite in loaded state")
                self.guard_report.event("state_refused", peer_id=self.peer_id.to_base58(), reason="non-finite")
            return None
        count, extras = len(self.outer_parameters), len(self.extra_tensors)
        inner_count = metadata["inner_optimizer_tensors"]
        parameters = tensors[:count]
        buffers = tensors[count:count + extras]
        inner = tensors[count + extras:count + extras + inner_count]
        outer = tensors[count + extras + inner_count:]
        with torch.no_grad(), self.lock_averaged_tensors, self.lock_optimizer:
            try:
                load_optimizer_state(self.optimizer, metadata["optimizer_metadata"], inner)
                load_optimizer_state(self.outer_optimizer, metadata["outer_optimizer_metadata"], outer)
            except (StopIteration, KeyError, ValueError, IndexError) as error:
                logger.warning("refused the downloaded DiLoCo state: its optimizer state does not fit (%s)", error)
                return None
            for outer_parameter, loaded_parameter in zip(self.outer_parameters, parameters):
                outer_parameter.copy_(loaded_parameter)
            for buffer, loaded_buffer in zip(self.extra_tensors, buffers):
                buffer.copy_(loaded_buffer)
            self._copy_outer_into_local()
        self._update_fingerprint()
        self.local_epoch = self.loaded_epoch = metadata["epoch"]
        self._update_scheduler()
        return True

    def _state_problem(self, metadata, tensors) -> StateProblem | None:
        if not isinstance(metadata, dict) or not isinstance(metadata.get("epoch"), int):
            return StateProblem("no epoch in its metadata")
        if metadata["epoch"] < self.local_epoch:
            return StateProblem(f"its epoch {metadata['epoch']} is behind this peer's {self.local_epoch}", behind=True)
        if not isinstance(metadata.get("inner_optimizer_tensors"), int) or "outer_optimizer_metadata" not in metadata:
            return StateProblem("it is not a DiLoCo state (is the donor in optimizer.mode sync?)")
        count, extras = len(self.outer_parameters), len(self.extra_tensors)
        if len(tensors) < count + extras + metadata["inner_optimizer_tensors"]:
            return StateProblem("it holds fewer tensors than this model has")
        for tensor, parameter in zip(tensors[:count], self.outer_parameters):
            if tensor.shape != parameter.shape:
                return StateProblem(f"a parameter of shape {tuple(tensor.shape)} where this model has "
                                    f"{tuple(parameter.shape)}")
        if not all_finite(t for t in tensors if t.is_floating_point()):
            return StateProblem(NON_FINITE)
        if self.resyncing:  # a peer of this peer's own round: its outer parameters are at most a few steps apart
            distance = total_norm([t - p for t, p in zip(tensors[:count], self.outer_parameters)])
            bound = MAX_PSEUDO_GRADIENT_TO_PARAMETERS * total_norm(self.outer_parameters)
            if distance > bound:
                return StateProblem(f"its parameters are {distance:.4g} away from this peer's (at most {bound:.4g} "
                                    "for a state of the same round)")
        return None

    def outer_state_dict(self) -> dict:
        """For checkpoints: the outer optimizer's state (the outer parameters are the model's after a round)."""
        return self.outer_optimizer.state_dict()

    @torch.no_grad()
    def load_outer_state_dict(self, state: dict) -> None:
        """After a checkpoint restore set the model's (= outer) parameters: take them as the outer parameters."""
        for outer, local in zip(self.outer_parameters, self._local_parameters()):
            outer.copy_(local)
        self.outer_optimizer.load_state_dict(state)
        self._update_fingerprint()


class DiLoCoStateAverager(OuterStateAverager, RecordingStateAverager):
    """The state averager a DiLoCo trainer runs: outer rounds (:class:`OuterStateAverager`) with what
    :class:`~geotrain.hive.optim.optimizer.RecordingStateAverager` adds to every state averager (the epoch of
    each state download, state rounds given up when no group will form, the guard's last good parameters)."""


def same_outer_parameters(first: list[float], second: list[float]) -> bool:
    """Whether two fingerprints come from the same outer parameters, up to the rounding of a compressed round
    (hivemind's all-reduce hands each member its average through the compression, so members differ in the
    last bits) and far from the difference of an outer step taken apart."""
    if len(first) != len(second) or not first:
        return False
    distance = math.sqrt(sum((a - b) ** 2 for a, b in zip(first, second)))
    return distance <= FINGERPRINT_TOLERANCE * max(math.sqrt(sum(a * a for a in first)), 1e-12)


def majority_donor(gathered: dict) -> tuple[str | None, int, list[float] | None]:
    """From a round's gathered metadata ({peer id: {"outer": fingerprint, ...}}): the member whose outer
    parameters most members share (ties: the smallest peer id), how many share them, and its fingerprint;
    (None, 0, None) when no member sent a fingerprint."""
    fingerprints = {str(peer_id): metadata["outer"] for peer_id, metadata in gathered.items()
                    if isinstance(metadata, dict) and isinstance(metadata.get("outer"), list)}
    best, best_count = None, 0
    for peer_id in sorted(fingerprints):
        count = sum(same_outer_parameters(fingerprints[peer_id], other) for other in fingerprints.values())
        if count > best_count:
            best, best_count = peer_id, count
    return best, best_count, fingerprints.get(best)


class DiLoCoOptimizer(MeasuredOptimizer):
    """geotrain's optimizer running outer rounds (see the module's docstring); its settings, the round's
    samples per trainer, the bytes a pseudo-gradient sends and how long a refused donor is banned, are set
    before hivemind's constructor makes the progress tracker."""

    on_outer_round = None  # callable(result, duration_s, group_size, pseudo_gradient_norm, sent_bytes)
    blocking_communication_s = 0.0  # seconds of outer rounds and state loads so far (the rest of step() computes)
    _resync_from: str | None = None  # peer id of the round's majority whose outer state to load
    _round_in_flight: dict | None = None  # an overlapped round whose outer step has not landed yet
    on_outer_state_loaded = None  # callable(donor peer id or None: any, epoch of the state)

    def __init__(self, *args, samples_per_trainer_round: int = 1, pseudo_gradient_bytes: int = 0,
                 guard_ban_s: float = 600.0, **kwargs):
        self.samples_per_trainer_round = samples_per_trainer_round
        self.pseudo_gradient_bytes = pseudo_gradient_bytes  # compressed, as sent
        self.guard_ban_s = guard_ban_s  # guard.ban_s: how long a donor whose outer state was refused is banned
        super().__init__(*args, **kwargs)

    def _make_state_averager(self, **kwargs):
        # hivemind turns on its delta rule for delayed averaging with local updates; the outer step keeps the
        # inner steps' progress its own way (OuterStateAverager._outer_step), and the delta rule would make
        # every inner step wait for the round in flight
        kwargs["delta_rule_averaging"] = False
        return super()._make_state_averager(**kwargs)

    def _make_progress_tracker(self, target_batch_size: int, **kwargs) -> ProgressTracker:
        tracker = RoundTracker(dht=self.dht, prefix=self.run_id, target_batch_size=target_batch_size,
                               client_mode=self.client_mode, status_loglevel=self.status_loglevel, start=False,
                               **kwargs)
        tracker.samples_per_trainer = self.samples_per_trainer_round
        tracker.target_batch_size = self.samples_per_trainer_round
        tracker.start()
        return tracker

    def _others_in_sight(self) -> bool:
        """Whether other trainers report progress, from a fresh look at the DHT (hivemind's view can be seconds
        old: trainers that start together would each take their first rounds alone, and step apart)."""
        tracker = self.tracker
        tracker.fetched_global_progress_this_epoch.clear()
        tracker.global_progress.next_fetch_time = get_dht_time()
        tracker.global_state_updated.set()
        tracker.fetched_global_progress_this_epoch.wait(ALONE_REFRESH_S)
        return tracker.global_progress.num_peers > 1

    def _update_global_epoch(self, grad_scaler) -> None:
        self.finish_outer_round()  # an overlapped round's outer step lands before this round's pseudo-gradient
        if self.tracker.global_progress.num_peers <= 1 and self._others_in_sight() \
                and not self.tracker.ready_to_update_epoch:
            return  # the round is larger with the others counted: train on
        averager = self.state_averager
        trainers = self.tracker.global_progress.num_peers
        applied_before = averager.outer_rounds_applied
        next_epoch = max(self.local_epoch + 1, self.tracker.global_epoch)
        control = self.scheduled_state
        if trainers > 1 and (control is None or control.triggered or control.done()):
            # scheduled here when hivemind did not pre-schedule it, so that its outcome is known afterwards
            control = self.scheduled_state = averager.schedule_step(gather=next_epoch,
                                                                    timeout=self.averaging_timeout)
        round_ = {"control": control, "own_fingerprint": averager.outer_fingerprint, "trainers": trainers,
                  "applied_before": applied_before, "started": time.perf_counter()}
        averager.own_inner_steps.value = self.tracker.local_progress.samples_accumulated / self.batch_size_per_step
        if averager.overlap_rounds:
            averager.prepare_round()
        super()._update_global_epoch(grad_scaler)
        self.blocking_communication_s += time.perf_counter() - round_["started"]
        in_flight = averager.overlap_rounds and (averager.finished_averaging_round.is_set() or any(
            not update.done() for update in averager.pending_updates))
        if in_flight:  # its outer step lands later (finish_outer_round)
            self._round_in_flight = round_
        else:
            self._report_round(round_)

    def step(self, *args, **kwargs):
        round_ = self._round_in_flight
        if round_ is not None and (self.state_averager.finished_averaging_round.is_set()
                                   or self.state_averager.outer_rounds_applied > round_["applied_before"]):
            self.finish_outer_round()  # the overlapped round's all-reduce is done: its outer step lands now
        return super().step(*args, **kwargs)

    def finish_outer_round(self) -> None:
        """Wait for an overlapped round still in flight and apply its outer step (a no-op without one); the
        trainer calls it after its last micro-step, so that the run ends on the last round's outer step."""
        round_ = self._round_in_flight
        if round_ is None:
            return
        self._round_in_flight = None
        averager = self.state_averager
        waited = time.perf_counter()
        averager.step(wait_for_delayed_updates=True)  # waits for the all-reduce, applies its outer step
        self.blocking_communication_s += time.perf_counter() - waited
        self._report_round(round_)

    def _report_round(self, round_: dict) -> None:
        """After a round's outer step: re-sync when this peer stepped from other outer parameters than the
        round's majority, then the log line and the on_outer_round callback."""
        averager, control = self.state_averager, round_["control"]
        duration_s = time.perf_counter() - round_["started"]
        group_size, result, gathered = 1, "alone", {}
        if averager.outer_rounds_applied == round_["applied_before"]:  # no round ran: a swarm of one, or skipped
            averager.apply_own_pseudo_gradient_()
            if control is not None and not control.done():
                control.cancel()
        elif control is not None:
            result = averaging_round_result(control)
            if result == "ok":
                gathered = control.result()
                group_size = len(gathered)
            if averager.refused_average:
                result = "refused"
        donor, sharing, donor_fingerprint = majority_donor(gathered)
        if donor_fingerprint is not None and not same_outer_parameters(round_["own_fingerprint"],
                                                                       donor_fingerprint):
            # this peer's outer parameters were not the group's (a round it missed, a split group, a refused
            # average): it takes those of the group's majority, so that every trainer steps from the same ones
            self._resync_from = donor
            logger.warning("outer round %d: this trainer's outer parameters differ from those of the round's "
                           "majority (%d of %d trainers); loading them from %s before the next step",
                           self.local_epoch, sharing, group_size, donor)
        else:
            logger.info("outer round %d: %s with %d of %d trainers in %.1f s, pseudo-gradient norm %.4g",
                        self.local_epoch, result, group_size, max(round_["trainers"], group_size), duration_s,
                        averager.last_pseudo_gradient_norm or 0.0)
        if self.on_outer_round is not None:
            # hivemind's butterfly all-reduce: each of g peers sends (g - 1) / g of its part twice (reduce, gather)
            sent_bytes = 2 * self.pseudo_gradient_bytes * (group_size - 1) / group_size
            self.on_outer_round(result, duration_s, group_size, averager.last_pseudo_gradient_norm, sent_bytes)

    def _should_load_state_from_peers(self) -> bool:
        return self._resync_from is not None or super()._should_load_state_from_peers()

    def load_state_from_peers(self, **kwargs):
        self.finish_outer_round()
        donor, self._resync_from = self._resync_from, None
        report = self.state_averager.guard_report
        averager = self.state_averager
        loaded_before = averager.loaded_epoch
        if donor is not None and report is not None:
            report.set_only_donor(donor)
        averager.resyncing, averager.refused_state, averager.refused_state_behind = donor is not None, None, False
        started = time.perf_counter()
        try:
            result = super().load_state_from_peers(**kwargs)
        finally:
            self.blocking_communication_s += time.perf_counter() - started
            averager.resyncing = False
            if donor is not None and report is not None:
                report.set_only_donor(None)
        if donor is not None and averager.refused_state is not None and averager.refused_state_behind:
            # the majority's donor had not applied the round's outer step yet (it runs in the background): late,
            # not forged. Seen in CI: a trainer banned an honest one for this, and the two ended the run on
            # different final states. This peer resyncs after its next round.
            logger.info("the outer state of %s is not this round's yet (%s); not banned", donor,
                        averager.refused_state)
        elif donor is not None and averager.refused_state is not None and report is not None:
            # the round's "majority" offered a state that no honest round could have made: a forged one
            report.bans.ban(donor, self.guard_ban_s)
            logger.warning("banned %s for %.0f s: its outer state was refused (%s)", donor, self.guard_ban_s,
                           averager.refused_state)
        loaded = self.state_averager.loaded_epoch
        if self.on_outer_state_loaded is not None and loaded is not None and loaded != loaded_before:
            self.on_outer_state_loaded(donor, loaded)
        return result
