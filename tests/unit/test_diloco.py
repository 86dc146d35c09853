"""DiLoCo mode (optimizer.mode: diloco): its config, its outer step, its state, its checks.

The outer step and the state run on a real hivemind optimizer in this process (one DHT node on loopback,
a swarm of one: hivemind runs no round, and geotrain steps with this peer's own pseudo-gradient).
"""

from __future__ import annotations

import math

import hivemind
import pytest
import torch

from geotrain.config import ConfigError, load_config
from geotrain.hive.optim.diloco import (FINGERPRINT_VALUES, MAX_PSEUDO_GRADIENT_TO_PARAMETERS, majority_donor,
                                        same_outer_parameters)
from geotrain.hive.guard.report import GuardReport
from geotrain.hive.averaging.local_gradients import LocalGradientsKeepingAverager
from geotrain.hive.optim.averagers import GuardedDiLoCoStateAverager, GuardedGradientAverager, GuardedStateAverager
from geotrain.hive.optim.diloco import DiLoCoOptimizer
from geotrain.hive.optim.factory import build_hivemind_optimizer
from geotrain.hive.optim.optimizer import MeasuredOptimizer, RecordingStateAverager
from geotrain.hive.state.snapshot import capture_state, restore_state

INNER_STEPS = 3
BATCH_SIZE = 4


# --- config ------------------------------------------------------------------------------------------------
def test_diloco_on_the_intercontinental_profile_has_no_delayed_updates_to_refuse():
    config = load_config(set_args=["optimizer.mode=diloco", "optimizer.network_profile=intercontinental"])
    assert config.optimizer.mode == "diloco"
    assert config.optimizer.delayed_parameter_updates is False  # the profile's default does not apply
    assert config.optimizer.diloco.outer_learning_rate == 0.7 and config.optimizer.diloco.outer_momentum == 0.9
    assert config.optimizer.round_matchmaking_time_s == 2 * config.optimizer.matchmaking_time_s


@pytest.mark.parametrize("setting, message", [
    ("optimizer.delayed_parameter_updates=true", r"delayed_parameter_updates does not apply to optimizer\.mode diloco"),
    ("optimizer.use_local_updates=true", r"use_local_updates does not combine with optimizer\.mode diloco"),
    ("optimizer.diloco.inner_steps=0", r"optimizer\.diloco\.inner_steps"),
    ("optimizer.diloco.outer_momentum=1.5", r"optimizer\.diloco\.outer_momentum"),
])
def test_diloco_settings_that_cannot_work_name_the_key(setting, message):
    with pytest.raises(ConfigError, match=message):
        load_config(set_args=["optimizer.mode=diloco", setting])


def test_rounds_are_described_for_operators_in_each_mode():
    sync = load_config(set_args=["optimizer.target_batch_size=512"]).optimizer
    diloco = load_config(set_args=["optimizer.mode=diloco", "optimizer.diloco.inner_steps=50"]).optimizer
    assert sync.describe_rounds() == "epochs of 512 samples"
    assert diloco.describe_rounds() == "outer rounds of 50 micro-steps per trainer (DiLoCo)"
    # a loopback round waits at least 5 s for its group: a trainer that misses one must load the others' state
    assert load_config(set_args=["optimizer.mode=diloco", "optimizer.network_profile=loopback"]) \
        .optimizer.round_matchmaking_time_s == 5.0


# --- who holds the round's outer parameters ----------------------------------------------------------------
def fingerprint(scale: float = 1.0, offset: float = 0.0) -> list[float]:
    return [scale * (1 + index / FINGERPRINT_VALUES) + offset for index in range(FINGERPRINT_VALUES)]


def test_outer_parameters_equal_up_to_a_compressed_rounds_rounding_but_not_a_step_apart():
    assert same_outer_parameters(fingerprint(), fingerprint(offset=1e-6))
    assert not same_outer_parameters(fingerprint(), fingerprint(offset=1e-2))
    assert not same_outer_parameters(fingerprint(), fingerprint()[:-1])


def test_the_round_majority_is_followed_and_a_tie_goes_to_the_smallest_peer_id():
    gathered = {"QmC": {"outer": fingerprint()}, "QmA": {"outer": fingerprint(offset=0.5)},
                "QmB": {"outer": fingerprint(offset=1e-7)}}
    assert majority_donor(gathered) == ("QmB", 2, fingerprint(offset=1e-7))
    tie = {"QmC": {"outer": fingerprint()}, "QmA": {"outer": fingerprint(offset=0.5)}}
    assert majority_donor(tie)[:2] == ("QmA", 1)
    assert majority_donor({"QmA": {"epoch": 3}, "QmB": 7}) == (None, 0, None)  # members that sent no fingerprint


