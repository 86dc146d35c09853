"""PowerSGD gradient compression (``optimizer.grad_compression: powersgd``) on hivemind's PowerSGD averager.

hivemind's :class:`~hivemind.optim.power_sgd_averager.PowerSGDGradientAverager` (PowerSGD, Vogels et al.,
arXiv 1905.13727) sends, for each gradient matrix M (m x n; a conv kernel seen as out x in*k*k), two thin
factors instead of M: each round is two all-reduces in the same group,

- phase P: every peer sends P = M Q (m x r), with Q (n x r) from the previous round; the average of the P
  is orthonormalised,
- phase Q: every peer sends Q = M^T P (n x r); the averaged Q is kept for the next round, and P Q^T is the
  averaged gradient this peer applies,

with r = ``optimizer.powersgd_rank``. M is this peer's gradient *plus an error-feedback buffer*: what the
rank-r approximation left out of earlier rounds, added back before compressing (a full-size fp32 buffer in
host memory, one more gradient-sized copy). Vectors (biases, norms) and matrices that r (m + n) would not
shrink at least twofold (``min_compression_ratio``) are sent as they are, in phase Q. Every part goes on the
wire in fp16 (:func:`geotrain.hive.optim.factory.build_compression`), and so do the state averaging rounds.

:class:`PowerSGDKeepingAverager` is that averager with what geotrain's gradient averager adds
(:class:`~geotrain.hive.averaging.local_gradients.LocalGradientsKeepingAverager`), and
as :class:`geotrain.hive.optim.averagers.GuardedPowerSGDAverager`, with the guard's checks
(:mod:`geotrain.hive.guard.contributions`):

- The guard sees every part of both phases (both are ordinary hivemind all-reduces, registered under the
  group id plus the phase's name); non-finite values and an excessive weight are refused in both. The
  *norm* check (a part over ``guard.contribution_norm_factor`` times this peer's own) is kept for the
  tensors sent as they are, and skipped for the factors, see :class:`_RunnerSeenByGuard` for why.
- When a round fails, this peer steps with its own gradients of the epoch (kept as in the plain averager),
  and the error-feedback buffer is put back as it was before the round (:meth:`_aggregate_with_group`):
  the gradient that went into it is applied once, here, as in the plain averager, and not a second time
  through the next round's feedback; nor twice in one round when hivemind retries the all-reduce with
  another group (PowerSGD adds the gradient to the buffers anew on each try).
- A newcomer downloads the current Q of a peer (hivemind.Optimizer loads the gradient averager's state
  after the training state); one of another shape, or with non-finite values, is refused.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import logging
import math

import torch
from hivemind.optim.power_sgd_averager import AllReducePhases, PowerSGDGradientAverager
from hivemind.utils.asyncio import enter_asynchronously
from hivemind.utils.math import get_flatten_greedy_dims

from geotrain.hive.averaging.local_gradients import LocalGradientsKeepingAverager

logger = logging.getLogger(__name__)

DEFAULT_RANK = 4
MIN_COMPRESSION_RATIO = 0.5  # hivemind's PowerSGDGradientAverager default: a matrix must shrink at least twofold


def values_on_the_wire(shapes, rank: int, min_compression_ratio: float = MIN_COMPRESSION_RATIO) -> tuple[int, int]:
    """(factor values, values sent as they are) of one PowerSGD round over gradients of ``shapes``, both phases
    together, by hivemind's rule: vectors, and matrices that rank-``rank`` factors would not shrink by
    ``min_compression_ratio``, go as they are."""
    factors = plain = 0
    for shape in shapes:
        numel = math.prod(shape)
        if len(shape) <= 1:
            plain += numel
            continue
        values = rank * sum(get_flatten_greedy_dims(torch.empty(shape, device="meta")))  # P: m x r, Q: n x r
        if 1 - values / numel < min_compression_ratio:
            plain += numel
        else:
            factors += values
    return factors, plain

_PHASE_P = AllReducePhases.PHASE_P.name.encode()
_PHASE_Q = AllReducePhases.PHASE_Q.name.encode()


class _RunnerSeenByGuard:
    """An all-reduce runner of a PowerSGD round as the guard's check sees it: the same runner, except that
    this peer's own parts of PowerSGD factors read as None in ``parts_for_local_averaging``, so that
    :func:`geotrain.hive.guard.contributions.contribution_refusal` checks them for finiteness and weight but not for
    norm.

    Why the norm check does not fit the factors: it compares a sender's part with this peer's own part of
    the same span, on the grounds that honest mean gradients have norms of one scale. A factor's norm is
    not a mean gradient's:

    - P = M Q scales with the sender's Q, which is state outside the round: after a round it missed (or
      whose Q phase failed) a peer's Q differs from the others', and before its first round it is
      ``torch.rand`` (entries in [0, 1), norm ~ sqrt(n r / 3), e.g. ~39 for a 128 x 1152 kernel at rank 4),
      where after a round it is of the gradients' scale (often < 1): an honest newcomer's P would be
      hundreds of times this peer's, refused, and its sender banned for ``guard.ban_s``.
    - M carries the error-feedback buffer, which grows over the rounds with what the rank-r approximation
      leaves out (most of the gradient at rank 1) and with the peer's own drift from the average, which
      the average never removes; a newcomer's buffer is empty. Q = M^T P compares buffers of different
      ages, not gradients.

    The tensors PowerSGD sends as they are (phase Q, after the factors) are plain mean gradients: their
    norm check stays. Everything else of the runner is the runner's (hivemind's reducer uses it through
    this view: ``__getattr__``).
    """

    def __init__(self, runner, factor_tensors: int):
        self._runner = runner
        container = runner.tensor_part_container
        # hivemind splits each tensor into parts, in order, and gives each peer a run of consecutive parts
        # (hivemind/averaging/partition.py: TensorPartContainer.__init__)
        own_index = runner.ordered_peer_ids.index(runner.peer_id)
        first_part = sum(container.num_parts_by_peer[:own_index])
        tensor_ends = list(itertools.accumulate(container.num_parts_by_tensor))
        self.parts_for_local_averaging = tuple(
            None if bisect.bisect_right(tensor_ends, first_part + index) < factor_tensors else part
            for index, part in enumerate(runner.parts_for_local_averaging))

    def __getattr__(self, name):
        return getattr(self._runner, name)


class _RunnerFuture(asyncio.Future):
    """The future of a round's phase in ``_running_groups``: it holds the runner as the guard should see it
    (hivemind's ``_run_allreduce_inplace_`` sets it; hivemind's handler and the guard's check await it)."""

    def __init__(self, factor_tensors: int):
        super().__init__()
        self._factor_tensors = factor_tensors

    def set_result(self, runner) -> None:
        super().set_result(_RunnerSeenByGuard(runner, self._factor_tensors))


class PowerSGDKeepingAverager(LocalGradientsKeepingAverager, PowerSGDGradientAverager):
    """hivemind's PowerSGD gradient averager with geotrain's fallback and checks (see the module's docstring).

    It answers under hivemind's ``PowerSGDGradientAverager`` handler names (``hivemind_handle_name``), so it
    averages with bare hivemind PowerSGD peers of the same rank; peers of another compression or rank in the
    same run fail their rounds with it (hivemind checks neither).
    """

    def __init__(self, *args, averager_rank: int = DEFAULT_RANK, **kwargs):
        self._round_in_feedback = False  # averager process: this round's gradient is in the feedback buffers
        self._rounds_done = 0  # averager process: rounds it finished (the trainer may have stopped waiting)
        super().__init__(*args, averager_rank=averager_rank, **kwargs)

    # --- the guard's view of the factors ------------------------------------------------------------------
    @contextlib.contextmanager
    def _register_allreduce_group(self, group_info):
        with super()._register_allreduce_group(group_info):
            # replaced before anything can await them: nothing yields to the event loop in between
            for phase in (_PHASE_P, _PHASE_Q):
                self._running_groups[group_info.group_id + phase] = _RunnerFuture(len(self._qs))
            yield

    # --- the error-feedback buffers after a failed round ----------------------------------------------------
    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs):
        """hivemind's PowerSGD round; when it fails after this peer's gradient went into the feedback
        buffers (``m.add_(grad)``, just before phase P) and before they gave back the round's approximation
        (``m.sub_(new_m)``, after phase Q), that gradient is taken out of them again.

        The gradients to take out are the averaged tensors of the compressed matrices: PowerSGD leaves them
        alone until its last loop (its all-reduces run on P, Q and the uncompressed tensors). One case where
        they have changed before the undo: the trainer gave up waiting (``optimizer.averaging_timeout_s``),
        stepped with its own gradients and clipped them in place (``optimizer.grad_clip_norm``), all while
        the all-reduce was still running; then the clipped-off part stays in the feedback, to be sent later.
        """
        self._round_in_feedback = False
        try:
            gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        except BaseException:
            if self._round_in_feedback:
                self._round_in_feedback = False
                await self._take_round_out_of_feedback()
            raise
        if not self._rounds_done:
            logger.info("first PowerSGD round done in a group of %d peers: %s", len(group_info.peer_ids),
                        self.describe_traffic())
        self._rounds_done += 1
        return gathered

    def describe_traffic(self) -> str:
        """What one round sends in place of the whole gradient, in values (both phases together)."""
        gradients = self.parameters  # (their shapes)
        factors, plain = values_on_the_wire([tuple(g.shape) for g in gradients], self.rank)
        matrices = len(gradients) - len(self._uncompressed_gradients_indexes)
        whole = sum(g.numel() for g in gradients)
        return (f"rank {self.rank} factors of {matrices} gradient matrices ({factors} values) and "
                f"{len(gradients) - matrices} tensors as they are ({plain} values): {factors + plain} values "
                f"where the whole gradient has {whole} ({whole / max(1, factors + plain):.1f}x fewer)")

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        if group_id == group_info.group_id + _PHASE_P:
            self._round_in_feedback = True  # PowerSGD added this round's gradients to the feedback just now
        await super()._run_allreduce_inplace_(tensors, group_info, group_id, **kwargs)
        if group_id == group_info.group_id + _PHASE_Q:
            self._round_in_feedback = False  # all that is left is local: the feedback gets the round's result

    async def _take_round_out_of_feedback(self) -> None:
        async with enter_asynchronously(self.get_tensors()) as averaged_gradients:
            compressed = [gradient for index, gradient in enumerate(averaged_gradients)
                          if index not in self._uncompressed_gradients_indexes]
            with torch.no_grad():
                for feedback, gradient in zip(self._ms, compressed):
                    feedback.sub_(gradient.to(feedback.device))
        logger.info("PowerSGD round failed; this round's gradients were taken out of the error feedback")

    # --- a newcomer's Q ---------------------------------------------------------------------------------
    def load_state_from_peers(self, **kwargs):
        """hivemind's download of a peer's Q matrices (PowerSGD's own copies them unchecked: a tensor of
        another shape would broadcast or raise, and hivemind.Optimizer retries a raising download forever)."""
        loaded = super(PowerSGDGradientAverager, self).load_state_from_peers(**kwargs)
        if loaded is None:
            return None
        _, tensors = loaded
        if len(tensors) != len(self._qs) or any(tensor.shape != q.shape for tensor, q in zip(tensors, self._qs)):
            logger.warning("refused the downloaded PowerSGD state: %d tensors of shapes %s where this peer has %d "
                           "of shapes %s (another optimizer.powersgd_rank or model?); keeping this peer's own",
                           len(tensors), [tuple(t.shape) for t in tensors][:4], len(self._qs),
                           [tuple(q.shape) for q in self._qs][:4])
            return None
        if not all(bool(torch.isfinite(tensor).all()) for tensor in tensors):
            logger.warning("refused the downloaded PowerSGD state: it holds non-finite values; keeping this peer's own")
            return None
        with torch.no_grad(), self.lock_averaged_tensors:
            for q, tensor in zip(self._qs, tensors):
                q.copy_(tensor)
        return loaded
