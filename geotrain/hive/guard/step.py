"""Checks of each optimizer step on the swarm's averaged gradients, and of the parameters after it.

hivemind runs the torch optimizer on the *averaged* gradients, which every peer of a group receives
alike; so a check there decides the same on every peer that took part in the round:

- a non-finite averaged gradient skips the step;
- so does one whose L2 norm is over ``guard.step_norm_factor`` times the median of the last
  ``guard.step_norm_window`` applied steps' (a poisoned round that got past the contribution checks, e.g.
  from a peer that reduced a part of the vector); that check starts once 4 steps are known, and from the
  first step on, one over 100x (10 x ``guard.step_norm_factor``) this peer's own gradient is skipped too;
- non-finite parameters after a step (an overflow inside the optimizer) are replaced by the copy of
  the last good step (``guard.keep_last_good_parameters``: one parameter-sized copy in host memory).
"""

from __future__ import annotations

import logging
import statistics
from collections import deque

import torch

from geotrain.config import GuardConfig

logger = logging.getLogger(__name__)

MIN_KNOWN_STEPS = 4


def all_finite(tensors) -> bool:
    """Whether every value of every tensor is finite (one wait for the device, not one per tensor)."""
    tensors = [t for t in tensors if t is not None and t.numel() > 0]
    if not tensors:
        return True
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


def total_norm(tensors) -> float:
    tensors = [t for t in tensors if t is not None and t.numel() > 0]
    if not tensors:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors])))


@torch.no_grad()
def reset_statistics(optimizer: torch.optim.Optimizer) -> None:
    """Start the optimizer's statistics afresh after an overflow spoilt them, *in place*: every tensor of its
    state zeroed (Adam's step count included: its next step is a first step), every key and tensor kept.

    Clearing the state instead broke two things. hivemind loads a downloaded state into the layout of the
    loader's own optimizer state, and a state without statistics does not fit one with them: the load is
    refused, quietly (seen in CI: a follower downloaded the final state from a finalizer that had just restored
    its parameters, 11 times in 60 s, and never took it). And the averaged optimizer statistics are the state's
    own tensors: new ones made by the next step would no longer be the ones averaged."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                value.zero_()
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                state[key] = type(value)(0)


OWN_NORM_FACTOR = 10  # x guard.step_norm_factor: the bound against this peer's own gradient, checked from step 1


class StepGuard:
    """``own_gradient_norm``: a callable giving the norm of this peer's own contribution to the round being
    applied (None when unknown); the average of honest mean gradients is never far above any of them, so
    an average over ``OWN_NORM_FACTOR x guard.step_norm_factor`` times it is skipped even before the median
    is known (a newcomer's first steps, a swarm's first steps)."""

    def __init__(self, config: GuardConfig, report, peer_id: str, own_gradient_norm=None):
        self.config = config
        self.report = report
        self.peer_id = peer_id
        self.own_gradient_norm = own_gradient_norm
        self.recent_norms: deque[float] = deque(maxlen=config.step_norm_window)
        self.last_good: list[torch.Tensor] | None = None
        self.extra_tensors: list[torch.Tensor] = []  # buffers (batch norm statistics), kept with the parameters
        self.last_good_extras: list[torch.Tensor] | None = None
        self.steps = 0

    def allows_step(self, gradients) -> bool:
        """Whether the step with these (averaged) gradients may be applied; a skipped step is reported."""
        self.steps += 1
        norm = total_norm(gradients)
        reason = detail = None
        if norm != norm or norm == float("inf"):
            reason, detail = "non-finite", "the averaged gradient has non-finite values"
        else:
            own = self.own_gradient_norm() if self.own_gradient_norm is not None else None
            bound = OWN_NORM_FACTOR * self.config.step_norm_factor
            if own is not None and own > 0 and norm > bound * own:
                reason, detail = "norm", (f"the averaged gradient's norm {norm:.4g} is {norm / own:.3g}x this peer's "
                                          f"own gradient's {own:.4g} (at most {bound:.0f}x)")
            elif len(self.recent_norms) >= MIN_KNOWN_STEPS:
                median = statistics.median(self.recent_norms)
                if median > 0 and norm > self.config.step_norm_factor * median:
                    reason, detail = "norm", (f"the averaged gradient's norm {norm:.4g} is {norm / median:.3g}x the "
                                              f"median {median:.4g} of the last {len(self.recent_norms)} steps")
        if reason is None:
            if norm > 0:  # hivemind initialises the optimizer with one all-zero step
                self.recent_norms.append(norm)
            return True
        logger.warning("skipped this step: %s; the peers of the round skip it alike", detail)
        self.report.count("step", reason)
        self.report.event("step_skipped", peer_id=self.peer_id, reason=reason, detail=detail)
        return False

    @torch.no_grad()
    def after_step(self, parameters, optimizer) -> None:
        """Keep a copy of good parameters; put it back over non-finite ones (and restart the optimizer's
        statistics, which the same overflow spoilt)."""
        if all_finite(parameters) and all_finite(self.extra_tensors):
            if self.config.keep_last_good_parameters:
                if self.last_good is None:
                    self.last_good = [torch.empty_like(p, device="cpu") for p in parameters]
                    self.last_good_extras = [torch.empty_like(t, device="cpu") for t in self.extra_tensors]
                for kept, tensor in zip(self.last_good + self.last_good_extras, list(parameters) + self.extra_tensors):
                    kept.copy_(tensor)
            return
        restored = self.restore(parameters, self.extra_tensors)
        if restored:
            reset_statistics(optimizer)
        logger.error("the step left non-finite parameters; %s", "restored those of the last good step" if restored
                     else "no good copy is kept (guard.keep_last_good_parameters is off)")
        self.report.count("parameters", "non-finite after step")
        self.report.event("parameters_restored" if restored else "parameters_non_finite", peer_id=self.peer_id)

    @torch.no_grad()
    def restore(self, parameters, extra_tensors=()) -> bool:
        """Put the last good step's parameters and buffers back; False when none is kept."""
        if self.last_good is None:
            return False
        for kept, parameter in zip(self.last_good, parameters):
            parameter.copy_(kept)
        for kept, tensor in zip(self.last_good_extras or [], extra_tensors):
            tensor.copy_(kept)
        return True
