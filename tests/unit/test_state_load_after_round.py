"""A downloaded state is what a trainer keeps, whatever background averaging round it had not applied yet.

Local updates average the state in the background with hivemind's delta rule: a round's result is applied
later as ``parameters += averaged - before``. Two real trainers' optimizers (geotrain's build, local updates,
loopback) on a DHT of two nodes: the receiver has a round that ended but was not applied (what hivemind's own
wait leaves when a round outlasts it, as at the end of a run), then downloads the donor's state, then
applies what it has pending, as hivemind's shutdown does. Seen before the fix: ``2 x loaded - before``, and
a run that ended with two models (tests/integration/test_swarm_modes.py, local updates).
"""

from __future__ import annotations

import time

import pytest
import torch

from geotrain.config import load_config
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
