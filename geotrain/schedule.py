"""The learning rate by the swarm's epoch: a linear warmup, then constant or a cosine or linear decay.

Keyed on the epoch (one per target batch of the whole swarm), never on a peer's own step count, so a
trainer that joins late, or rejoins after a preemption, uses the swarm's learning rate as soon as it has
the swarm's state. hivemind steps the scheduler with the epoch (``TrainingStateAverager._update_scheduler``),
also after a state download; the coordinator restores it with the epoch of its checkpoint.

    factor = learning_rate_factor(epoch, warmup_epochs=2, schedule="cosine", schedule_epochs=100,
                                  min_factor=0.1)   # 1.0 at epoch 2, 0.1 from epoch 100 on
"""

from __future__ import annotations

import math

from geotrain.config import GeotrainConfig


def learning_rate_factor(epoch: int, warmup_epochs: int, schedule: str, schedule_epochs: int | None,
                         min_factor: float) -> float:
    """Multiplier of the base learning rate for the steps of ``epoch`` (0-based)."""
    if epoch < warmup_epochs:
        return (epoch + 1) / (warmup_epochs + 1)  # never 0: the first epoch still learns a little
    if schedule == "constant" or schedule_epochs is None:
        return 1.0
    decay_epochs = max(1, schedule_epochs - warmup_epochs)
    progress = min(1.0, (epoch - warmup_epochs) / decay_epochs)
    if schedule == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - progress
    return min_factor + (1.0 - min_factor) * shape


def schedule_of(config: GeotrainConfig):
    """``epoch -> factor`` for ``torch.optim.lr_scheduler.LambdaLR``, from the config."""
    opt = config.optimizer
    min_factor = opt.min_learning_rate / opt.learning_rate

    def factor(epoch: int) -> float:
        return learning_rate_factor(epoch, opt.warmup_epochs, opt.lr_schedule, config.schedule_epochs(), min_factor)

    return factor


def learning_rate_at(config: GeotrainConfig, epoch: int) -> float:
    return config.optimizer.learning_rate * schedule_of(config)(epoch)
