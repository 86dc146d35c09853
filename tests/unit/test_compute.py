"""Device and precision choices, the fp16 loss scale, and the learning-rate schedule (CPU only)."""

from __future__ import annotations

import math

import pytest
import torch

from geotrain.compute import Compute, LossScale, resolve_compute, resolve_device, resolve_precision
from geotrain.config import TrainingConfig, validate_config
from geotrain.errors import UserError
from geotrain.schedule import learning_rate_at, learning_rate_factor

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")


@no_cuda
def test_auto_picks_the_cpu_and_fp32_without_cuda():
    compute = resolve_compute(TrainingConfig())
    assert compute.device == torch.device("cpu") and compute.precision == "fp32"
    assert not compute.pin_memory and compute.peak_memory_bytes() is None


@no_cuda
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_a_gpu_this_machine_lacks_is_a_clear_error(device):
    with pytest.raises(UserError, match=rf"--device {device}: this machine has no CUDA GPU"):
        resolve_device(device)


def test_fp16_needs_a_gpu_and_bf16_runs_on_the_cpu():
    with pytest.raises(UserError, match="--precision fp16: only on a CUDA GPU"):
        resolve_precision("fp16", torch.device("cpu"))
    assert resolve_precision("bf16", torch.device("cpu")) == "bf16"


def test_device_names_are_checked_by_the_config():
    with pytest.raises(ValueError, match="training.device"):
        validate_config({"training": {"device": "gpu0"}})


def test_bf16_autocast_lowers_the_operations_not_the_parameters():
    compute = Compute(torch.device("cpu"), "bf16")
    layer = torch.nn.Linear(8, 4)
    with compute.autocast():
        output = layer(torch.randn(2, 8))
    assert output.dtype == torch.bfloat16 and layer.weight.dtype == torch.float32


def test_the_fp16_loss_scale_undoes_itself_and_skips_overflows():
    compute = Compute(torch.device("cpu"), "fp16")  # the scale's arithmetic does not need a GPU
    model = torch.nn.Linear(4, 1)
    inputs = torch.randn(3, 4)
    model(inputs).sum().backward()
    expected = model.weight.grad.clone()
    model.zero_grad()
    compute.scaled(model(inputs).sum()).backward()
    assert compute.unscale_gradients(model)
    assert torch.allclose(model.weight.grad, expected, rtol=1e-5)

    scale_before = compute.loss_scale.value
    model.weight.grad.fill_(math.inf)
    assert not compute.unscale_gradients(model)
    assert model.weight.grad is None, "an overflowed micro-batch must add nothing"
    assert compute.loss_scale.value == scale_before / 2 and compute.loss_scale.overflows == 1


def test_the_loss_scale_grows_after_a_run_of_finite_steps():
    scale = LossScale(value=8.0, growth_interval=3)
    for _ in range(3):
        scale.update(finite=True)
    assert scale.value == 16.0


def test_warmup_then_cosine_decay_by_epoch():
    factors = [learning_rate_factor(epoch, 2, "cosine", 10, 0.1) for epoch in range(12)]
    assert factors[:3] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert all(a > b for a, b in zip(factors[2:10], factors[3:11]))
    assert factors[10] == factors[11] == pytest.approx(0.1)


def test_linear_decay_and_constant():
    assert [learning_rate_factor(e, 0, "linear", 4, 0.0) for e in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert learning_rate_factor(50, 0, "constant", None, 0.0) == 1.0


def test_a_decay_needs_its_horizon():
    with pytest.raises(ValueError, match="optimizer.schedule_epochs"):
        validate_config({"optimizer": {"lr_schedule": "cosine"}})
    config = validate_config({"optimizer": {"lr_schedule": "cosine", "learning_rate": 0.1},
                              "training": {"max_epochs": 10}})
    assert learning_rate_at(config, 10) == pytest.approx(0.0)


def test_delayed_updates_need_the_offloaded_optimizer():
    with pytest.raises(ValueError, match="needs optimizer.offload_optimizer"):
        validate_config({"optimizer": {"network_profile": "intercontinental", "offload_optimizer": False}})
