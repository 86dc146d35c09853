"""hivemind.Optimizer as geotrain builds it: the one place where the config's optimizer knobs are mapped.

:func:`build_hivemind_optimizer` is used by trainers and by the coordinator (which holds the same state
without ever stepping). :class:`MeasuredOptimizer` reports how each gradient averaging round ended.
"""

from __future__ import annotations

import time
from functools import partial

import hivemind
import torch
from hivemind.compression import Float16Compression, NoCompression, Uniform8BitQuantization
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.state_averager import TrainingStateAverager
from timm.optim import Lamb

from geotrain.config import GeotrainConfig
from geotrain.schedule import schedule_of


OPTIMIZER_CLASSES = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "lamb": Lamb}


def with_gradient_clipping(optimizer_class: type, max_norm: float) -> type:
    """``optimizer_class`` whose step first clips the gradients it applies to a global L2 norm of ``max_norm``.

    hivemind runs the torch optimizer on the *averaged* gradients (in its state averager), so clipping
    inside the optimizer's step clips what the swarm agreed on, the same on every peer.
    """

    class Clipped(optimizer_class):
        def step(self, closure=None):
            gradients = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(gradients, max_norm)
            return super().step(closure)

    Clipped.__name__ = Clipped.__qualname__ = f"Clipped{optimizer_class.__name__}"
    return Clipped


def build_torch_optimizer_factory(config: GeotrainConfig):
    opt = config.optimizer
    optimizer_class = OPTIMIZER_CLASSES[opt.optimizer]
    if opt.grad_clip_norm is not None:
        optimizer_class = with_gradient_clipping(optimizer_class, opt.grad_clip_norm)
    options = {"lr": opt.learning_rate, "weight_decay": opt.weight_decay}
    if opt.optimizer == "sgd":
        options["momentum"] = 0.9
    return partial(optimizer_class, **options)


def build_scheduler_factory(config: GeotrainConfig):
    """LambdaLR by the swarm's epoch (hivemind steps it with the epoch; see geotrain.schedule); None: constant."""
    opt = config.optimizer
    if opt.lr_schedule == "constant" and opt.warmup_epochs == 0:
        return None
    return partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=schedule_of(config))


def build_compression(name: str):
    return {"none": NoCompression, "fp16": Float16Compression, "uniform8bit": Uniform8BitQuantization}[name]()


def averaging_round_result(control) -> str:
    """ok, timeout or failed: how one gradient averaging round (a hivemind StepControl) ended."""
    if not control.done():
        return "timeout"  # hivemind stopped waiting for it (averaging_timeout)
    if control.cancelled():
        return "failed"
    error = control.exception()
    if error is None:
        return "ok"
    return "timeout" if isinstance(error, TimeoutError) else "failed"


class RecordingStateAverager(TrainingStateAverager):
    """hivemind's state averager that remembers the epoch of the last state it downloaded.

    After a download hivemind may move the local epoch one ahead to the swarm's ("catching up"), so the
    optimizer's epoch alone cannot tell which state a peer really loaded.
    """

    loaded_epoch: int | None = None

    def load_state_from_peers(self, *args, **kwargs):
        epoch_before = self.local_epoch
        result = super().load_state_from_peers(*args, **kwargs)
        if self.local_epoch != epoch_before:
            self.loaded_epoch = self.local_epoch
        return result


class MeasuredOptimizer(hivemind.Optimizer):
    """hivemind.Optimizer that reports how each gradient averaging round ended and how long it took.

    The duration is how long this peer waited for the round once its own gradients were ready
    (matchmaking that was still going on, then all-reduce); with delayed updates that wait runs in
    the background, next to the next epoch's compute.
    """

    on_averaging_round = None  # callable(result, duration_s)

    def _make_state_averager(self, **kwargs) -> TrainingStateAverager:
        # the same construction as hivemind's, with the class that records the downloaded epoch
        averager = super()._make_state_averager(**kwargs)
        averager.__class__ = RecordingStateAverager
        return averager

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control):
        started = time.perf_counter()
        super()._average_gradients_and_load_into_optimizer(maybe_step_control)
        if maybe_step_control is not None and self.on_averaging_round is not None:
            self.on_averaging_round(averaging_round_result(maybe_step_control), time.perf_counter() - started)


def build_hivemind_optimizer(config: GeotrainConfig, dht, model: torch.nn.Module, on_averaging_round=None):
    """hivemind.Optimizer configured from the config tree (the one place its knobs are mapped)."""
    opt = config.optimizer
    delayed = opt.delayed_parameter_updates
    # hivemind forwards averager_opts to the state averager only; the gradient averager gets its own factory
    grad_averager_factory = partial(GradientAverager, request_timeout=opt.request_timeout_s)
    optimizer = MeasuredOptimizer(
        dht=dht,
        run_id=config.swarm.run_id,
        target_batch_size=opt.target_batch_size,
        batch_size_per_step=opt.batch_size_per_step,
        optimizer=build_torch_optimizer_factory(config),
        params=model.parameters(),
        scheduler=build_scheduler_factory(config),
        # an fp32 copy of the parameters and the optimizer state in host (shared) memory: the GPU holds only
        # the model and its gradients; needed for delayed updates, which step in the background
        offload_optimizer=opt.offload_optimizer,
        matchmaking_time=opt.matchmaking_time_s,
        averaging_timeout=opt.averaging_timeout_s,
        load_state_timeout=opt.load_state_timeout_s,
        # hivemind inverts a non-None client_mode into dht.client_mode; passing the same value keeps both equal
        client_mode=config.swarm.client_mode,
        delay_optimizer_step=delayed,
        delay_grad_averaging=delayed,
        use_local_updates=opt.use_local_updates,
        average_state_every=opt.average_state_every,
        grad_compression=build_compression(opt.grad_compression),
        grad_averager_factory=grad_averager_factory,
        averager_opts={"request_timeout": opt.request_timeout_s},
        # a peer must notice soon that the swarm reached the target batch, or it runs on alone; the
        # bound on the refresh period keeps that lag small next to an epoch
        tracker_opts={"default_refresh_period": opt.progress_refresh_s,
                      "min_refresh_period": min(0.5, opt.progress_refresh_s),
                      "max_refresh_period": max(2.0, 4 * opt.progress_refresh_s),
                      "metadata_expiration": opt.progress_expiration_s},
        state_averaging_compression=build_compression(opt.grad_compression),
        verbose=False,
    )
    optimizer.on_averaging_round = on_averaging_round
    return optimizer
