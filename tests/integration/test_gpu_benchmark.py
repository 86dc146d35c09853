"""benchmarks/gpu_throughput.py keeps running: its CPU smoke mode here, its GPU mode on GPU machines.

The smoke run measures nothing worth keeping (tiny model, a few steps, a shared CPU); it checks that every side
of the benchmark still starts, trains and reports, so that the GPU run does not rot between GPU sessions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swarm_helpers import processes_mentioning

ROOT = Path(__file__).resolve().parents[2]
BENCHMARK = ROOT / "benchmarks" / "gpu_throughput.py"


def run_benchmark(directory: Path, *arguments: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    """The benchmark with its run directories (TMPDIR) under ``directory``."""
    return subprocess.run([sys.executable, str(BENCHMARK), *arguments], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, "TMPDIR": str(directory)})


def test_cpu_smoke_run_measures_both_sides_and_prints_the_table(tmp_path):
    output = tmp_path / "gpu_throughput.json"
    result = run_benchmark(tmp_path, "--device", "cpu", "--smoke", "--output", str(output))
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    report = json.loads(output.read_text())
    assert report["benchmark"] == "gpu_throughput"
    assert report["setup"]["device"] == "cpu" and report["setup"]["precision"] == "fp32"
    assert report["setup"]["smoke"] is True
    assert report["rows"], "no measured rows"
    for row in report["rows"]:
        plain, geotrain = row["plain"], row["geotrain_x1"]
        assert "error" not in plain and "error" not in geotrain, row
        assert plain["samples_per_second"] > 0 and geotrain["samples_per_second"] > 0
        assert row["ratio_x1_over_plain"] == pytest.approx(geotrain["samples_per_second"] / plain["samples_per_second"])
        assert geotrain["device"] == "cpu" and geotrain["precision"] == "fp32"
        assert geotrain["params_identical"] is True
        assert row["target_batch_size"] % row["batch_size_per_step"] == 0
        assert row["parameters"] == plain["parameters"] == geotrain["parameters"]
        # no GPU: no memory figure rather than a made-up one
        assert plain["peak_gpu_memory_bytes"] is None and geotrain["peak_gpu_memory_bytes"] is None
    table = result.stdout
    assert "plain/s" in table and "x1/plain" in table and "[EMJ24]" in table
    assert any(line.startswith(row["preset"]) for row in report["rows"] for line in table.splitlines())
    assert not processes_mentioning(str(tmp_path)), "a process of the benchmark outlived it"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU: --device cuda would run")
def test_cuda_without_a_gpu_exits_2_with_a_message(tmp_path):
    output = tmp_path / "gpu_throughput.json"
    result = run_benchmark(tmp_path, "--device", "cuda", "--output", str(output), timeout_s=120)
    assert result.returncode == 2, f"{result.stdout}\n{result.stderr}"
    assert "--device cuda: this machine has no CUDA GPU" in result.stderr
    assert "--device cpu --smoke" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not output.exists(), "no results without a measurement"
