"""The interface every training task implements; the trainer sees nothing else.

A task bundles a model architecture (its preset), a data pipeline and a loss::

    task = build_task(config.task)                        # geotrain.tasks.build_task
    model = task.build_model()                            # same weights on every peer for one task.seed
    batches = task.build_loader(batch_size=32, data_seed=peer_data_seed, workers=2, pin_memory=True)
    loss = task.loss(model, next(batches))                # scalar mean loss of the batch
    loss.backward()
    batches.close()                                       # stops the loader's worker processes

Batches are dicts of CPU tensors; :meth:`Task.loss` moves them to the model's device, so the trainer
never needs to know which keys a domain uses. ``build_loader`` reads, decodes and collates batches in
DataLoader worker processes; ``build_data`` does the same work in the calling process, for tests and
simple loops. Both come from the task's :meth:`Task.batch_stream`.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Iterator

import torch

from geotrain.tasks.data import Batch, BatchLoader, BatchStream

if TYPE_CHECKING:
    from geotrain.config import TaskConfig

__all__ = ["Batch", "Task", "check_part", "to_model_device"]


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

    def build_data(self, batch_size: int, data_seed: int) -> Iterator[Batch]:
        """Endless iterator of batches of exactly ``batch_size`` samples, made in the calling process.

        A real source cycles over its files, in an order shuffled by ``data_seed``; synthetic data is
        drawn from one fixed distribution, ``data_seed`` choosing only which samples this peer sees.
        A missing or malformed source raises :class:`~geotrain.tasks.data.DataSourceError` here or at
        the first batch.
        """
        _check_batch_size(batch_size)
        return iter(self.batch_stream(batch_size, data_seed))

    def build_loader(self, batch_size: int, data_seed: int, workers: int, pin_memory: bool,
                     part: tuple[int, int] = (0, 1)) -> BatchLoader:
        """Endless batches like :meth:`build_data`'s, read, decoded and collated by a torch DataLoader.

        ``workers`` worker processes (0: in the calling process) each make whole batches from their own
        share of the data (see ``geotrain/tasks/data.py``); ``pin_memory`` returns them in page-locked
        memory. ``part`` = (I, N) reads only the I-th of N disjoint parts of WebDataset shards
        (``task.data.part``). Call ``close()`` on the result to stop its workers.
        """
        _check_batch_size(batch_size)
        return BatchLoader(self.batch_stream(batch_size, data_seed, part), workers=workers, pin_memory=pin_memory,
                           data_seed=data_seed)

    @abc.abstractmethod
    def batch_stream(self, batch_size: int, data_seed: int, part: tuple[int, int] = (0, 1)) -> BatchStream:
        """The task's batches as a torch ``IterableDataset``; the source is checked (listed) now.

        Each DataLoader worker that iterates it makes whole batches of its own share of the data.
        """

    @abc.abstractmethod
    def loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """Scalar mean loss of ``model`` on ``batch``."""


def to_model_device(model: torch.nn.Module, batch: Batch) -> Batch:
    """The batch on the device of the model's parameters (a no-op when it is already there)."""
    device = next(model.parameters()).device
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


def _check_batch_size(batch_size: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")


def check_part(part: tuple[int, int], source: str) -> None:
    """``part`` (I, N) selects WebDataset shards; other sources have no parts to choose from."""
    index, count = part
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"part must be (I, N) with 0 <= I < N, got {part}")
    if count > 1 and source != "webdataset":
        raise ValueError(f"part {index}/{count}: only WebDataset shards are split into parts, not {source} data")
