"""Each training mode a user can choose, in a real local swarm of two trainers (`geotrain local`).

What a user notices: the run ends at the epoch asked for, the loss falls, and every trainer ends with the
very same parameters. The modes: delayed parameter updates (the intercontinental profile's defining
setting: hivemind's delay_optimizer_step and delay_grad_averaging; here with loopback timings), the
gradient compressions besides the default fp16, and local updates (each trainer steps every
micro-batch; the swarm averages parameters once per epoch).
"""

from __future__ import annotations

import math

import pytest
import yaml

from swarm_helpers import FAST_SWARM, agreement_report, run_local

PEERS = 2
LEARNING_RATE = 0.01
# half of FAST_SWARM's target: short epochs (each one a step of the swarm's optimizer)
TARGET_BATCH_SIZE = 512
# cross-entropy of a model that guesses among the task's 10 classes; training must get well below it
CHANCE_LOSS = math.log(10)

MODES = {
    # flags, what the run's resolved config must then say, and epochs to train
    # With delayed updates an epoch's step lands while the next epoch computes its gradients, at the latest
    # when that epoch ends (on 2 busy cores the background round finishes only then): the loss of epoch e
    # shows e - 2 steps, and the second step comes from the same weights as the first (one process that
    # steps so: 2.34, 2.37, 2.04, 2.09, 1.59). One more epoch than the others shows the loss falling.
    "delayed-parameter-updates": (["--delayed-parameter-updates"], {"delayed_parameter_updates": True}, 5),
    "uniform8bit-compression": (["--grad-compression", "uniform8bit"], {"grad_compression": "uniform8bit"}, 4),
    "no-compression": (["--grad-compression", "none"], {"grad_compression": "none"}, 4),
    "local-updates": (["--local-updates"], {"use_local_updates": True}, 4),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_mode_trains_and_ends_with_identical_parameters(tmp_path, mode):
    flags, expected, epochs = MODES[mode]
    summary, result = run_local(tmp_path, "--peers", str(PEERS), "--epochs", str(epochs), "--lr", str(LEARNING_RATE),
                                *FAST_SWARM, "--target-batch-size", str(TARGET_BATCH_SIZE), *flags)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    resolved = yaml.safe_load((tmp_path / "run" / "config.resolved.yaml").read_text())["optimizer"]
    assert {key: resolved[key] for key in expected} == expected, "the mode's flags did not reach the config"

    assert summary["epochs_completed"] == epochs
    assert [(peer["epoch"], peer["exit_code"]) for peer in summary["peers"]] == [(epochs, 0)] * PEERS
    assert summary["params_identical"] is True, agreement_report(summary)

    losses = summary["loss_per_epoch"]
    assert len(losses) == epochs and not any(math.isnan(loss) for loss in losses), losses
    # the same fall as test_swarm asks of three trainers; with local updates the first epoch already trains
    # (a step per micro-batch), so the last epoch must also be well below chance
    assert losses[-1] < 0.8 * losses[0], f"the loss did not fall: {losses}"
    assert losses[-1] < 0.8 * CHANCE_LOSS, f"the loss did not fall well below chance level: {losses}"
