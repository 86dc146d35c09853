"""Emulated compute (task ``emulated``): a GPU's step time, slept, with real gradients of a model's size.

Two CPU cores cannot compute like eight GPUs, but a swarm's throughput depends on the compute only
through its time per step. This task stands in for a model of a planner profile: its "model" is a
set of parameter tensors with the profile's parameter count, and its loss first sleeps what the
profile's GPU needs for the batch (``batch_size / samples_per_second[GPU]``), then returns a cheap
quadratic loss whose backward gives every parameter a real, dense gradient. hivemind then averages
exactly as many bytes as it would for the real model; only the arithmetic is missing.

Presets (``--preset``):

- ``tiny``: 65,536 parameters at 5 ms per sample, for tests (slow enough that peers meet within an epoch);
- ``PROFILE[@GPU][/DIVISOR]``: the planner profile ``PROFILE`` (``geotrain plan``'s profiles, e.g.
  ``convnext_large``), on its GPU ``GPU`` (default: the first one the profile lists) with a model
  ``DIVISOR`` times smaller (default 1). ``geotrain bench`` divides the model together with the
  lab's bandwidth (and the target batch size) to keep the study's granularity on one machine.

    geotrain peer --task emulated --preset convnext_large@T4/80 --batch-size 32 ...

Batches are ``{"targets": float (B,)}``, noisy samples around 1.0; the loss is the mean squared
distance of the parameters to the batch's mean target, so the loss falls as the swarm trains. They cost
nothing to make, so :meth:`EmulatedTask.build_loader` makes them in the calling process whatever the number
of workers: a lab of many emulated peers on one machine starts no worker processes.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Iterator

import torch

from geotrain.errors import ConfigError
from geotrain.tasks import data
from geotrain.tasks.base import Batch, Task, check_part
from geotrain.tasks.presets import EmulatedPresets

MAX_TENSOR_ELEMENTS = 1 << 20  # a real model is many tensors; hivemind splits and streams them the same way
INITIAL_STD = 0.02
TARGET_MEAN = 1.0
TARGET_STD = 0.1  # small: the loss curve shows training, not the noise of batch means


@dataclass(frozen=True)
class EmulatedModelSpec:
    parameters: int
    seconds_per_sample: float
    description: str


TINY = EmulatedModelSpec(parameters=65_536, seconds_per_sample=0.005, description="tiny (65,536 parameters, 5 ms/sample)")


def resolve_preset(preset: str) -> EmulatedModelSpec:
    """``convnext_large@T4/80`` -> the parameter count and seconds per sample it emulates."""
    if preset == "tiny":
        return TINY
    match = EmulatedPresets.PATTERN.match(preset)
    if match is None:
        raise ConfigError(f"task.preset: {preset!r} is not an emulated preset; expected tiny or "
                          "PROFILE[@GPU][/DIVISOR], e.g. convnext_large@T4/80")
    from geotrain.pricing.errors import InputFileError
    from geotrain.planner.profiles import load_profile

    try:
        profile = load_profile(match["profile"])
    except InputFileError as error:
        raise ConfigError(f"task.preset {preset!r}: {error}") from None
    gpu = match["gpu"] or next(iter(profile.samples_per_second))
    if gpu not in profile.samples_per_second:
        raise ConfigError(f"task.preset {preset!r}: profile {profile.name!r} has no samples/s for {gpu!r}; "
                          f"expected one of {', '.join(profile.samples_per_second)}")
    divisor = int(match["divisor"] or 1)
    parameters = max(1, profile.parameters // divisor)
    rate = profile.samples_per_second[gpu]
    return EmulatedModelSpec(parameters=parameters, seconds_per_sample=1.0 / rate,
                             description=f"{profile.name} on {gpu} ({rate:g} samples/s), "
                                         f"{parameters:,} parameters (1/{divisor} of {profile.parameters:,})")


class EmulatedParameters(torch.nn.Module):
    """Nothing but parameters: ``parameters`` numbers in tensors of at most ``MAX_TENSOR_ELEMENTS``."""

    def __init__(self, parameters: int):
        super().__init__()
        sizes = [MAX_TENSOR_ELEMENTS] * (parameters // MAX_TENSOR_ELEMENTS)
        if parameters % MAX_TENSOR_ELEMENTS:
            sizes.append(parameters % MAX_TENSOR_ELEMENTS)
        self.tensors = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(size) * INITIAL_STD) for size in sizes)


class EmulatedTask(Task):
    name = "emulated"

    def __init__(self, config) -> None:
        super().__init__(config)
        self.spec = resolve_preset(config.preset)

    def describe(self) -> str:
        return f"emulated/{self.preset}: {self.spec.description}, slept compute"

    def _create_model(self) -> torch.nn.Module:
        return EmulatedParameters(self.spec.parameters)

    def batch_stream(self, batch_size: int, data_seed: int, part: tuple[int, int] = (0, 1)) -> data.BatchStream:
        check_part(part, self.config.data.source)
        return data.BatchStream(functools.partial(self._batches, batch_size, data_seed), "emulated targets")

    def build_loader(self, batch_size: int, data_seed: int, workers: int, pin_memory: bool,
                     part: tuple[int, int] = (0, 1)) -> data.BatchLoader:
        """Batches made in the calling process: ``workers`` and ``pin_memory`` are ignored (see above)."""
        return super().build_loader(batch_size, data_seed, workers=0, pin_memory=False, part=part)

    def _batches(self, batch_size: int, data_seed: int, worker: int, _workers: int) -> Iterator[Batch]:
        draws = torch.Generator().manual_seed(data.worker_seed(data_seed, "emulated", worker))
        while True:
            yield {"targets": TARGET_MEAN + TARGET_STD * torch.randn(batch_size, generator=draws)}

    def loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        targets = batch["targets"]
        time.sleep(len(targets) * self.spec.seconds_per_sample)  # the GPU's forward and backward
        target = targets.to(next(model.parameters()).device).mean()
        squared = sum(((tensor - target) ** 2).sum() for tensor in model.parameters())
        return squared / (2 * self.spec.parameters)