# --- the outer step, the state, the checks: a real hivemind optimizer, a swarm of one ----------------------
@pytest.fixture
def dht():
    node = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    yield node
    node.shutdown()


def diloco_config(run_id: str, outer_momentum: float = 0.9):
    return load_config(set_args=[
        "optimizer.mode=diloco", f"optimizer.diloco.inner_steps={INNER_STEPS}", "optimizer.network_profile=loopback",
        f"optimizer.batch_size_per_step={BATCH_SIZE}", f"optimizer.target_batch_size={BATCH_SIZE}",
        "optimizer.optimizer=sgd", "optimizer.learning_rate=0.1", f"optimizer.diloco.outer_momentum={outer_momentum}",
        f"swarm.run_id={run_id}"])


def build(dht, run_id: str, outer_momentum: float = 0.9, report: GuardReport | None = None):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    optimizer = build_hivemind_optimizer(diloco_config(run_id, outer_momentum), dht, model, guard_report=report)
    return model, optimizer


def train_until_round(model, optimizer) -> None:
    """Inner steps (SGD on the model's own gradients) until the swarm's outer round has been taken."""
    generator = torch.Generator().manual_seed(1)
    epoch = optimizer.local_epoch
    for _ in range(50):
        loss = (model(torch.randn(BATCH_SIZE, 8, generator=generator)) - 1.0).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if optimizer.local_epoch != epoch:
            return
    raise AssertionError("no outer round within 50 micro-steps")


def test_a_swarm_of_one_takes_the_outer_nesterov_step_with_its_own_pseudo_gradient(dht):
    model, optimizer = build(dht, "diloco-outer-step")
    try:
        outer = [p.detach().clone() for p in model.parameters()]
        averager = optimizer.state_averager
        train_until_round(model, optimizer)
        assert optimizer.local_epoch == 1
        # the outer step: the pseudo-gradient d = outer - local; Nesterov from zero momentum moves by lr (1 + mu) d
        pseudo_gradient = averager._own_pseudo_gradient  # d, as it was applied
        assert any(float(d.abs().sum()) > 0 for d in pseudo_gradient), "the inner steps did not move the model"
        for parameter, before, d in zip(model.parameters(), outer, pseudo_gradient):
            assert torch.allclose(parameter.detach(), before - 0.7 * 1.9 * d, atol=1e-6)
        assert averager.last_pseudo_gradient_norm == pytest.approx(
            math.sqrt(sum(float(d.pow(2).sum()) for d in pseudo_gradient)), rel=1e-5)
        # and the outer parameters are the model's now: the next round's pseudo-gradient starts from them
        for parameter, outer_parameter in zip(model.parameters(), averager.outer_parameters):
            assert torch.equal(parameter.detach(), outer_parameter)
    finally:
        optimizer.shutdown()


def test_a_newcomer_is_served_the_outer_parameters_not_the_donors_half_way_local_ones(dht):
    model, optimizer = build(dht, "diloco-served-state")
    try:
        train_until_round(model, optimizer)
        outer = [p.detach().clone() for p in optimizer.state_averager.outer_parameters]
        generator = torch.Generator().manual_seed(2)
        loss = (model(torch.randn(BATCH_SIZE, 8, generator=generator)) - 1.0).pow(2).mean()
        loss.backward()
        optimizer.step()  # one inner step into the next round: local parameters move, outer ones do not
        assert not all(torch.equal(p.detach(), o) for p, o in zip(model.parameters(), outer))
        metadata, tensors, _ = optimizer.state_averager.get_current_state()
        assert metadata["epoch"] == 1 and "outer_optimizer_metadata" in metadata
        for served, expected in zip(tensors, outer):
            assert torch.equal(served, expected)
    finally:
        optimizer.shutdown()


def test_a_checkpoint_holds_the_outer_momentum_and_restores_it(dht):
    model, optimizer = build(dht, "diloco-checkpoint")
    try:
        train_until_round(model, optimizer)
        state = capture_state(optimizer, model)
        momentum = [s["momentum_buffer"] for s in state["outer_optimizer"]["state"].values()]
        assert momentum and any(float(m.abs().sum()) > 0 for m in momentum), "no outer momentum in the checkpoint"
    finally:
        optimizer.shutdown()
    restored_model, restored = build(dht, "diloco-checkpoint-restored")
    try:
        restore_state(restored, restored_model, state)
        assert restored.local_epoch == 1
        for outer, parameter in zip(restored.state_averager.outer_parameters, model.parameters()):
            assert torch.equal(outer, parameter.detach())
        restored_momentum = [s["momentum_buffer"] for s in restored.state_averager.outer_optimizer.state.values()]
        for a, b in zip(restored_momentum, momentum):
            assert torch.equal(a, b)
        sync_state = {key: value for key, value in state.items() if key != "outer_optimizer"}
        with pytest.raises(ValueError, match="no DiLoCo outer optimizer state"):
            restore_state(restored, restored_model, sync_state)
    finally:
        restored.shutdown()


