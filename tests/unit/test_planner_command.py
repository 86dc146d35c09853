"""`geotrain plan` and `geotrain profile` as a user runs them: once through ``python -m geotrain.planner`` (a
process of its own), the others in this process through the same ``main`` (a profile from a run builds the
run's model to count its parameters: a process per case would import torch each time)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import yaml

from geotrain.planner.__main__ import main
from geotrain.planner.profiles import load_profile

ROOT = Path(__file__).resolve().parents[2]


def run_process(*args):
    return subprocess.run([sys.executable, "-m", "geotrain.planner", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)


def run_cli(*args, env=None):
    """``python -m geotrain.planner ARGS`` in this process, with ``env`` added to the environment."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, env or {}), contextlib.redirect_stdout(stdout), \
            contextlib.redirect_stderr(stderr):
        try:
            code = main(list(args))
        except SystemExit as exited:  # argparse's refusals
            code = exited.code
    return SimpleNamespace(returncode=code, stdout=stdout.getvalue(), stderr=stderr.getvalue())


def test_planner_imports_neither_torch_nor_hivemind():
    code = ("import sys, geotrain.planner, geotrain.planner.command, geotrain.planner.solve, geotrain.planner.report; "
            "bad = [m for m in ('torch', 'hivemind', 'scipy', 'matplotlib') if m in sys.modules]; "
            "assert not bad, bad")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr


