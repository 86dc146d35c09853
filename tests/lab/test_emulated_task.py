"""The emulated task: a planner profile's model size and GPU time, real gradients (no root needed)."""

from __future__ import annotations

import time

import pytest
import torch

from geotrain.config import ConfigError, TaskConfig
from geotrain.tasks import build_task


def _task(preset: str, seed: int = 0):
    return build_task(TaskConfig(name="emulated", preset=preset, seed=seed))


def test_a_profile_preset_has_the_profiles_size_and_gpu_time():
    assert _task("convnext_large").parameter_count() == 197_800_000  # [EMJ24] ConvNextLarge
    assert _task("convnext_large/80").parameter_count() == 197_800_000 // 80
    assert _task("roberta_xlm@T4/1000").parameter_count() == 560_100
    assert _task("convnext_large/80").spec.seconds_per_sample == pytest.approx(1 / 80)  # T4: 80 samples/s
    assert _task("convnext_large@A10/80").spec.seconds_per_sample == pytest.approx(1 / 185)


def test_a_step_takes_the_gpu_time_and_gives_every_parameter_a_gradient():
    task = _task("convnext_large/400")
    model = task.build_model()
    batch = next(task.build_data(batch_size=16, data_seed=1))
    started = time.perf_counter()
    loss = task.loss(model, batch)
    loss.backward()
    assert time.perf_counter() - started >= 16 / 80
    assert all(p.grad is not None and bool((p.grad != 0).all()) for p in model.parameters())


def test_same_seed_same_weights_and_the_loss_falls():
    assert torch.equal(torch.cat(list(_task("tiny", 3).build_model().parameters())),
                       torch.cat(list(_task("tiny", 3).build_model().parameters())))
    task = _task("tiny")
    model = task.build_model()
    batches = task.build_data(batch_size=8, data_seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    losses = []
    for _ in range(5):
        loss = task.loss(model, next(batches))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("preset, message", [
    ("nosuchmodel/10", r"task.preset 'nosuchmodel/10': no profile named 'nosuchmodel'"),
    ("convnext_large@H100", r"profile 'convnext_large' has no samples/s for 'H100'; expected one of T4, A10"),
])
def test_bad_presets_are_explained(preset, message):
    with pytest.raises(ConfigError, match=message):
        _task(preset)
