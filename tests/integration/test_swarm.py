"""A local swarm of three trainers, as `geotrain local` runs it, and what its users rely on; and a trainer
whose gradient averaging round fails because another one died."""

from __future__ import annotations

import math
import os
import signal
from pathlib import Path

import pytest
import torch
from hivemind.optim.state_averager import initialize_optimizer_state_

from geotrain.config import TaskConfig
from geotrain.events import read_events
from geotrain.tasks import build_task
from swarm_helpers import FAST_SWARM, agreement_report, last_epoch, run_local, wait_for

EPOCHS = 3
PEERS = 3
LEARNING_RATE = 0.01
# Each epoch's swarm loss must be within this fraction of a single process's loss with the same global
# batch. The swarm differs in ways that are part of its design: fp16-compressed gradients, and epochs
# that end when the peers' *estimated* sample count reaches the target, so an epoch can hold more samples.
# (On a busy machine that alone moves the third epoch's loss by up to ~0.1: epochs of 1024 samples from
# the reference's seeds end at 1.44, epochs of 1472 at 1.53; other seeds give 1.43 to 1.54.)
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
    assert summary["params_identical"] is True, agreement_report(summary)
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
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # next to other tests on 2 shared cores, more threads only spin (minutes, not seconds)
    try:
        return _reference_losses(epochs, target_batch_size, batch_size, data_seeds)
    finally:
        torch.set_num_threads(threads)


def _reference_losses(epochs: int, target_batch_size: int, batch_size: int, data_seeds: list[int]) -> list[float]:
    torch.manual_seed(0)
    task = build_task(TaskConfig(name="cv", preset="tiny", seed=0))
    model = task.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    # the optimizer as hivemind.Optimizer builds it: hivemind creates its statistics with one step on zero
    # gradients, so AdamW's step count starts at 1 and its first steps are a quarter shorter than a fresh
    # AdamW's (third epoch 1.44 instead of 1.37)
    initialize_optimizer_state_(optimizer)
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


def what_the_peers_saw(summary: dict) -> str:
    """Each peer's samples and loss per epoch, and its warnings (failed rounds and the like), from the run dir."""
    run_dir = Path(summary["run_dir"])
    lines = [f"run dir {run_dir}"]
    for peer in summary["peers"]:
        epochs = [e for e in read_events(run_dir / f"{peer['name']}.jsonl") if e["event"] == "epoch"]
        lines.append(f"{peer['name']}: " + ", ".join(f"epoch {e['epoch']}: {e['samples']} samples, loss "
                                                     f"{e['loss']:.3f}" for e in epochs))
        log = (run_dir / f"{peer['name']}.log").read_text(errors="replace").splitlines()
        lines += [f"  {line}" for line in log if " WARN" in line]
    return "\n".join(lines)


def test_swarm_loss_matches_one_process_with_the_same_global_batch(three_trainers):
    summary = three_trainers
    expected = reference_losses(EPOCHS, summary["target_batch_size"], summary["batch_size_per_step"],
                                data_seeds=[index + 1 for index in range(PEERS)])  # geotrain local's seeds
    observed = summary["loss_per_epoch"]
    assert len(observed) == EPOCHS
    for epoch, (swarm_loss, single_loss) in enumerate(zip(observed, expected), start=1):
        assert not math.isnan(swarm_loss)
        assert abs(swarm_loss - single_loss) <= PARITY_TOLERANCE * single_loss, (
            f"epoch {epoch}: swarm loss {swarm_loss:.4f} vs one process {single_loss:.4f}\n"
            f"{what_the_peers_saw(summary)}")
    # the comparison can fail: without training, the last loss would be the first one
    assert expected[-1] < (1 - PARITY_TOLERANCE) * expected[0]


# hivemind reports what its optimizer does at DEBUG level only
HIVEMIND_DEBUG = {"HIVEMIND_LOGLEVEL": "DEBUG"}


def test_a_peer_whose_averaging_round_fails_steps_with_its_own_gradients(swarm):
    """A trainer killed (SIGKILL, children included: a VM gone) right after the first epoch leaves its
    progress record behind, so the survivor starts the second gradient averaging round, which finds no
    group and fails. The survivor then steps with its own gradients of that epoch: its loss falls right
    after that step as after any other. (hivemind 1.1.12 alone steps with zero gradients there: AdamW then
    only carries on along its momentum from the first step, and the loss stays where it was.)"""
    swarm.start_coordinator()
    # the dead trainer's record outlives the survivor's second epoch; rounds that find no group end sooner,
    # and so does the survivor's wait for the dead trainer at the end-of-run agreement
    common = [*FAST_SWARM, "--lr", str(LEARNING_RATE), "--wait-for-peers", "2", "--averaging-timeout", "5",
              "--set", "optimizer.progress_expiration_s=30", "--set", "training.final_agreement_timeout_s=10"]
    survivor, survivor_events = swarm.start_trainer("survivor", *common, "--max-epochs", "3", "--data-seed", "1",
                                                    env=HIVEMIND_DEBUG)
    doomed, doomed_events = swarm.start_trainer("doomed", *common, "--data-seed", "2")

    # right after its first step, at the start of the second epoch: the survivor's round of that epoch can
    # not have finished, it needs the doomed trainer's gradients of the whole epoch
    wait_for(lambda: last_epoch(doomed_events) >= 1, 180, "the first epoch", interval_s=0.05)
    os.killpg(doomed.pid, signal.SIGKILL)
    doomed.wait(timeout=10)
    survivor.wait(timeout=240)
    log = swarm.log("survivor")
    assert survivor.returncode == 0, log[-3000:]

    second_epoch = log.find("Transitioning to epoch 1")
    failed = log.find("Averaging gradients failed", second_epoch)
    third_epoch = log.find("Transitioning to epoch 2")
    assert 0 <= second_epoch < failed < third_epoch, (
        f"expected the second gradient averaging round to fail; the survivor's log:\n{log[-5000:]}")
    losses = {e["epoch"]: e["loss"] for e in read_events(survivor_events) if e["event"] == "epoch"}
    assert sorted(losses) == [1, 2, 3], losses
    assert losses[2] < losses[1], f"the first step did not lower the loss: {losses}"
    # one process with this global batch: 2.35, 2.02, 1.44; after a second step with zero gradients the
    # third epoch's loss is the second's or above (2.04, then 2.14 in a run without the fix)
    assert losses[3] < 0.9 * losses[2], f"the step after the failed round did not lower the loss: {losses}"
