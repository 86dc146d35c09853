"""The planner's training modes: sync (an all-reduce of gradients every target batch) and diloco (DiLoCo: an
all-reduce of pseudo-gradients every H inner steps of b samples per peer, i.e. every H x b x N samples)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from test_planner_command import run_cli
from test_planner_solve import CATALOG, PROFILE, brute_force, check_against_brute_force

from geotrain.planner.errors import PlannerError
from geotrain.planner.model import DEFAULT_INNER_STEPS, Settings, evaluate
from geotrain.planner.network import load_network
from geotrain.planner.problem import Inputs, Request, ranking_key
from geotrain.planner.profiles import load_profile
from geotrain.planner.solve import plan
from geotrain.planner.validation import setup_counts, shipped_inputs
from geotrain.pricing.egress import load_egress

DILOCO = Settings(mode="diloco")  # H = 500 (the DiLoCo paper's), b = 32 (geotrain's batch_size_per_step default)
# The four GC regions of [EMJ24]'s C-8 run, two T4 GPUs each.
C8_QUOTAS = ["--clouds", "gc", "--quota", "us-central1=2", "--quota", "europe-west4=2", "--quota", "asia-east1=2",
             "--quota", "australia-southeast1=2"]


def c8(settings: Settings):
    """RoBERTa-XLM on 8 GC T4 spot VMs, two on each of four continents ([EMJ24] C-8), with the shipped inputs."""
    shipped = shipped_inputs()
    return evaluate(setup_counts(shipped.offers, "C-8", "gc"), load_profile("roberta_xlm"), shipped.network,
                    shipped.egress, settings)


def test_the_paper_defaults():
    assert DEFAULT_INNER_STEPS == 500 and DILOCO.batch_size_per_step == 32
    assert Settings().mode == "sync"


@pytest.mark.parametrize("inner_steps,batch_size_per_step", [(500, 32), (100, 64), (20, 8)])
def test_diloco_moves_tbs_over_hbn_times_the_bytes_per_sample(inner_steps, batch_size_per_step):
    settings = Settings(mode="diloco", inner_steps=inner_steps, batch_size_per_step=batch_size_per_step)
    sync, diloco = c8(Settings()), c8(settings)
    # The same all-reduce (the fp16 pseudo-gradient is as large as the gradient), once per H x b x N samples.
    assert diloco.samples_per_round == inner_steps * batch_size_per_step * 8
    assert diloco.traffic_gb_per_round == pytest.approx(sync.traffic_gb_per_round)
    assert diloco.comm_s_per_round == pytest.approx(sync.comm_s_per_round)
    ratio = 32768 / (inner_steps * batch_size_per_step * 8)  # TBS / (H b N)
    assert diloco.traffic_gb_per_million_samples == pytest.approx(ratio * sync.traffic_gb_per_million_samples)
    # All-reduce egress per sample scales the same way; data loading per sample does not change.
    def usd_per_sample(p, usd_per_hour):
        return usd_per_hour / (3600 * p.samples_per_second)

    assert usd_per_sample(diloco, diloco.egress_usd_per_hour) == \
        pytest.approx(ratio * usd_per_sample(sync, sync.egress_usd_per_hour))
    assert usd_per_sample(diloco, diloco.data_usd_per_hour) == pytest.approx(usd_per_sample(sync, sync.data_usd_per_hour))


def test_diloco_across_continents_is_faster_and_its_egress_cheaper_per_sample():
    sync, diloco = c8(Settings()), c8(DILOCO)
    # Same T_comm, 128000 instead of 32768 samples of compute per round: samples/s = S / (S / R + T_comm).
    rate = 32768 / sync.compute_s_per_round
    assert diloco.samples_per_second == pytest.approx(128000 / (128000 / rate + sync.comm_s_per_round))
    assert diloco.samples_per_second > 1.5 * sync.samples_per_second
    assert diloco.granularity > 1 > sync.granularity
    sync_egress = sync.egress_usd_per_hour / sync.samples_per_second
    diloco_egress = diloco.egress_usd_per_hour / diloco.samples_per_second
    assert diloco_egress < 0.3 * sync_egress
    assert diloco.usd_per_million_samples < sync.usd_per_million_samples
    assert sync.egress_share > 0.9  # [EMJ24]: NLP C-8 egress over 90% of the cost


def test_diloco_averages_the_pseudo_gradient_only():
    """A profile that also averages parameters in sync mode: DiLoCo's outer step keeps peers in sync instead."""
    profile = replace(PROFILE, state_averaging_every_epochs=1)
    counts = {CATALOG[0]: 2, CATALOG[2]: 2}
    sync = evaluate(counts, profile, load_network(), load_egress(), Settings())
    diloco = evaluate(counts, profile, load_network(), load_egress(), DILOCO)
    assert diloco.traffic_gb_per_round == pytest.approx(sync.traffic_gb_per_round / 2)


def test_one_vm_alone_in_diloco_mode_trains_at_its_full_rate():
    alone = evaluate({CATALOG[3]: 1}, PROFILE, load_network(), load_egress(), DILOCO)
    assert alone.samples_per_second == pytest.approx(185 * 0.95)
    assert alone.comm_s_per_round == 0 and alone.egress_usd_per_hour == 0 and alone.traffic_gb_per_million_samples == 0


SMALL_ROUNDS = Settings(mode="diloco", inner_steps=50, batch_size_per_step=32)  # S = 1600 N: communication-bound


