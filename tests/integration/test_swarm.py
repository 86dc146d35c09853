"""A local swarm of three trainers, as `geotrain local` runs it, and what its users rely on."""

from __future__ import annotations

import math

import pytest
import torch

from geotrain.config import TaskConfig
from geotrain.tasks import build_task
from swarm_helpers import FAST_SWARM, run_local

EPOCHS = 3
PEERS = 3
LEARNING_RATE = 0.01
# Each epoch's swarm loss must be within this fraction of a single process's loss with the same global
# batch. The swarm differs in ways that are part of its design: fp16-compressed gradients, and epochs
# that end when the peers' *estimated* sample count reaches the target, so an epoch can hold more samples.
PARITY_TOLERANCE = 0.20


@pytest.fixture(scope="module")
def three_trainers(tmp_path_factory):
    directory = tmp_path_factory.mktemp("three-trainers")
    summary, result = run_local(directory, "--peers", str(PEERS), "--epochs", str(EPOCHS), "--lr",
                                str(LEARNING_RATE), *FAST_SWARM)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    return summary


def test_three_trainers_reach_the_epoch_with_identical_parameters(three_trainers):
    summary = three_trainers
    assert summary["epochs_completed"] == EPOCHS
    assert [peer["epoch"] for peer in summary["peers"]] == [EPOCHS] * PEERS
    hashes = {peer["params_sha256"] for peer in summary["peers"]}
    assert len(hashes) == 1 and None not in hashes, f"parameters differ between peers: {hashes}"
    assert summary["params_identical"] is True
    assert summary["samples_total"] >= EPOCHS * summary["target_batch_size"]
    assert summary["loss_last"] < 0.8 * summary["loss_first"], "the loss did not fall"


def test_summary_has_what_a_user_reads(three_trainers):
    summary = three_trainers
    assert summary["target_batch_size"] == 1024
    assert summary["swarm_samples_per_second"] > 0
    assert summary["granularity"] > 0
    assert len({peer["peer_id"] for peer in summary["peers"]}) == PEERS
    for peer in summary["peers"]:
        assert peer["samples"] > 0 and peer["compute_s"] > 0 and peer["comm_s"] > 0
        assert peer["exit_code"] == 0
    assert sum(peer["samples"] for peer in summary["peers"]) == summary["samples_total"]


def reference_losses(epochs: int, target_batch_size: int, batch_size: int, data_seeds: list[int]) -> list[float]:
    """One process that accumulates gradients to the same global batch, from the same seed and data."""
    torch.manual_seed(0)
    task = build_task(TaskConfig(name="cv", preset="tiny", seed=0))
    model = task.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    streams = [task.build_data(batch_size, seed) for seed in data_seeds]
    steps_per_epoch = target_batch_size // batch_size
    losses = []
    for _ in range(epochs):
        epoch_losses = []
        for step in range(steps_per_epoch):
            loss = task.loss(model, next(streams[step % len(streams)]))
            (loss / steps_per_epoch).backward()
            epoch_losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(sum(epoch_losses) / len(epoch_losses))
    return losses


def test_swarm_loss_matches_one_process_with_the_same_global_batch(three_trainers):
    summary = three_trainers
    expected = reference_losses(EPOCHS, summary["target_batch_size"], summary["batch_size_per_step"],
                                data_seeds=[index + 1 for index in range(PEERS)])  # geotrain local's seeds
    observed = summary["loss_per_epoch"]
    assert len(observed) == EPOCHS
    for epoch, (swarm_loss, single_loss) in enumerate(zip(observed, expected), start=1):
        assert not math.isnan(swarm_loss)
        assert abs(swarm_loss - single_loss) <= PARITY_TOLERANCE * single_loss, (
            f"epoch {epoch}: swarm loss {swarm_loss:.4f} vs one process {single_loss:.4f}")
    # the comparison can fail: without training, the last loss would be the first one
    assert expected[-1] < (1 - PARITY_TOLERANCE) * expected[0]
