"""hivemind.Optimizer as geotrain builds it from the config: the one place where the config's optimizer knobs
are mapped (:func:`build_hivemind_optimizer`, used by trainers and by the coordinator, which holds the same state
without ever stepping), and the torch optimizer, schedule and compression it steps and sends with.

Which classes a peer runs (each a class statement in the module named, its bases in sight):

=====================  ===========================================  ==========================================
mode                   optimizer                                    state averager / gradient averager
=====================  ===========================================  ==========================================
sync                   :class:`~.optimizer.MeasuredOptimizer`       :class:`~.averagers.GuardedStateAverager` /
                                                                    :class:`~.averagers.GuardedGradientAverager`
sync, powersgd         :class:`~.optimizer.MeasuredOptimizer`       ... / :class:`~.averagers.GuardedPowerSGDAverager`
diloco                 :class:`~.diloco.DiLoCoOptimizer`            :class:`~.averagers.GuardedDiLoCoStateAverager`
=====================  ===========================================  ==========================================

(``checked=False``, for tests' hostile peers: the same classes without ``Guarded``.)
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch
from hivemind.compression import Float16Compression, NoCompression, Uniform8BitQuantization

from geotrain.config import GeotrainConfig
from geotrain.hive.averaging.local_gradients import LocalGradientsKeepingAverager
from geotrain.hive.averaging.powersgd import PowerSGDKeepingAverager
from geotrain.hive.dht.admission import Admission, load_allowed_peer_ids, load_swarm_token
from geotrain.hive.guard.contributions import GuardSettings
from geotrain.hive.guard.report import GuardReport
from geotrain.hive.guard.step import StepGuard
from geotrain.hive.hivemind_contract import install_patches
from geotrain.hive.optim.averagers import (GuardedDiLoCoStateAverager, GuardedGradientAverager,
                                           GuardedPowerSGDAverager, GuardedStateAverager)
from geotrain.hive.optim.diloco import DiLoCoOptimizer, DiLoCoStateAverager
from geotrain.hive.optim.optimizer import MeasuredOptimizer, RecordingStateAverager
from geotrain.schedule import schedule_of


def optimizer_class_of(name: str) -> type:
    """The torch optimizer class the config's ``optimizer.optimizer`` names.

    timm's LAMB is imported only when asked: importing timm loads torchvision and torch's compiler, about
    2 s of every peer's start on these machines, which an NLP, ASR or emulated peer would spend for nothing.
    """
    if name == "lamb":
        from timm.optim import Lamb

        return Lamb
    return {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]


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


def with_step_guard(optimizer_class: type, guard: StepGuard) -> type:
    """``optimizer_class`` whose step is checked by ``guard`` (:mod:`geotrain.hive.guard.step`): a step with a
    non-finite or outlying averaged gradient is skipped, and non-finite parameters after a step are restored."""

    class Guarded(optimizer_class):
        @torch.no_grad()
        def step(self, closure=None):
            parameters = [p for group in self.param_groups for p in group["params"]]
            if not guard.allows_step([p.grad for p in parameters if p.grad is not None]):
                return None
            result = super().step(closure)
            guard.after_step(parameters, self)
            return result

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{optimizer_class.__name__}"
    return Guarded


def build_torch_optimizer_factory(config: GeotrainConfig, step_guard: StepGuard | None = None):
    opt = config.optimizer
    optimizer_class = optimizer_class_of(opt.optimizer)
    if opt.grad_clip_norm is not None:
        optimizer_class = with_gradient_clipping(optimizer_class, opt.grad_clip_norm)
    if step_guard is not None:  # outermost: it sees the averaged gradients before clipping hides their norm
        optimizer_class = with_step_guard(optimizer_class, step_guard)
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


BYTES_PER_VALUE = {"none": 4, "fp16": 2, "uniform8bit": 1}  # as sent, per compression (8-bit: plus a small table)


def build_compression(name: str):
    """How each averaged part goes on the wire; powersgd sends its factors (and the tensors it leaves
    uncompressed) in fp16, and state averaging (same compression) is fp16 too (geotrain.hive.averaging.powersgd)."""
    return {"none": NoCompression, "fp16": Float16Compression, "uniform8bit": Uniform8BitQuantization,
            "powersgd": Float16Compression}[name]()


def guard_settings(config: GeotrainConfig, admission: Admission, report: GuardReport) -> GuardSettings:
    """The guard's settings of every averager of a peer of this config (a DiLoCo state averager's weight bound
    is its own: :func:`build_hivemind_optimizer`)."""
    opt = config.optimizer
    return GuardSettings(
        admission=admission, report=report, config=config.guard,
        max_weight=float(config.guard.max_claimed_batches * opt.target_batch_size + opt.batch_size_per_step),
        region=config.metrics.region, run_id=config.swarm.run_id,
        min_rate_bytes_s=opt.state_download_min_mbit_s * 1e6 / 8, stall_s=opt.state_download_stall_s,
        # a DiLoCo state one round old is a different model (sync mode: hivemind's catch-up covers one; asking
        # only donors of the newest epoch first sent rejoins in the churn soak across oceans rather than to the
        # coordinator next to them, one epoch behind: 39 s instead of 0.2 s)
        epoch_tolerance=0 if opt.mode == "diloco" else 1,
        # DiLoCo's checks of a downloaded state (the majority, the round's outer step) judge one donor's
        max_stripes=1 if opt.mode == "diloco" else opt.state_download_max_donors,
        stripe_min_bytes=opt.state_download_stripe_min_mb * 1e6)


def build_hivemind_optimizer(config: GeotrainConfig, dht, model: torch.nn.Module, on_averaging_round=None,
                             grad_averager_class: type | None = None, guard_report: GuardReport | None = None,
                             checked: bool = True):
    """hivemind.Optimizer configured from the config tree (the one place its knobs are mapped).

    Both averagers check their callers and what they receive (:mod:`geotrain.hive.guard.contributions`), the torch
    optimizer checks each step (:mod:`geotrain.hive.guard.step`); refusals go to ``guard_report``.
    ``grad_averager_class``: a GradientAverager subclass used as given, without the checks, and ``checked``
    False: no checks at all (tests' hostile peers).
    """
    opt = config.optimizer
    install_patches()  # before hivemind's averagers fork: they fork with them
    report = guard_report if guard_report is not None else GuardReport(None)
    admission = Admission(config.swarm.run_id, load_swarm_token(config.swarm), load_allowed_peer_ids(config.swarm))
    guard = guard_settings(config, admission, report) if checked else None
    grad_averager_options = {}
    if grad_averager_class is None:
        grad_averager_class = GuardedGradientAverager if checked else LocalGradientsKeepingAverager
        if opt.grad_compression == "powersgd":  # (not with local updates or DiLoCo: OptimizerConfig._check_powersgd)
            grad_averager_class = GuardedPowerSGDAverager if checked else PowerSGDKeepingAverager
            grad_averager_options["averager_rank"] = opt.powersgd_rank
        if guard is not None:
            grad_averager_options["guard"] = guard
    diloco = opt.mode == "diloco"
    # what the state averager gets besides hivemind's arguments (averager_opts: hivemind passes them on)
    averager_options = {"request_timeout": opt.request_timeout_s, "target_group_size": opt.group_size}
    if diloco:
        state_averager_class = GuardedDiLoCoStateAverager if checked else DiLoCoStateAverager
        averager_options.update(min_inner_steps_for_norm_check=max(1.0, opt.diloco.inner_steps / 4),
                                overlap_rounds=opt.diloco.overlap_rounds)
        if guard is not None:  # every member of a DiLoCo round sends its pseudo-gradient at hivemind's weight of 1
            averager_options["guard"] = replace(guard, max_weight=1.0)
        optimizer_class = DiLoCoOptimizer
        optimizer_options = {
            "samples_per_trainer_round": opt.diloco.inner_steps * opt.batch_size_per_step,
            "guard_ban_s": config.guard.ban_s,
            "pseudo_gradient_bytes": sum(p.numel() for p in model.parameters()) * BYTES_PER_VALUE[opt.grad_compression]}
    else:
        state_averager_class = GuardedStateAverager if checked else RecordingStateAverager
        if guard is not None:
            averager_options["guard"] = guard
        optimizer_class = MeasuredOptimizer
        optimizer_options = {"missed_round_check_s": max(1.0, opt.progress_refresh_s)}
    # DiLoCo's inner steps apply this peer's own gradients (checked by the trainer); its check is on the
    # averaged pseudo-gradient (geotrain.hive.optim.diloco)
    step_guard = StepGuard(config.guard, report, peer_id=str(dht.peer_id)) if checked and not diloco else None
    delayed = opt.delayed_parameter_updates
    local_updates = opt.use_local_updates or diloco
    # (local updates with delayed updates is refused by the config: OptimizerConfig._check_offload)
    # hivemind forwards averager_opts to the state averager only; the gradient averager gets its own factory.
    # With local updates there is no gradient averager, and hivemind refuses a factory for one.
    grad_averager_factory = None if local_updates else partial(grad_averager_class,
                                                               request_timeout=opt.request_timeout_s,
                                                               target_group_size=opt.group_size,
                                                               **grad_averager_options)
    optimizer = optimizer_class(
        state_averager_class=state_averager_class,
        **optimizer_options,
        dht=dht,
        run_id=config.swarm.run_id,
        target_batch_size=opt.target_batch_size,
        batch_size_per_step=opt.batch_size_per_step,
        optimizer=build_torch_optimizer_factory(config, step_guard),
        params=model.parameters(),
        scheduler=build_scheduler_factory(config),
        # an fp32 copy of the parameters and the optimizer state in host (shared) memory: the GPU holds only
        # the model and its gradients; needed for delayed updates, which step in the background
        # ... but not with local updates: hivemind's offloaded optimizer steps on gradients that only gradient
        # averaging puts there, so each local step would apply none (hivemind's own default is off there too)
        offload_optimizer=opt.offload_optimizer and not local_updates,
        matchmaking_time=opt.round_matchmaking_time_s,
        averaging_timeout=opt.averaging_timeout_s,
        load_state_timeout=opt.load_state_timeout_s,
        # hivemind inverts a non-None client_mode into dht.client_mode; passing the same value keeps both equal
        client_mode=config.swarm.client_mode,
        delay_optimizer_step=delayed,
        delay_grad_averaging=delayed,
        use_local_updates=local_updates,
        # DiLoCo: the outer round runs in the background with overlap_rounds, else it blocks; sync mode with
        # local updates keeps hivemind's background averaging
        delay_state_averaging=not diloco or opt.diloco.overlap_rounds,
        average_state_every=1 if diloco else opt.average_state_every,
        grad_compression=build_compression(opt.grad_compression),
        grad_averager_factory=grad_averager_factory,
        # a known group size ends matchmaking once the group is full (hivemind waits matchmaking_time otherwise)
        averager_opts=averager_options,
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
    averager = getattr(optimizer, "grad_averager", None)
    if step_guard is not None and isinstance(averager, LocalGradientsKeepingAverager):
        step_guard.own_gradient_norm = averager.kept_gradients_norm
    if diloco:
        optimizer.state_averager.init_outer(opt.diloco.outer_learning_rate, opt.diloco.outer_momentum,
                                            opt.diloco.nesterov)
    if step_guard is not None:
        optimizer.state_averager.step_guard = step_guard
        step_guard.extra_tensors = list(optimizer.state_averager.extra_tensors)  # buffers: kept with the parameters
    return optimizer