@pytest.mark.parametrize("objective,request_,settings", [
    ("cost-per-sample", Request(max_peers=4), DILOCO),
    ("cost-per-sample", Request(max_peers=5, min_samples_per_second=150), DILOCO),
    ("cost-per-sample", Request(max_peers=5, min_samples_per_second=150, region_quota_gpus={"us-central1": 2}),
     DILOCO),
    ("cost-per-sample", Request(max_peers=4, min_samples_per_second=100), replace(DILOCO, anchor="trainer")),
    ("cost-per-sample", Request(max_peers=5, min_samples_per_second=60), SMALL_ROUNDS),
    ("cost-per-sample", Request(max_peers=4, region_quota_gpus={"us-east-1": 1, "us-central1": 1}),
     replace(SMALL_ROUNDS, spread_zones=True)),
    ("throughput", Request(max_peers=5, budget_usd_per_hour=2.5), DILOCO),
    ("throughput", Request(max_peers=4, budget_usd_per_hour=1.6, region_quota_gpus={"us-east-1": 2}), SMALL_ROUNDS),
])
def test_optimiser_matches_brute_force_in_diloco_mode(objective, request_, settings):
    profile = replace(PROFILE, data_bytes_per_sample=500_000)  # data loading per round grows with S too
    got = check_against_brute_force(Inputs(CATALOG, profile, load_network(), load_egress(), settings), request_,
                                    objective)
    assert got.samples_per_round == settings.inner_steps * settings.batch_size_per_step * got.peers


@pytest.mark.parametrize("objective,request_", [
    ("cost-per-sample", Request(max_peers=5, min_samples_per_second=100)),
    ("throughput", Request(max_peers=5, budget_usd_per_hour=2.0)),
])
@pytest.mark.parametrize("settings", [DILOCO, SMALL_ROUNDS])
def test_top_table_in_diloco_mode_is_the_best_sizes_in_order(objective, request_, settings):
    """Each size has its own round (H x b x N samples): sizes are still ranked per sample."""
    inputs = Inputs(CATALOG, PROFILE, load_network(), load_egress(), settings)
    per_size = [best for n in range(1, request_.max_peers + 1)
                if (best := brute_force(inputs, request_, objective, size=n)) is not None]
    per_size.sort(key=ranking_key(objective))
    got = plan(inputs, request_, objective=objective, top=3).candidates
    attribute = "samples_per_second" if objective == "throughput" else "usd_per_million_samples"
    assert [getattr(p, attribute) for p in got] == pytest.approx([getattr(p, attribute) for p in per_size[:3]],
                                                                 rel=1e-6)


@pytest.mark.parametrize("settings,message", [
    (dict(mode="diloco", overlap=True), "--overlap (delayed parameter updates) does not apply to --mode diloco"),
    (dict(mode="diloco", inner_steps=0), "--inner-steps is 0; expected a whole number of inner steps"),
    (dict(mode="diloco", batch_size_per_step=-1), "--batch-size-per-step is -1; expected a whole number"),
    (dict(mode="local-sgd"), "--mode is 'local-sgd'; expected one of sync, diloco"),
])
def test_bad_settings_are_planner_errors(settings, message):
    with pytest.raises(PlannerError) as error:
        Settings(**settings)
    assert message in str(error.value)


@pytest.mark.parametrize("args,message", [
    (["--mode", "diloco", "--overlap"],
     "--overlap (delayed parameter updates) does not apply to --mode diloco: its outer all-reduce blocks training"),
    (["--mode", "diloco", "--inner-steps", "0"],
     "--inner-steps is 0; expected a whole number of inner steps per outer round, at least 1"),
    (["--mode", "diloco", "--inner-steps", "-5"],
     "--inner-steps is -5; expected a whole number of inner steps per outer round, at least 1"),
    (["--mode", "diloco", "--batch-size-per-step", "0"], "--batch-size-per-step is 0; expected a whole number"),
    (["--inner-steps", "100"], "--inner-steps 100 applies only to --mode diloco"),
])
def test_bad_mode_options_exit_2_without_traceback(args, message):
    result = run_cli("plan", "--profile", "roberta_xlm", *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_diloco_plans_across_continents_where_sync_cannot(tmp_path):
    """RoBERTa-XLM on GC with two T4s per C-8 region: 400 samples/s is out of sync mode's reach."""
    sync = run_cli("plan", "--profile", "roberta_xlm", *C8_QUOTAS, "--min-samples-per-second", "400")
    assert sync.returncode == 2 and "--min-samples-per-second 400 is out of reach" in sync.stderr
    out = tmp_path / "plan.json"
    diloco = run_cli("plan", "--profile", "roberta_xlm", *C8_QUOTAS, "--min-samples-per-second", "400",
                     "--mode", "diloco", "--json", str(out))
    assert diloco.returncode == 0, diloco.stderr
    assert "mode diloco (an outer all-reduce every 500 inner steps of 32 samples per peer" in diloco.stdout
    data = json.loads(out.read_text())
    assert data["settings"]["mode"] == "diloco" and data["settings"]["inner_steps"] == 500
    best = data["candidates"][0]
    assert best["samples_per_second"] >= 400
    assert len({vm["continent"] for vm in best["vms"]}) >= 2
    assert best["samples_per_round"] == 500 * 32 * best["peers"]


def test_sync_header_and_json_name_the_mode(tmp_path):
    out = tmp_path / "plan.json"
    result = run_cli("plan", "--profile", "roberta_xlm", "--max-peers", "3", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "(560.1M parameters, TBS 32768), mode sync, objective cost-per-sample" in result.stdout
    data = json.loads(out.read_text())
    assert data["settings"] == {"mode": "sync", "overlap": False, "inner_steps": None, "batch_size_per_step": None,
                                "spread_zones": False, "spot_interruption_rate": 0.05, "anchor": "coordinator"}
    assert data["candidates"][0]["samples_per_round"] == 32768