def test_plan_prints_table_and_reason(tmp_path):
    out = tmp_path / "plan.json"
    result = run_process("plan", "--profile", "convnext_large", "--min-samples-per-second", "200", "--max-peers",
                         "10", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "$/1M samples" in result.stdout and "Why #1:" in result.stdout
    data = json.loads(out.read_text())
    best = data["candidates"][0]
    assert best["samples_per_second"] >= 200
    assert best["usd_per_million_samples"] == pytest.approx(best["usd_per_hour"] / best["samples_per_second"] / 3600 * 1e6)
    assert data["coordinator"]


def test_plan_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "frontier.png"
    assert main(["plan", "--profile", "convnext_large", "--max-peers", "6", "--clouds", "gc,aws",
                 "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args,message", [
    (["--profile", "nope"], "no profile named 'nope'"),
    (["--profile", "convnext_large", "--min-samples-per-second", "100000", "--max-peers", "4"],
     "--min-samples-per-second 100000 is out of reach"),
    (["--profile", "convnext_large", "--budget-usd-per-hour", "0.1"],
     "no configuration fits the budget (--budget-usd-per-hour 0.1)"),
    (["--profile", "convnext_large", "--solver-time-limit", "0"], "--solver-time-limit is 0; expected a finite number above 0"),
    (["--profile", "convnext_large", "--quota", "us-central1"], "expected REGION=GPUS"),
    (["--profile", "convnext_large", "--objective", "throughput"], "needs --budget-usd-per-hour"),
    (["--profile", "convnext_large", "--regions", "mars-1"], "--regions: the catalog has no region 'mars-1'"),
    (["--profile", "convnext_large", "--clouds", "aws", "--regions", "us-central1"],
     "--regions us-central1 leaves no offer"),
])
def test_user_errors_exit_2_without_traceback(args, message):
    result = run_cli("plan", *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_malformed_catalog_names_line_through_the_cli(tmp_path):
    catalog = tmp_path / "c.csv"
    catalog.write_text("cloud,region,continent,instance_type,gpu,gpu_count,vcpus,on_demand_usd_per_hour,"
                       "spot_usd_per_hour,spot_interruption_rate,source\ngc,us-central1,us,t4,T4,one,,0.5,0.1,,x\n")
    result = run_cli("plan", "--profile", "convnext_large", "--catalog", str(catalog))
    assert result.returncode == 2
    assert f"{catalog}:2, column 'gpu_count': 'one' is not a whole number" in result.stderr


def run_summary(path: Path, **fields) -> Path:
    path.write_text(json.dumps({
        "task": "cv", "preset": "tiny", "parameters": 1_200_000, "target_batch_size": 256,
        "swarm_samples_per_second": 90.0, "granularity": 2.5, "grad_compression": "fp16", "device": "cpu", **fields,
        "peers": [{"peer_id": "a", "samples": 1024, "samples_per_second": 45.0, "compute_s": 20.0, "comm_s": 4.0},
                  {"peer_id": "b", "samples": 1024, "samples_per_second": 45.0, "compute_s": 20.0, "comm_s": 4.0}],
    }))
    return path


def test_profile_from_run_is_found_by_plan(tmp_path):
    summary = run_summary(tmp_path / "run.json")
    profiles = tmp_path / "profiles"
    result = run_cli("profile", "--from-run", str(summary), "--name", "mymodel", env={"GEOTRAIN_PROFILES_DIR": str(profiles)})
    assert result.returncode == 0, result.stderr
    written = (profiles / "mymodel.yaml").read_text()
    assert "cpu: 51.2" in written  # 1024 samples / 20 s of compute
    assert "bytes_per_parameter: 2" in written  # fp16
    # 2048 samples / TBS 256 = 8 rounds; 4 s communication per peer -> 0.5 s per round
    assert "round_overhead_s: 0.5" in written
    plan = run_cli("plan", "--profile", "mymodel", "--max-peers", "4", "--min-samples-per-second", "60",
                   env={"GEOTRAIN_PROFILES_DIR": str(profiles)})
    assert plan.returncode == 0, plan.stderr
    assert "c5.xlarge" in plan.stdout  # the catalog's CPU VM is the device the profile was measured on
    explicit = run_cli("plan", "--profile", "mymodel", "--profiles-dir", str(profiles), "--max-peers", "2")
    assert explicit.returncode == 0, explicit.stderr


def test_a_powersgd_run_gives_a_profile_with_what_its_rank_sends(tmp_path):
    from geotrain.config import TaskConfig
    from geotrain.tasks import build_task

    parameters = sum(p.numel() for p in build_task(TaskConfig(name="cv", preset="tiny")).build_model().parameters())
    sent = {}
    for rank in (1, 4):
        summary = run_summary(tmp_path / f"run-{rank}.json", parameters=parameters, grad_compression="powersgd",
                              powersgd_rank=rank)
        result = run_cli("profile", "--from-run", str(summary), "--name", f"r{rank}", "--profiles-dir", str(tmp_path))
        assert result.returncode == 0, result.stderr
        sent[rank] = yaml.safe_load((tmp_path / f"r{rank}.yaml").read_text())["bytes_per_parameter"]
    # fp16 sends 2 bytes per parameter; rank-r factors far fewer, and more of them at a higher rank
    assert 0 < sent[1] < sent[4] < 2, sent
    profile = load_profile("r4", profiles_dir=tmp_path)
    assert profile.state_bytes_per_parameter == 2  # state averaging rounds send the parameters in fp16
    assert profile.bytes_averaged_per_round == pytest.approx(parameters * (sent[4] + 2 / profile.state_averaging_every_epochs))

    summary = run_summary(tmp_path / "no-rank.json", parameters=parameters, grad_compression="powersgd")
    result = run_cli("profile", "--from-run", str(summary), "--name", "m", "--profiles-dir", str(tmp_path))
    assert result.returncode == 2 and "key 'powersgd_rank' is missing" in result.stderr, result.stderr
    summary = run_summary(tmp_path / "other.json", grad_compression="powersgd", powersgd_rank=4)  # 1.2M parameters
    result = run_cli("profile", "--from-run", str(summary), "--name", "m", "--profiles-dir", str(tmp_path))
    assert result.returncode == 2 and "parameters, the run says 1200000" in result.stderr, result.stderr


@pytest.mark.parametrize("content,message", [
    ("{not json", "is not valid JSON (line 1"),
    (json.dumps({"parameters": 10, "target_batch_size": 8, "peers": []}), "'peers' is missing or empty"),
    (json.dumps({"parameters": 10, "target_batch_size": 8, "grad_compression": "zip",
                 "peers": [{"samples": 1, "compute_s": 1, "comm_s": 0}]}), "grad_compression is 'zip'"),
])
def test_profile_bad_summary_exits_2(tmp_path, content, message):
    summary = tmp_path / "run.json"
    summary.write_text(content)
    result = run_cli("profile", "--from-run", str(summary), "--name", "m", "--profiles-dir", str(tmp_path))
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
