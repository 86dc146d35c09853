"""Each task family trains through the real swarm path (coordinator, trainers, hivemind) with a falling loss.

The trainer never branches on the domain; these runs show the one code path carries CV, NLP and ASR alike.
(CV is covered by test_swarm.py; in-process training of every preset is in tests/unit.)
"""

from __future__ import annotations

import pytest

from swarm_helpers import agreement_report, run_local


@pytest.mark.parametrize("task", ["nlp", "asr"])
def test_task_trains_in_a_two_peer_swarm(tmp_path, task):
    summary, result = run_local(tmp_path, "--peers", "2", "--task", task, "--preset", "tiny", "--epochs", "3",
                                "--target-batch-size", "256", "--batch-size", "16", "--lr", "0.005")
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert summary["task"] == task
    assert summary["epochs_completed"] == 3
    assert summary["params_identical"] is True, agreement_report(summary)
    assert summary["loss_last"] < 0.97 * summary["loss_first"], summary["loss_per_epoch"]
