"""The interface every training task implements; the trainer sees nothing else.

A task bundles a model architecture (its preset), a data pipeline and a loss::

    task = build_task(config.task)                        # geotrain.tasks.build_task
    model = task.build_model()                            # same weights on every peer for one task.seed
    batches = task.build_data(batch_size=32, data_seed=peer_data_seed)
    loss = task.loss(model, next(batches))                # scalar mean loss of the batch
    loss.backward()

Batches are dicts of CPU tensors; :meth:`Task.loss` moves them to the model's device, so the trainer
never needs to know which keys a domain uses.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Iterator

import torch

if TYPE_CHECKING:
    from geotrain.config import TaskConfig

Batch = dict[str, torch.Tensor]


class Task(abc.ABC):
    """One learning problem: a preset's model, its data and its loss."""

    name: str  # "cv" | "nlp" | "asr"

    def __init__(self, config: TaskConfig) -> None:
        self.config = config
        self.preset = config.preset

    def build_model(self) -> torch.nn.Module:
        """A freshly initialised model, identical in every process for the same ``task.seed``.

        Weights are drawn on the CPU whatever the default device is, because CUDA and CPU random
        streams differ and peers with and without GPUs must start from the same point. The global
        RNG state is left as it was, so building a model does not shift the trainer's other draws.
        """
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.manual_seed(self.config.seed)
            return self._create_model()

    def parameter_count(self) -> int:
        """Number of parameters of :meth:`build_model`'s model, without allocating any weights."""
        with torch.device("meta"):
            model = self._create_model()
        return sum(parameter.numel() for parameter in model.parameters())  # tied weights count once

    def describe(self) -> str:
        """One line for the operator's log, e.g. ``cv/resnet50: 25.6M parameters, synthetic data``."""
        source = self.config.data.source
        where = f" from {self.config.data.path}" if self.config.data.path else ""
        return f"{self.name}/{self.preset}: {self.parameter_count() / 1e6:.1f}M parameters, {source} data{where}"

    @abc.abstractmethod
    def _create_model(self) -> torch.nn.Module:
        """Build the preset's architecture on the current default device with the current RNG."""

    @abc.abstractmethod
    def build_data(self, batch_size: int, data_seed: int) -> Iterator[Batch]:
        """Endless iterator of batches of exactly ``batch_size`` samples.

        A real source cycles over its files, in an order shuffled by ``data_seed``; synthetic data is
        drawn from one fixed distribution, ``data_seed`` choosing only which samples this peer sees.
        """

    @abc.abstractmethod
    def loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """Scalar mean loss of ``model`` on ``batch``."""


def to_model_device(model: torch.nn.Module, batch: Batch) -> Batch:
    """The batch on the device of the model's parameters (a no-op when it is already there)."""
    device = next(model.parameters()).device
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}
