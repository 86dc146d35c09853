"""benchmarks/gpu_throughput.py refuses what it cannot do. Its CPU smoke run (every side starts, trains and
reports, so that the GPU run does not rot between GPU sessions) runs through benchmarks/gpu/run.sh with the
offline bundle: tests/integration/test_offline_bundle.py."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCHMARK = ROOT / "benchmarks" / "gpu_throughput.py"


def run_benchmark(directory: Path, *arguments: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    """The benchmark with its run directories (TMPDIR) under ``directory``."""
    return subprocess.run([sys.executable, str(BENCHMARK), *arguments], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, "TMPDIR": str(directory)})


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU: --device cuda would run")
def test_cuda_without_a_gpu_exits_2_with_a_message(tmp_path):
    output = tmp_path / "gpu_throughput.json"
    result = run_benchmark(tmp_path, "--device", "cuda", "--output", str(output), timeout_s=120)
    assert result.returncode == 2, f"{result.stdout}\n{result.stderr}"
    assert "--device cuda: this machine has no CUDA GPU" in result.stderr
    assert "--device cpu --smoke" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not output.exists(), "no results without a measurement"


def test_smoke_refuses_to_write_over_the_committed_results(capsys):
    spec = importlib.util.spec_from_file_location("gpu_throughput", BENCHMARK)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    with pytest.raises(SystemExit) as exited:
        benchmark.parse_arguments(["--device", "cpu", "--smoke", "--output", str(benchmark.DEFAULT_OUTPUT)])
    assert exited.value.code == 2
    assert "--smoke measures nothing worth keeping" in capsys.readouterr().err
    # without --output, the smoke run writes under runs/, never into benchmarks/results
    arguments = benchmark.parse_arguments(["--device", "cpu", "--smoke"])
    assert arguments.output == benchmark.SMOKE_OUTPUT and "results" not in arguments.output.parts
