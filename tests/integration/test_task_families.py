"""Each task family trains through the real swarm path (coordinator, trainers, hivemind) with a falling loss.

The trainer never branches on the domain; these runs show the one code path carries CV, NLP and ASR alike.
(CV is covered by test_swarm.py; in-process training of every preset is in tests/unit.) Each family's two
trainers are a swarm of their own (``--run-id``) next to the tests' bootstrap coordinator.
"""

from __future__ import annotations

import pytest

from swarm_helpers import run_report, train_two

EPOCHS = 3


@pytest.mark.parametrize("task", ["nlp", "asr"])
def test_task_trains_in_a_two_peer_swarm(bootstrap_coordinator, task):
    run = train_two(bootstrap_coordinator, f"family-{task}", "--task", task, "--preset", "tiny",
                    "--target-batch-size", "256", "--batch-size", "16", "--lr", "0.005", epochs=EPOCHS,
                    timeout_s=300)
    logs = run_report(run)
    assert run["exit_codes"] == [0, 0], logs
    assert all(f is not None and f["epoch"] == EPOCHS for f in run["finished"]), logs
    assert len({f["params_sha256"] for f in run["finished"]}) == 1, f"the trainers ended apart:\n{logs}"
    losses = run["losses"]
    assert losses[-1] < 0.97 * losses[0], losses
