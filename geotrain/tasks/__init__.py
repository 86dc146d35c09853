"""Training tasks: what model a run trains, on which data, with which loss.

The trainer builds one from the ``task`` section of the config and uses only the :class:`Task`
interface (see ``geotrain/tasks/base.py``)::

    from geotrain.tasks import build_task
    task = build_task(config.task)       # e.g. name=cv, preset=resnet50, data.source=webdataset

Domains and their presets (:data:`PRESET_NAMES`):

- ``cv``: image classification with timm models (``vision.py``).
- ``nlp``: masked language modelling with RoBERTa models from transformers (``language.py``).
- ``asr``: speech recognition, a Whisper-sized encoder with a CTC head on log-Mel features (``speech.py``).
- ``emulated``: a GPU's compute emulated by sleeping, with real gradients of a model's size (``emulated.py``).

Each domain module is imported only when its task is built, so a CV peer never loads transformers or
torchaudio, and importing this package loads not even torch (the config reads :data:`PRESET_NAMES`).
Data sources (``synthetic``, ``folder``, ``webdataset``) are described in ``data.py``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from geotrain.tasks.presets import EMJ24_PARAMETER_COUNTS, PRESET_NAMES

if TYPE_CHECKING:
    from geotrain.config import TaskConfig
    from geotrain.tasks.base import Batch, Task

__all__ = ["Batch", "Task", "build_task", "PRESET_NAMES", "EMJ24_PARAMETER_COUNTS"]

# task name -> (module, class), imported on demand
_TASK_CLASSES: dict[str, tuple[str, str]] = {
    "cv": ("geotrain.tasks.vision", "VisionTask"),
    "nlp": ("geotrain.tasks.language", "LanguageTask"),
    "asr": ("geotrain.tasks.speech", "SpeechTask"),
    "emulated": ("geotrain.tasks.emulated", "EmulatedTask"),
}


def __getattr__(name: str):
    if name in ("Task", "Batch"):  # these need torch: load it only when asked
        from geotrain.tasks import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_task(task_config: TaskConfig) -> Task:
    """The task that ``task_config`` (the config's ``task`` section) describes."""
    if task_config.name not in _TASK_CLASSES:
        raise ValueError(f"task.name: unknown task {task_config.name!r}; expected one of {', '.join(_TASK_CLASSES)}")
    known = PRESET_NAMES[task_config.name]
    if task_config.preset not in known:
        raise ValueError(f"task.preset: unknown preset {task_config.preset!r} for task {task_config.name!r}; "
                         f"expected one of {', '.join(known)}")
    module_name, class_name = _TASK_CLASSES[task_config.name]
    task_class = getattr(importlib.import_module(module_name), class_name)
    return task_class(task_config)
