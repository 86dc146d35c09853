"""Where and how a trainer computes: its device, its precision, and the memory it took.

    compute = resolve_compute(config.training)      # UserError (exit 2) for a device this machine lacks
    model.to(compute.device)
    with compute.autocast():
        loss = task.loss(model, batch)
    compute.scaled(loss).backward()                  # fp16: a loss scale, so small gradients do not vanish
    if compute.unscale_gradients(model):             # False: an overflow, skip this micro-batch
        optimizer.step()

Precision, as [EMJ24] trained and as the GPUs people rent can do it:

- ``fp32``: no autocast. The default on a CPU.
- ``bf16``: autocast to bfloat16, no loss scale (bf16 has fp32's range). The default on GPUs that have fast
  bf16 (Ampere and newer: A10, L4, A100, H100); also what a CPU can do faster than fp32.
- ``fp16``: autocast to float16 and a dynamic loss scale. The default on GPUs without bf16 (T4, V100, the
  study's VMs). The scale is applied and removed per micro-batch, before hivemind adds the gradients to its
  accumulators (``reuse_grad_buffers`` stays off, so hivemind's own GradScaler does not apply). A micro-batch
  whose gradients overflow is skipped by this peer alone: it adds nothing to the swarm's accumulators, so
  no peer ever steps with an infinite gradient, and the swarm's average is the same on every peer.

Parameters stay fp32 (autocast only lowers the precision of the operations), and so do the gradients that
hivemind averages and the optimizer state it keeps.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from geotrain.config import TrainingConfig
from geotrain.errors import UserError

# Dynamic loss scale for fp16, as mixed-precision training commonly sets it: start high, halve on an
# overflow, double after a run of finite steps.
INITIAL_LOSS_SCALE = 2.0 ** 16
LOSS_SCALE_GROWTH_INTERVAL = 2000
MIN_LOSS_SCALE = 1.0


def cuda_device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(name: str) -> torch.device:
    """``auto``: the first CUDA GPU when there is one, else the CPU; a GPU this machine lacks is a UserError."""
    count = cuda_device_count()
    if name == "auto":
        return torch.device("cuda:0" if count else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    index = int(name.partition(":")[2] or 0)
    if count == 0:
        raise UserError(f"--device {name}: this machine has no CUDA GPU that torch can use (torch "
                        f"{torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); use --device cpu, or check "
                        "the NVIDIA driver (nvidia-smi)")
    if index >= count:
        raise UserError(f"--device {name}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}")
    return torch.device(f"cuda:{index}")


def has_fast_bf16(device: torch.device) -> bool:
    """Ampere (compute capability 8.0) and newer compute in bfloat16 natively; T4 and V100 only emulate it."""
    return torch.cuda.get_device_capability(device) >= (8, 0)


def default_precision(device: torch.device) -> str:
    if device.type != "cuda":
        return "fp32"
    return "bf16" if has_fast_bf16(device) else "fp16"


def resolve_precision(name: str, device: torch.device) -> str:
    if name == "auto":
        return default_precision(device)
    if name == "fp16" and device.type != "cuda":
        raise UserError("--precision fp16: only on a CUDA GPU (CPUs have no fast float16); use bf16 or fp32")
    if name == "bf16" and device.type == "cuda" and not has_fast_bf16(device):
        raise UserError(f"--precision bf16: {torch.cuda.get_device_name(device)} has no fast bfloat16; use fp16 "
                        "(with a loss scale) or fp32")
    return name


@dataclass
class LossScale:
    """A dynamic loss scale (fp16 only): halved on an overflow, doubled after a run of finite micro-batches."""

    value: float = INITIAL_LOSS_SCALE
    growth_interval: int = LOSS_SCALE_GROWTH_INTERVAL
    finite_in_a_row: int = 0
    overflows: int = 0

    def update(self, finite: bool) -> None:
        if finite:
            self.finite_in_a_row += 1
            if self.finite_in_a_row >= self.growth_interval:
                self.value *= 2.0
                self.finite_in_a_row = 0
        else:
            self.overflows += 1
            self.finite_in_a_row = 0
            self.value = max(MIN_LOSS_SCALE, self.value / 2.0)


@dataclass
class Compute:
    device: torch.device
    precision: str  # fp32 | bf16 | fp16
    loss_scale: LossScale | None = field(default=None)

    def __post_init__(self) -> None:
        if self.precision == "fp16" and self.loss_scale is None:
            self.loss_scale = LossScale()

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)

    @property
    def pin_memory(self) -> bool:
        """Page-locked batches copy to a GPU without blocking the training loop."""
        return self.device.type == "cuda"

    def describe(self) -> str:
        where = str(self.device)
        if self.device.type == "cuda":
            where += f" ({torch.cuda.get_device_name(self.device)})"
        return f"{where}, {self.precision}"

    def autocast(self):
        """The forward pass's context: autocast to the precision's dtype, or nothing for fp32."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on (multiplied by the loss scale in fp16)."""
        return loss if self.loss_scale is None else loss * self.loss_scale.value

    def unscale_gradients(self, model: torch.nn.Module) -> bool:
        """Undo the loss scale on the model's gradients (fp16); False (gradients cleared) when any is not finite.

        In every precision: a peer never hands the swarm non-finite gradients (an fp16 overflow, a failing
        GPU); the micro-batch is dropped by this peer alone.
        """
        gradients = [p.grad for p in model.parameters() if p.grad is not None]
        # one wait for the GPU per micro-batch, not one per tensor
        finite = bool(torch.stack([torch.isfinite(g).all() for g in gradients]).all()) if gradients else True
        if not finite:
            model.zero_grad(set_to_none=True)
        elif self.loss_scale is not None:
            torch._foreach_mul_(gradients, 1.0 / self.loss_scale.value)
        if self.loss_scale is not None:
            self.loss_scale.update(finite)
        return finite

    # --- memory -------------------------------------------------------------------------------
    def start_memory_window(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_memory_bytes(self) -> int | None:
        """Peak memory the tensors took on the GPU since :meth:`start_memory_window`; None on the CPU."""
        if self.device.type != "cuda":
            return None
        return int(torch.cuda.max_memory_allocated(self.device))


def resolve_compute(training: TrainingConfig) -> Compute:
    device = resolve_device(training.device)
    return Compute(device, resolve_precision(training.precision, device))
