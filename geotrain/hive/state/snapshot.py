"""The swarm's training state as one dict (what the coordinator checkpoints and restores), and its hash.

hivemind keeps the optimizer's copy of the parameters apart from the model's (``offload_optimizer``),
and serves newcomers from the optimizer's copy; a restore must set both, and the epoch.
"""

from __future__ import annotations

import hashlib

import torch


def parameters_sha256(model: torch.nn.Module) -> str:
    """Hash of every parameter's bytes in a fixed order: equal across peers iff their weights are equal."""
    digest = hashlib.sha256()
    for name, parameter in model.named_parameters():
        digest.update(name.encode())
        digest.update(parameter.detach().to("cpu").contiguous().numpy().tobytes())
    return digest.hexdigest()


def optimizer_parameters(optimizer) -> list[torch.Tensor]:
    return [param for group in optimizer.state_averager.optimizer.param_groups for param in group["params"]]


def capture_state(optimizer, model: torch.nn.Module) -> dict:
    """Parameters, buffers, optimizer statistics (with the learning rate) and the epoch, on the CPU.

    A state captured on a GPU restores on a machine without one (the coordinator) and the reverse.
    """
    state = {
        "epoch": optimizer.local_epoch,
        "model": {name: tensor.detach().cpu().clone() for name, tensor in model.state_dict().items()},
        "optimizer": _to_cpu(optimizer.state_averager.optimizer.state_dict()),
    }
    averager = optimizer.state_averager
    if hasattr(averager, "outer_state_dict"):  # DiLoCo: the model holds the outer parameters after a round
        state["outer_optimizer"] = _to_cpu(averager.outer_state_dict())
    return state


def restore_state(optimizer, model: torch.nn.Module, state: dict) -> None:
    model.load_state_dict(state["model"])
    with torch.no_grad():
        for model_param, optimizer_param in zip(model.parameters(), optimizer_parameters(optimizer)):
            if optimizer_param is not model_param:
                optimizer_param.copy_(model_param)
    optimizer.state_averager.optimizer.load_state_dict(state["optimizer"])
    averager = optimizer.state_averager
    if hasattr(averager, "load_outer_state_dict"):
        if "outer_optimizer" not in state:
            raise ValueError("the checkpoint holds no DiLoCo outer optimizer state (was it written in "
                             "optimizer.mode sync?)")
        averager.load_outer_state_dict(state["outer_optimizer"])
    optimizer.state_averager.local_epoch = state["epoch"]
    # the learning rate is the schedule's at this epoch, as hivemind sets it after a state download
    optimizer.state_averager._update_scheduler()


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(item) for item in value)
    return value


def current_learning_rate(optimizer) -> float:
    return float(optimizer.state_averager.optimizer.param_groups[0]["lr"])