@pytest.mark.parametrize("poison", ["nan", "huge"])
def test_a_poisoned_average_is_refused_and_this_peer_steps_with_its_own(dht, poison):
    report = GuardReport(None)
    model, optimizer = build(dht, f"diloco-poison-{poison}", outer_momentum=0.0, report=report)
    try:
        averager = optimizer.state_averager
        outer = [p.detach().clone() for p in averager.outer_parameters]
        with torch.no_grad():
            for parameter in model.parameters():  # what the inner steps did
                parameter.add_(0.01)
        averager._load_local_tensors_into_averager_()  # this peer's pseudo-gradient, as before a round
        with averager.get_tensors() as averaged, torch.no_grad():  # what a bad peer's part made of the average
            for tensor in averaged:
                tensor.fill_(math.nan) if poison == "nan" else tensor.mul_(1e6)
        averager._apply_averaging_results_()
        assert averager.refused_average
        for parameter, before in zip(model.parameters(), outer):  # own pseudo-gradient -0.01, outer lr 0.7
            assert torch.allclose(parameter.detach(), before + 0.7 * 0.01, atol=1e-6)
        reason = "non-finite" if poison == "nan" else "norm"
        assert report.counts()[("pseudo_gradient", reason)] == 1
        assert MAX_PSEUDO_GRADIENT_TO_PARAMETERS < 1e6 * 0.01  # (the huge one is far over the bound)
    finally:
        optimizer.shutdown()


def test_an_overlapped_round_lands_the_swarms_step_and_keeps_the_inner_steps_taken_since(dht):
    model, optimizer = build(dht, "diloco-overlap", outer_momentum=0.0)
    try:
        averager = optimizer.state_averager
        assert averager.overlap_rounds and averager.step_executor._max_workers == 2  # inner steps beside a round
        outer = [p.detach().clone() for p in averager.outer_parameters]
        with torch.no_grad():
            for parameter in model.parameters():  # the round's inner steps
                parameter.add_(0.01)
        averager.prepare_round()  # the boundary: this peer's pseudo-gradient, -0.01
        with torch.no_grad():
            for parameter in model.parameters():  # inner steps of the next round while the all-reduce runs
                parameter.add_(0.003)
        averager._load_local_tensors_into_averager_()  # hivemind's call in its background thread: takes nothing new
        with averager.get_tensors() as averaged, torch.no_grad():
            assert all(torch.allclose(t, torch.full_like(t, -0.01)) for t in averaged[:len(outer)])
            for tensor in averaged[:len(outer)]:  # the swarm's average: the others moved further
                tensor.fill_(-0.02)
        averager._apply_averaging_results_()
        for parameter, outer_parameter, before in zip(model.parameters(), averager.outer_parameters, outer):
            assert torch.allclose(outer_parameter, before + 0.7 * 0.02, atol=1e-6)  # the swarm's outer step
            assert torch.allclose(parameter.detach(), outer_parameter + 0.003, atol=1e-6)  # plus the steps since
    finally:
        optimizer.shutdown()


def test_without_overlap_the_model_is_the_outer_parameters_after_a_round(dht):
    config = diloco_config("diloco-blocking", outer_momentum=0.0)
    config.optimizer.diloco.overlap_rounds = False
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    optimizer = build_hivemind_optimizer(config, dht, model)
    try:
        averager = optimizer.state_averager
        assert not optimizer.delay_state_averaging and averager.step_executor._max_workers == 1
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.01)
        averager._load_local_tensors_into_averager_()
        averager._apply_averaging_results_()
        for parameter, outer_parameter in zip(model.parameters(), averager.outer_parameters):
            assert torch.equal(parameter.detach(), outer_parameter)
    finally:
        optimizer.shutdown()


