"""Mixed precision in a real swarm, on the CPU: what a GPU user relies on, checked where tests run."""

from __future__ import annotations

from swarm_helpers import agreement_report, run_local

EPOCHS = 3


def test_two_trainers_in_bf16_end_equal_with_a_falling_loss(tmp_path):
    summary, result = run_local(tmp_path, "--peers", "2", "--epochs", str(EPOCHS), "--task", "cv", "--preset", "tiny",
                                "--target-batch-size", "128", "--batch-size", "32", "--lr", "0.01",
                                "--precision", "bf16", "--data-workers", "0")
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert summary["epochs_completed"] == EPOCHS
    assert summary["params_identical"] is True, agreement_report(summary)
    assert summary["precision"] == "bf16" and summary["device"] == "cpu"
    assert all(peer["precision"] == "bf16" for peer in summary["peers"])
    losses = summary["loss_per_epoch"]
    assert losses[-1] < losses[0], f"the loss did not fall: {losses}"
    assert summary["peak_gpu_memory_bytes"] is None  # no GPU: no figure rather than a made-up one
    assert "computed on cpu in bf16" in result.stdout
