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
    """Parameters, buffers, optimizer statistics and the epoch, as plain tensors on the CPU."""
    return {
        "epoch": optimizer.local_epoch,
        "model": {name: tensor.detach().cpu().clone() for name, tensor in model.state_dict().items()},
        "optimizer": optimizer.state_averager.optimizer.state_dict(),
    }


def restore_state(optimizer, model: torch.nn.Module, state: dict) -> None:
    model.load_state_dict(state["model"])
    with torch.no_grad():
        for model_param, optimizer_param in zip(model.parameters(), optimizer_parameters(optimizer)):
            if optimizer_param is not model_param:
                optimizer_param.copy_(model_param)
    optimizer.state_averager.optimizer.load_state_dict(state["optimizer"])
    optimizer.state_averager.local_epoch = state["epoch"]
