"""A downloaded state is what a trainer keeps, whatever background averaging round it had not applied yet;
and the state a trainer serves at the end of a run is the one whose hash it announces.

Local updates average the state in the background with hivemind's delta rule: a round's result is applied
later as ``parameters += averaged - before``. Two real trainers' optimizers (geotrain's build, local updates,
loopback) on a DHT of two nodes: the receiver has a round that ended but was not applied (what hivemind's own
wait leaves when a round outlasts it, as at the end of a run), then downloads the donor's state, then
applies what it has pending, as hivemind's shutdown does. Seen before the fix: ``2 x loaded - before``, and
a run that ended with two models (tests/integration/test_swarm_modes.py, local updates).

With the offloaded optimizer (the default) hivemind serves the optimizer's copy of the parameters, and a
background state round averages into it in place. Its own wait gives up after the all-reduce timeout and
leaves such a round running; seen at the end of a run (tests/integration/test_peer_lifecycle.py, the late
joiner): the finalizer announced the hash of its model while the round, ending later, changed the state it
served, and every follower's download hashed to that other state for the whole agreement.
"""

from __future__ import annotations

import time

import pytest
import torch

from geotrain.config import load_config
from geotrain.hive.state.finalize import serve_these_parameters, settle_background_rounds
from geotrain.hive.state.snapshot import parameters_sha256
from optimizer_pair import optimizer_pair

RUN_ID = "state-load-after-round"


def local_updates_config():
    return load_config(set_args=["optimizer.use_local_updates=true", "optimizer.network_profile=loopback",
                                 "optimizer.batch_size_per_step=4", "optimizer.target_batch_size=64",
                                 "optimizer.optimizer=sgd", f"swarm.run_id={RUN_ID}"])


@pytest.fixture
def trainers():
    with optimizer_pair(local_updates_config()) as made:
        yield made


def wait_for_donor(dht, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = dht.get(f"{RUN_ID}_state_averager.all_averagers", latest=True)
        if found is not None and any(v.value is not None for v in found.value.values()):
            return
        time.sleep(0.2)
    raise AssertionError("the donor did not announce its state")


def test_a_round_not_yet_applied_does_not_move_the_state_this_peer_downloaded(trainers):
    (donor_model, donor), (model, optimizer) = trainers
    averager = optimizer.state_averager
    assert averager.delta_rule_averaging, "local updates with background state averaging use the delta rule"
    optimizer.state_averager.allow_state_sharing = False  # the receiver only downloads
    # a background round that started from this peer's parameters and ended, not yet applied (hivemind's _do)
    averager._load_local_tensors_into_averager_()
    with averager.get_tensors() as averaged:
        averager._old_tensors = tuple(tensor.clone() for tensor in averaged)
    averager.finished_averaging_round.set()
    wait_for_donor(optimizer.dht)

    averager.load_state_from_peers(timeout=30)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), donor_model.parameters())), \
        "the donor's state was not loaded"
    averager.step(wait_for_delayed_updates=True)  # what hivemind's shutdown does first

    for parameter in model.parameters():
        assert torch.equal(parameter.detach(), torch.ones_like(parameter)), parameter


def offloaded_sync_config():
    return load_config(set_args=["optimizer.network_profile=loopback", "optimizer.averaging_timeout_s=1",
                                 "optimizer.batch_size_per_step=4", "optimizer.target_batch_size=64",
                                 "optimizer.optimizer=sgd", f"swarm.run_id={RUN_ID}"])


def test_the_final_state_a_trainer_serves_is_the_one_whose_hash_it_announces():
    with optimizer_pair(offloaded_sync_config()) as ((model, finalizer), (follower_model, follower)):
        averager = finalizer.state_averager
        assert averager.offload_optimizer and averager.reuse_tensors, "the default: rounds average in place"
        follower.state_averager.allow_state_sharing = False

        def late_round():  # a state round that outlasts hivemind's wait (1 s here) and averages in place
            time.sleep(2.0)
            with torch.no_grad(), averager.lock_averaged_tensors:
                for group in averager.optimizer.param_groups:
                    for parameter in group["params"]:
                        parameter.fill_(0.5)
            averager.finished_averaging_round.set()

        round_ = averager.step_executor.submit(late_round)
        averager.pending_updates.add(round_)
        assert settle_background_rounds(averager, timeout_s=30)
        serve_these_parameters(averager, model)
        announced = parameters_sha256(model)
        round_.result(timeout=30)  # (the followers download while the agreement goes on)
        # and a round given up just as its group formed averages in place later still (hivemind's round does
        # not stop for a cancel once its group has formed: seen with PowerSGD in a fresh-clone CI run)
        with torch.no_grad(), averager.lock_averaged_tensors:
            for group in averager.optimizer.param_groups:
                for parameter in group["params"]:
                    parameter.fill_(0.25)
        wait_for_donor(follower.dht)
        follower.state_averager.load_state_from_peers(timeout=30)

        assert parameters_sha256(follower_model) == announced, "the follower got a state other than the announced one"
        assert all(torch.equal(p, torch.full_like(p, 0.5)) for p in model.parameters()), "the round was not applied"
