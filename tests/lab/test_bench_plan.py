"""What `geotrain bench` will run and compare against, before any lab exists (no root needed)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from geotrain.config import load_config
from geotrain.lab.bench import (BenchError, LabSwarm, add_bench_arguments, bandwidth_bound_s, plan_benchmark,
                                planner_prediction, prepare_run_dir)


def _plan(*arguments: str):
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    return plan_benchmark(parser.parse_args(list(arguments)))


def test_c4_scales_model_bandwidth_and_batch_together():
    plan = _plan("--setup", "C-4", "--profile", "convnext_large", "--bandwidth-scale", "10", "--time-scale", "8")
    assert [r.peers for r in plan.topology.regions] == [1, 1, 1, 1]
    assert plan.parameters == 197_800_000 // 80
    assert plan.target_batch_size == 32768 // 8
    assert plan.topology.link("eu", "aus").bandwidth_mbit_s == pytest.approx(7.0)  # [EMJ24] 70 Mbit/s / 10
    assert plan.topology.link("eu", "aus").latency_ms == pytest.approx(plan.full_topology.link("eu", "aus").latency_ms / 8)
    assert plan.network_profile == "intercontinental"
    assert plan.preset == "convnext_large@T4/80"


def test_bandwidth_bound_is_the_all_reduce_over_the_slowest_link():
    plan = _plan("--setup", "C-4")
    seconds, link = bandwidth_bound_s(plan.parameters, plan.peers, plan.topology)
    gradient_bytes = 2 * plan.parameters  # fp16
    assert seconds == pytest.approx(2 * gradient_bytes * 3 / (4 * 7.0e6 / 8))
    assert link.startswith("eu-aus")


def test_scaling_keeps_the_planners_transfer_time():
    plan = _plan("--setup", "B-4", "--time-scale", "1")
    scaled = planner_prediction(plan.topology, plan.profile, plan.gpu, plan.parameters, plan.target_batch_size, False)
    full = planner_prediction(plan.full_topology, plan.profile, plan.gpu, plan.profile.parameters,
                              plan.profile.target_batch_size, False)
    assert scaled["comm_s_per_round"] == pytest.approx(full["comm_s_per_round"], rel=1e-6)
    assert scaled["samples_per_second"] == pytest.approx(full["samples_per_second"], rel=1e-6)


@pytest.mark.parametrize("arguments, message", [
    (["--setup", "C4"], r"expected TOPOLOGY-PEERS, e.g. C-4"),
    (["--setup", "C-4", "--epochs", "2", "--warmup-epochs", "2"], r"expected 0 <= warmup < --epochs"),
    (["--setup", "C-4", "--gpu", "H100"], r"no samples/s for it; expected one of T4, A10, 8xV100"),
    (["--setup", "C-4", "--mode", "diloco", "--overlap"], r"do not apply to --mode diloco"),
    (["--setup", "C-4", "--mode", "diloco", "--inner-steps", "0"], r"--inner-steps: expected a whole number >= 1"),
])
def test_bad_requests_are_explained(arguments, message):
    with pytest.raises(BenchError, match=message):
        _plan(*arguments)


def test_diloco_trainers_get_the_mode_and_the_planner_predicts_it():
    plan = _plan("--setup", "C-4", "--profile", "roberta_xlm", "--mode", "diloco", "--inner-steps", "500")
    arguments = LabSwarm(plan, "lab", Path("/nonexistent")).training_arguments()
    assert arguments[-4:] == ["--mode", "diloco", "--inner-steps", "500"]
    sync = planner_prediction(plan.full_topology, plan.profile, plan.gpu, plan.profile.parameters,
                              plan.profile.target_batch_size, False)
    diloco = planner_prediction(plan.full_topology, plan.profile, plan.gpu, plan.profile.parameters,
                                plan.profile.target_batch_size, False, "diloco", 500, plan.batch_size)
    # one round's communication, amortised over H x b x N = 64,000 samples instead of the target batch's 32,768
    assert diloco["samples_per_second"] > sync["samples_per_second"]


def test_the_time_scale_divides_the_network_profiles_durations_too():
    plan = _plan("--setup", "C-4", "--time-scale", "8")
    arguments = LabSwarm(plan, "lab", Path("/nonexistent")).training_arguments()
    settings = dict(a.split("=", 1) for a in arguments[arguments.index("--set") + 1::2] if "=" in a)
    assert plan.network_profile == "intercontinental"
    assert float(settings["optimizer.matchmaking_time_s"]) == pytest.approx(20.0 / 8)
    assert float(settings["optimizer.request_timeout_s"]) == pytest.approx(5.0 / 8)
    assert float(settings["optimizer.averaging_timeout_s"]) == pytest.approx(600.0 / 8)
    assert float(settings["optimizer.state_download_stall_s"]) == pytest.approx(30.0 / 8)
    unscaled = _plan("--setup", "C-4", "--time-scale", "1")
    assert unscaled.topology.link("eu", "aus").latency_ms == unscaled.full_topology.link("eu", "aus").latency_ms
    # what the trainers get is a valid config (the request timeout stays below the matchmaking time)
    config = load_config(set_args=[a for a in arguments if "=" in a and a.startswith("optimizer.")] +
                         ["optimizer.network_profile=intercontinental"])
    assert config.optimizer.matchmaking_time_s == pytest.approx(2.5)


def test_a_run_folder_used_before_is_cleared_of_the_previous_runs_events_and_address(tmp_path):
    (tmp_path / "peer-1-us.jsonl").write_text('{"event": "epoch", "epoch": 4}\n')  # events are appended to
    (tmp_path / "initial_peers.txt").write_text("/ip4/10.77.1.2/tcp/1/p2p/QmGone\n")  # a dead coordinator's
    (tmp_path / "coordinator").mkdir()
    (tmp_path / "coordinator" / "identity.key").write_bytes(b"old")
    (tmp_path / "notes.txt").write_text("the operator's")
    assert prepare_run_dir(tmp_path) == tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    assert prepare_run_dir(tmp_path / "new" / "run").is_dir()
