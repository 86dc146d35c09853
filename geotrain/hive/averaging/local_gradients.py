"""hivemind's gradient averager, keeping this peer's own gradients for the fallback of a failed round.

Its own module so that geotrain.hive.optim.optimizer and the averagers built on it (geotrain.hive.averaging.powersgd)
import it without importing each other.
"""

from __future__ import annotations

import torch
from hivemind.optim.grad_averager import GradientAverager

from geotrain.hive.averaging.handle_names import hivemind_handle_name


class LocalGradientsKeepingAverager(GradientAverager):
    """hivemind's gradient averager that keeps this peer's own gradients of the round it started.

    Why: when a gradient averaging round that has started fails (the group never forms because a peer
    died or came late, the all-reduce times out), hivemind 1.1.12 "proceeds with local gradients", but by
    then those are gone:

    - ``GradientAverager.step`` (hivemind/optim/grad_averager.py:192-210) copies the accumulated
      gradients into the averaged tensors, then *resets the accumulators* (``reset_accumulators=True``,
      which ``Optimizer._begin_averaging_gradients``, optimizer.py:528-530, always passes), then lets
      the all-reduce run in place on the averaged tensors;
    - on failure ``Optimizer._load_local_gradients_into_optimizer`` (optimizer.py:632-639) calls
      ``load_accumulators_into_averager_()`` again, which copies the reset accumulators, times
      ``1 / local_times_accumulated`` (0 after the reset), over the averaged tensors.

    So the peer steps with all-zero gradients: AdamW then moves only along its old momentum, and not at
    all in the first epoch. With delayed updates the fallback runs in the background while the next
    epoch accumulates, and picks up part of *that* epoch's gradients instead. Seen here: under CPU load a
    trainer whose round timed out ("Averaging gradients failed with TimeoutError()", "Proceeding with
    local gradients") had a loss of 2.14 in the next epoch while the two trainers whose round succeeded
    had 1.53; a trainer whose first round fails keeps its initial weights (tests/integration/test_swarm.py).

    This class remembers what this peer contributes to each round (its mean gradient, exactly as
    hivemind loads it into the averaged tensors, before the all-reduce can touch them), and
    :meth:`load_kept_gradients_into_averager_` puts it back for the fallback
    (:meth:`MeasuredOptimizer._load_local_gradients_into_optimizer`). The copy lives in host memory next
    to hivemind's averaged gradients: one more gradient-sized buffer, reused every round.
    """

    _get_handle_name = classmethod(hivemind_handle_name)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._kept_gradients: tuple[torch.Tensor, ...] | None = None
        self._starting = None  # the StepControl of the round that step() is starting
        self.kept_for = None  # the StepControl of the round whose own gradients are kept

    def step(self, weight=None, reset_accumulators: bool = True, control=None, timeout=None, wait: bool = True,
             **kwargs):
        if control is None:  # what hivemind's step does, here so that the round's control is known beforehand
            control = self.schedule_step(timeout=timeout, **kwargs)
            kwargs = {}
        self._starting = control
        try:
            return super().step(weight=weight, reset_accumulators=reset_accumulators, control=control,
                                timeout=timeout, wait=wait, **kwargs)
        finally:
            self._starting = None

    def load_state_from_peers(self, **kwargs):
        """No download. hivemind.Optimizer loads the gradient averager's state after the training state, and a
        gradient averager's state is its last averaged gradients: a parameter-sized transfer (a third of an AdamW
        state, so a third more waiting over a thin link) that nobody reads, since hivemind resets the
        accumulators after a load and the next round overwrites the averaged gradients with them. (PowerSGD's
        averager downloads its Q matrices: geotrain.hive.averaging.powersgd.)"""
        return None

    @torch.no_grad()
    def load_accumulators_into_averager_(self):
        super().load_accumulators_into_averager_()
        if self._starting is None:
            return  # hivemind's own fallbacks: the accumulators were not reset, nothing to keep
        with self.get_tensors() as averaged_gradients:  # now exactly this peer's share of the starting round
            if self._kept_gradients is None:
                self._kept_gradients = tuple(torch.empty_like(g, device="cpu") for g in averaged_gradients)
            for kept, averaged in zip(self._kept_gradients, averaged_gradients):
                kept.copy_(averaged)
        self.kept_for, self._starting = self._starting, None

    def kept_gradients_norm(self) -> float | None:
        """L2 norm of this peer's own gradients of the latest round it started (None before the first)."""
        if self._kept_gradients is None:
            return None
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float())
                                                           for g in self._kept_gradients])))

    @torch.no_grad()
    def load_kept_gradients_into_averager_(self, control) -> bool:
        """Put this peer's own gradients of ``control``'s round back into the averaged tensors (False: none kept)."""
        if control is None or control is not self.kept_for:
            return False
        with self.get_tensors() as averaged_gradients:
            for kept, averaged in zip(self._kept_gradients, averaged_gradients):
                averaged.copy_(kept)
        return True