def test_each_mode_runs_its_checked_classes_with_the_configs_settings(dht):
    """What optim/factory.py's table says, and the settings reach the averagers (as constructor arguments, before
    their processes fork): the guard's weight bound (1 for a DiLoCo pseudo-gradient), DiLoCo's quarter of the
    inner steps, the donors' epoch tolerance; and the stock hivemind classes for an unchecked peer."""
    def sync_config(run_id: str):
        return load_config(set_args=["optimizer.network_profile=loopback", "optimizer.batch_size_per_step=4",
                                     "optimizer.target_batch_size=64", f"swarm.run_id={run_id}"])

    built = []
    try:  # (each under a run id of its own: one DHT serves one averager of a name)
        for config, checked in ((sync_config("classes-sync"), True), (diloco_config("classes-diloco"), True),
                                (sync_config("classes-unchecked"), False)):
            built.append(build_hivemind_optimizer(config, dht, torch.nn.Linear(4, 2), checked=checked))
        sync, outer, unchecked = built
        assert (type(sync), type(sync.state_averager), type(sync.grad_averager)) == (
            MeasuredOptimizer, GuardedStateAverager, GuardedGradientAverager)
        assert sync.state_averager.guard_max_weight == sync.grad_averager.guard_max_weight == \
            load_config().guard.max_claimed_batches * 64 + 4
        assert sync.state_averager.donor_epoch_tolerance == 1 and sync.missed_round_check_s >= 1.0
        assert (type(outer), type(outer.state_averager)) == (DiLoCoOptimizer, GuardedDiLoCoStateAverager)
        assert outer.state_averager.guard_max_weight == 1.0 and outer.state_averager.donor_epoch_tolerance == 0
        assert outer.state_averager.min_inner_steps_for_norm_check == max(1.0, INNER_STEPS / 4)
        assert outer.samples_per_trainer_round == INNER_STEPS * BATCH_SIZE
        assert (type(unchecked.state_averager), type(unchecked.grad_averager)) == (
            RecordingStateAverager, LocalGradientsKeepingAverager)
        assert unchecked.state_averager.guard_report is None
    finally:
        for optimizer in built:
            optimizer.shutdown()


def test_a_long_rounds_honest_average_beyond_ten_times_the_parameters_norm_is_taken(dht):
    # long rounds of an adaptive inner optimizer move every parameter by about its learning rate per step: the
    # pseudo-gradient outgrows the parameters (12.8x after 256 AdamW steps of the lab's emulated model)
    model, optimizer = build(dht, "diloco-long-round", outer_momentum=0.0)
    try:
        averager = optimizer.state_averager
        outer = [p.detach().clone() for p in averager.outer_parameters]
        parameters_norm = math.sqrt(sum(float(p.pow(2).sum()) for p in outer))
        count = sum(p.numel() for p in outer)
        shift = 20 * parameters_norm / math.sqrt(count)  # a pseudo-gradient 20 times the parameters' norm
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(shift)
        averager.prepare_round()
        with averager.get_tensors() as averaged, torch.no_grad():
            for tensor in averaged[:len(outer)]:  # the others moved 1.5 times as far: an honest average
                tensor.mul_(1.5)
        averager._apply_averaging_results_()
        assert not averager.refused_average
        for outer_parameter, before in zip(averager.outer_parameters, outer):
            assert torch.allclose(outer_parameter, before + 0.7 * 1.5 * shift, atol=1e-5)
        assert averager.average_norm_bound() > MAX_PSEUDO_GRADIENT_TO_PARAMETERS * parameters_norm
    finally:
        optimizer.shutdown()


def test_a_resync_from_a_donor_not_yet_past_the_round_refuses_its_state_and_bans_no_one(dht):
    # the round's majority donor applies its outer step in the background: asked a moment too early it still
    # holds the round before. Seen in CI: a trainer banned that honest donor, and the run ended on two states.
    donor_node = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                              initial_peers=[str(a) for a in dht.get_visible_maddrs()])
    report = GuardReport(None)
    _, donor = build(donor_node, "diloco-resync")
    model, optimizer = build(dht, "diloco-resync", report=report)
    try:
        donor_id = str(donor_node.peer_id)
        averager = optimizer.state_averager
        averager.local_epoch = 1  # this peer has taken round 1; the donor is still at 0
        before = [p.detach().clone() for p in model.parameters()]
        optimizer._resync_from = donor_id
        optimizer.load_state_from_peers()
        assert averager.refused_state is not None and averager.refused_state.startswith("its epoch 0 is behind")
        assert donor_id not in {str(peer) for peer in report.bans.active()}, "an honest, late donor was banned"
        assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    finally:
        optimizer.shutdown()
        donor.shutdown()
        donor_node.shutdown()
