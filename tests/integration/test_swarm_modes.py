"""Training modes besides the default, each in a real swarm of two trainers (its own run id next to the tests'
bootstrap coordinator).

What a user notices: the run ends at the epoch asked for, the loss falls, and every trainer ends with the
very same parameters. The modes: delayed parameter updates (the intercontinental profile's defining
setting: hivemind's delay_optimizer_step and delay_grad_averaging; here with loopback timings) and local
updates (each trainer steps every micro-batch; the swarm averages parameters once per epoch). The gradient
compressions, ``none`` included, have their runs in test_compression.py; that each mode's flag reaches the
config is checked in-process (tests/unit/test_config.py).
"""

from __future__ import annotations

import math

import pytest

from swarm_helpers import FAST_SWARM, run_report, train_two

LEARNING_RATE = 0.01
# half of FAST_SWARM's target: short epochs (each one a step of the swarm's optimizer)
TARGET_BATCH_SIZE = 512
# cross-entropy of a model that guesses among the task's 10 classes; training must get well below it
CHANCE_LOSS = math.log(10)

MODES = {
    # flags and epochs to train
    # With delayed updates an epoch's step lands while the next epoch computes its gradients, at the latest
    # when that epoch ends (on 2 busy cores the background round finishes only then): the loss of epoch e
    # shows e - 2 steps, and the second step comes from the same weights as the first (one process that
    # steps so: 2.34, 2.37, 2.04, 2.09, 1.59). Three more epochs than the others show the loss falling: with
    # one more, a CI run's fifth epoch was at 0.81 of its first (2.33, 2.34, 2.05, 2.00, 1.90; the test asks 0.8).
    "delayed-parameter-updates": (["--delayed-parameter-updates"], 7),
    "local-updates": (["--local-updates"], 4),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_mode_trains_and_ends_with_identical_parameters(bootstrap_coordinator, mode):
    flags, epochs = MODES[mode]
    run = train_two(bootstrap_coordinator, f"mode-{mode}", *FAST_SWARM, "--target-batch-size", str(TARGET_BATCH_SIZE),
                    "--lr", str(LEARNING_RATE), *flags, epochs=epochs)
    assert run["exit_codes"] == [0, 0], run_report(run)
    assert [f and f["epoch"] for f in run["finished"]] == [epochs, epochs], run_report(run)
    hashes = {f["params_sha256"] for f in run["finished"]}
    assert len(hashes) == 1, f"the trainers ended with different parameters: {hashes}\n{run_report(run)}"

    losses = run["losses"]
    assert len(losses) == epochs and not any(math.isnan(loss) for loss in losses), losses
    # the same fall as test_swarm asks of three trainers; with local updates the first epoch already trains
    # (a step per micro-batch), so the last epoch must also be well below chance
    assert losses[-1] < 0.8 * losses[0], f"the loss did not fall: {losses}"
    assert losses[-1] < 0.8 * CHANCE_LOSS, f"the loss did not fall well below chance level: {losses}"
