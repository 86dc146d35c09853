"""The churn soak's schedule and its measurement, before any lab exists (no root, no processes)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks.churn_soak import (END_GUARD_EPOCHS, KILL, NOTICE, REJOIN_ALLOWANCE_S, RESTART, ChurnError,
                                   build_parser, checkpoint_problems, current_holders, epoch_problems,
                                   expected_notices, main, measure_soak, nearest_donor_bound, plan_churn,
                                   restored_checkpoint, soak_epochs, soak_plan)
from geotrain.lab.bench import add_bench_arguments, plan_benchmark

SLOTS = ["peer-1-us", "peer-2-eu", "peer-3-asia", "peer-4-aus"]


def _plan(*arguments: str):
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    return plan_benchmark(parser.parse_args(["--setup", "C-4", *arguments]))


# --- the schedule ---------------------------------------------------------------------------------------

def test_a_seed_gives_one_schedule_and_another_seed_another():
    first = plan_churn(SLOTS, 2.0, 600, 10, 8, seed=1)
    assert plan_churn(SLOTS, 2.0, 600, 10, 8, seed=1) == first
    assert plan_churn(SLOTS, 2.0, 600, 10, 8, seed=2).actions != first.actions


@pytest.mark.parametrize("rate, duration_s, time_scale", [(2.0, 600, 8), (0.5, 900, 8), (6.0, 1200, 1)])
def test_the_rate_is_notices_per_trainer_per_emulated_hour(rate, duration_s, time_scale):
    schedule = plan_churn(SLOTS, rate, duration_s, 10, time_scale, seed=3)
    emulated_hours = duration_s * time_scale / 3600
    assert schedule.notices == round(rate * len(SLOTS) * emulated_hours)
    assert schedule.notices == expected_notices(rate, len(SLOTS), duration_s, time_scale)


def test_no_trainer_gets_a_notice_while_it_is_down():
    rejoin_delay_s = 20
    for seed in range(20):
        schedule = plan_churn(SLOTS, 2.0, 900, rejoin_delay_s, 8, seed=seed)
        by_slot: dict[str, list[float]] = {}
        for action in schedule.actions:
            if action.slot is not None:
                by_slot.setdefault(action.slot, []).append(action.at_s)
        for times in by_slot.values():
            gaps = [b - a for a, b in zip(times, times[1:])]
            assert all(gap >= rejoin_delay_s + REJOIN_ALLOWANCE_S - 1e-6 for gap in gaps), (seed, times)


def test_one_kill_and_one_coordinator_restart_inside_the_run():
    schedule = plan_churn(SLOTS, 2.0, 600, 10, 8, seed=5)
    kills = [a for a in schedule.actions if a.kind == KILL]
    restarts = [a for a in schedule.actions if a.kind == RESTART]
    assert len(kills) == 1 and kills[0].slot in SLOTS
    assert len(restarts) == 1 and restarts[0].slot is None
    assert all(0 <= a.at_s <= schedule.window_s < schedule.duration_s for a in schedule.actions)
    assert schedule.window_s / 3 <= restarts[0].at_s <= 2 * schedule.window_s / 3  # a checkpoint before it
    assert [a.at_s for a in schedule.actions] == sorted(a.at_s for a in schedule.actions)


def test_no_churn_is_the_baseline():
    schedule = plan_churn(SLOTS, 0.0, 60, 10, 8, seed=1)
    assert schedule.actions == ()


@pytest.mark.parametrize("rate, duration_s, rejoin_delay_s, message", [
    (-1.0, 600, 10, r"--churn -1: expected notices per trainer per emulated hour, a number >= 0"),
    (2.0, 100, 30, r"--duration 100 s is too short for --rejoin-delay 30 s.*give --duration >= 180"),
    (2.0, 0, 10, r"--duration 0: expected seconds > 0"),
    (2.0, 600, -5, r"--rejoin-delay -5: expected seconds >= 0"),
    (60.0, 600, 10, r"--churn 60 asks for 320 notices.*at most about \d+ fit"),
])
def test_bad_requests_are_explained(rate, duration_s, rejoin_delay_s, message):
    with pytest.raises(ChurnError, match=message):
        plan_churn(SLOTS, rate, duration_s, rejoin_delay_s, 8, seed=1)


def test_soak_epochs_follow_the_duration():
    plan = _plan()
    assert plan.epochs == 4  # the bench's plan, without the soak's --duration
    short, long = soak_epochs(plan, 150), soak_epochs(plan, 600)
    assert long > short > plan.warmup_epochs + END_GUARD_EPOCHS
    assert 25 <= long - plan.warmup_epochs - END_GUARD_EPOCHS <= 40  # C-4 at time scale 8: 16-20 s per round


def test_the_soak_takes_the_bench_setup_options_and_its_epochs_from_the_duration():
    parser = build_parser()
    args = parser.parse_args(["--setup", "C-4", "--time-scale", "4", "--lab", "gtlabsoak", "--duration", "600",
                              "--churn", "2"])
    plan = soak_plan(args)
    assert (plan.setup, plan.time_scale, args.lab, args.churn) == ("C-4", 4, "gtlabsoak", 2.0)
    assert plan.epochs == soak_epochs(plan_benchmark(args), 600)
    assert soak_plan(parser.parse_args(["--setup", "C-4", "--duration", "600", "--epochs", "7"])).epochs == 7
    with pytest.raises(SystemExit):  # a soak without --duration
        parser.parse_args(["--setup", "C-4"])
    bench = argparse.ArgumentParser()
    add_bench_arguments(bench)
    for soak_only in (["--duration", "600"], ["--churn", "2"], ["--churn-seed", "3"], ["--rejoin-delay", "5"]):
        with pytest.raises(SystemExit):  # geotrain bench runs no soak
            bench.parse_args(["--setup", "C-4", *soak_only])


@pytest.mark.parametrize("arguments, message", [
    (["--churn", "-1"], "--churn -1: expected notices per trainer per emulated hour, a number >= 0"),
    (["--duration", "100", "--rejoin-delay", "30", "--churn", "2"],
     "--duration 100 s is too short for --rejoin-delay 30 s"),
    (["--duration", "nan"], "--duration nan: expected seconds > 0"),
    (["--setup", "C4"], "--setup 'C4': expected TOPOLOGY-PEERS"),
])
def test_the_soak_refuses_a_request_that_cannot_run_with_one_line_and_exit_code_2(arguments, message, capsys):
    argv = ["--setup", "C-4", "--duration", "600", *arguments]
    assert main(argv) == 2  # before any lab is brought up: no root needed to be refused
    err = capsys.readouterr().err
    assert err.startswith("churn soak: ") and message in err and len(err.strip().splitlines()) == 1


# --- the measurement, from hand-written events ----------------------------------------------------------

def _epochs(peer_start_s: float, epochs: list[int], samples: int = 1024, step_s: float = 10.0) -> list[dict]:
    return [{"event": "epoch", "time": peer_start_s + step_s * n, "epoch": e, "samples": samples}
            for n, e in enumerate(epochs, start=1)]


def _finished(time_s: float, epoch: int, sha: str, stopped: bool = False) -> dict:
    return {"event": "finished", "time": time_s, "epoch": epoch, "params_sha256": sha, "stopped_by_request": stopped}


def _incarnation(slot: str, region: str, index: int, events: list[dict], started_s: float = 0.0,
                 ended_by: str | None = None, ended_s: float | None = None) -> dict:
    return {"slot": slot, "region": region, "index": index, "name": slot if index == 0 else f"{slot}.r{index}",
            "events": events, "started_unix_s": started_s, "ended_by": ended_by, "ended_unix_s": ended_s,
            "exit_code": 0}


def _swarm(final_shas=("a" * 64, "a" * 64), rejoin_training_epoch=3) -> list[dict]:
    us = [{"event": "training", "time": 0.0, "epoch": 0}, *_epochs(0, [1, 2, 3, 4, 5, 6]),
          _finished(61, 6, final_shas[0])]
    eu_first = [{"event": "training", "time": 0.0, "epoch": 0}, *_epochs(0, [1, 2]),
                {"event": "finished", "time": 25.0, "epoch": 2, "params_sha256": "b" * 64, "stopped_by_request": True}]
    eu_rejoin = [{"event": "joined", "time": 32.0},
                 {"event": "state_download", "time": 38.0, "donor": "12D3Koo", "donor_region": "us",
                  "result": "ok", "bytes": 21_000_000, "seconds": 8.0},
                 {"event": "state_loaded", "time": 38.5, "epoch": rejoin_training_epoch, "state_epoch": 3,
                  "donor_region": "us"},
                 {"event": "training", "time": 38.6, "epoch": rejoin_training_epoch},
                 {"event": "contributing", "time": 39.5, "epoch": rejoin_training_epoch, "samples": 64},
                 {"event": "epoch", "time": 50.0, "epoch": 5, "samples": 0},
                 {"event": "epoch", "time": 55.0, "epoch": 6, "samples": 512},
                 _finished(62, 6, final_shas[1])]
    return [_incarnation("peer-1-us", "us", 0, us),
            _incarnation("peer-2-eu", "eu", 0, eu_first, ended_by=NOTICE, ended_s=20.0),
            _incarnation("peer-2-eu", "eu", 1, eu_rejoin, started_s=30.0)]


def _measure(incarnations, before=None, after=(), restored=None):
    topology = _plan().topology
    return measure_soak(incarnations, topology, warmup_epochs=1, checkpoints_before=before,
                        checkpoints_after=list(after), restored=restored)


def test_a_rejoin_is_timed_to_its_first_contributed_epoch_and_bounded_by_the_nearest_donor():
    measured = _measure(_swarm())
    [rejoin] = measured["rejoins"]
    assert rejoin["to_state_loaded_s"] == pytest.approx(8.5)
    assert rejoin["to_contributing_s"] == pytest.approx(9.5)  # its first samples counted toward the swarm's
    assert rejoin["to_first_epoch_s"] == pytest.approx(25.0)  # the epoch with samples, not the empty one
    topology = _plan().topology
    link = topology.link("eu", "us")  # us holds a trainer and the coordinator; asia and aus have slower links
    expected_s = 21_000_000 * 8 / (link.bandwidth_mbit_s * 1e6) + link.latency_ms / 1000
    assert nearest_donor_bound(21_000_000, "eu", topology) == (pytest.approx(expected_s), "us")
    assert rejoin["bound_s"] == pytest.approx(expected_s)
    assert rejoin["first_epoch_ratio"] == pytest.approx(25.0 / expected_s)
    assert rejoin["contributing_ratio"] == pytest.approx(9.5 / expected_s)
    assert rejoin["joined_contributing_ratio"] == pytest.approx((9.5 - 2.0) / expected_s)  # joined 2 s in
    assert rejoin["download_s"] == 8.0 and rejoin["download_ratio"] == pytest.approx(8.0 / expected_s)
    assert rejoin["to_joined_s"] == pytest.approx(2.0) and rejoin["state_downloads"] == 1
    assert measured["epochs_monotonic"] and measured["parameters"]["identical"]
    assert measured["parameters"]["trainers"] == ["peer-1-us", "peer-2-eu.r1"]  # the preempted one is not asked


def test_the_bound_counts_only_the_regions_that_held_the_current_state_when_the_download_began():
    # the US trainer was killed: the coordinator there offered its last checkpoint, so the nearest current
    # donors were in Europe; a rejoin's own predecessor, and a rejoin yet to load the state, held nothing
    topology = _plan().topology
    incarnations = [_incarnation("peer-1-us", "us", 0, [], ended_by="kill", ended_s=10.0),
                    _incarnation("peer-2-eu", "eu", 0, []),
                    _incarnation("peer-3-asia", "asia", 1, [{"event": "state_loaded", "time": 40.0}], started_s=30.0)]
    assert current_holders(20.0, incarnations, topology, but="peer-1-us.r1") == {"eu": 1}
    assert current_holders(5.0, incarnations, topology, but="peer-1-us.r1") == {"us": 2, "eu": 1}
    assert current_holders(45.0, incarnations, topology, but="peer-1-us.r1") == {"eu": 1, "asia": 1}
    link = topology.link("us", "eu")
    expected_s = 21_000_000 * 8 / (link.bandwidth_mbit_s * 1e6) + link.latency_ms / 1000
    bound = nearest_donor_bound(21_000_000, "us", topology, current_holders(20.0, incarnations, topology,
                                                                            but="peer-1-us.r1"))
    assert bound == (pytest.approx(expected_s), "eu")


def test_a_striped_download_is_bounded_by_the_states_size_not_the_bytes_two_donors_sent_at_once():
    incarnations = _swarm()
    [download] = [e for e in incarnations[2]["events"] if e["event"] == "state_download"]
    plain = _measure(incarnations)["rejoins"][0]
    download.update(bytes=23_500_000, state_bytes=download["bytes"], stripes={"a": 12_000_000, "b": 11_500_000})
    striped = _measure(incarnations)["rejoins"][0]
    assert striped["state_bytes"] == plain["state_bytes"] and striped["bound_s"] == pytest.approx(plain["bound_s"])


def test_a_download_after_the_last_epoch_is_the_agreements_and_a_reload_while_training_counts():
    incarnations = _swarm()
    events = incarnations[2]["events"]
    final = {"event": "state_download", "time": 60.0, "result": "ok", "bytes": 21_000_000, "seconds": 4.0}
    events.insert(len(events) - 1, final)  # before its finished event: the end-of-run agreement's
    assert _measure(incarnations)["rejoins"][0]["state_downloads"] == 1
    reload = {**final, "time": 52.0}  # between its epochs: it fell behind and loaded again
    events.insert(4, reload)
    assert _measure(incarnations)["rejoins"][0]["state_downloads"] == 2


def test_swarm_samples_count_every_incarnation():
    measured = _measure(_swarm())
    # epochs 2..6 from the first epoch-1 boundary (t=10) to epoch 6 (t=55, the rejoin's): samples of all files
    assert measured["measured_epochs"] == [2, 6]
    assert measured["samples"] == 5 * 1024 + 1024 + 512
    assert measured["swarm_samples_per_second"] == pytest.approx((5 * 1024 + 1024 + 512) / 45.0)


def test_an_epoch_that_goes_backwards_is_found():
    events = _epochs(0, [1, 2, 4, 3])
    assert epoch_problems("peer-1-us", events) == ["peer-1-us: epoch at epoch 3 after epoch at epoch 4"]
    assert epoch_problems("peer-1-us", _epochs(0, [1, 2, 2])) != []
    measured = _measure(_swarm(rejoin_training_epoch=1))  # the rejoin started below its slot's epoch 2
    assert not measured["epochs_monotonic"]
    assert any("peer-2-eu.r1" in p for p in measured["epoch_problems"])


def test_a_lost_checkpoint_is_found():
    before = [{"version": 1, "epoch": 2}, {"version": 2, "epoch": 4}]
    assert checkpoint_problems(before, before + [{"version": 3, "epoch": 6}], {"version": 2, "epoch": 4}) == []
    lost = checkpoint_problems(before, [{"version": 1, "epoch": 2}, {"version": 3, "epoch": 6}],
                               {"version": 2, "epoch": 4})
    assert lost == ["checkpoint version 2 (epoch 4) was lost"]
    backwards = checkpoint_problems(before, before + [{"version": 3, "epoch": 3}], {"version": 2, "epoch": 4})
    assert backwards == ["checkpoint version 3 holds epoch 3, below version 2's epoch 4"]
    stale = checkpoint_problems(before, before, {"version": 1, "epoch": 2})
    assert stale and "not the newest, version 2" in stale[0]
    assert checkpoint_problems(before, before, None) != []
    measured = _measure(_swarm(), before=before, after=[{"version": 1, "epoch": 2}],
                        restored={"version": 2, "epoch": 4})
    assert measured["checkpoints_kept"] is False
    unfinished = measure_soak(_swarm(), _plan().topology, 1, before, before, None, restart_completed=False)
    assert unfinished["checkpoints_kept"] is False
    assert _measure(_swarm())["checkpoints_kept"] is None  # no restart (the baseline): nothing to say


def test_the_restored_checkpoint_is_read_from_the_coordinators_log():
    log = "10:00:01 geotrain.coordinator INFO restored checkpoint version 7: epoch 14 (/tmp/x/checkpoint-000007.pt)\n"
    assert restored_checkpoint(log) == {"version": 7, "epoch": 14}
    assert restored_checkpoint("no checkpoint yet; the state will come from the trainers") is None


def test_different_parameters_at_the_end_are_found():
    measured = _measure(_swarm(final_shas=("a" * 64, "c" * 64)))
    assert not measured["parameters"]["identical"]
    assert "parameters differ" in measured["parameters"]["problems"][0]
    swarm = _swarm()
    swarm[2]["events"] = [e for e in swarm[2]["events"] if e["event"] != "finished"]  # alive, but did not finish
    assert not _measure(swarm)["parameters"]["identical"]


def test_an_incarnation_is_reported_without_its_process():
    import threading

    from benchmarks.churn_soak import Incarnation

    class Running:  # what subprocess.Popen holds: a lock, which cannot be copied into a report
        lock = threading.Lock()

    incarnation = Incarnation("peer-3-eu", "eu", 1, Path("/tmp/peer-3-eu.r1.jsonl"), 12.5, process=Running())
    data = incarnation.to_dict()
    assert data["name"] == "peer-3-eu.r1" and data["events_path"] == "/tmp/peer-3-eu.r1.jsonl"
    assert "process" not in data
    json.dumps(data)


def test_the_trainer_time_lost_runs_from_the_notice_to_the_replacements_first_counted_samples():
    incarnations = _swarm()
    incarnations[1]["ended_unix_s"] = 24.0  # the bench's SIGTERM to peer-2-eu
    measured = _measure(incarnations)
    assert measured["trainer_seconds_lost"] == pytest.approx(39.5 - 24.0)  # its rejoin contributed from t=39.5
    assert measured["interruption_fraction"] == pytest.approx(15.5 / (2 * 45.0))  # 2 slots over the 45 s measured
    events = incarnations[2]["events"]
    events[:] = [e for e in events if e["event"] != "contributing"]  # a run from before that event
    assert _measure(incarnations)["trainer_seconds_lost"] == pytest.approx(55.0 - 24.0)  # its first epoch's end
    del events[-2:]  # a replacement that never contributed: lost until the run's last epoch
    assert _measure(incarnations)["trainer_seconds_lost"] == pytest.approx(60.0 - 24.0)
