"""The swarm view: trainers' signed metric records, the coordinator's aggregates, `geotrain status`.

One coordinator and two trainers in two regions ("us" and "eu") train on loopback; the tests read
what an operator reads: the peers' /metrics endpoints and `geotrain status`.
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest

from geotrain.events import read_events
from geotrain.ports import free_ports
from swarm_helpers import IDLE_SWARM, Swarm, geotrain, processes_mentioning, run_script, wait_for

RUN_ID = "metrics-test"
# every peer publishes each second; `geotrain status --once` given the same waits one period for a second look
PUBLISH = ["--set", "metrics.publish_interval_s=1", "--run-id", RUN_ID]
ATTACKER = Path(__file__).with_name("metric_attacker.py")


def scrape(port: int) -> dict[str, float]:
    """{'name{labels}': value} of one /metrics endpoint."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def value(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the series of ``name`` whose labels include ``labels``."""
    total, found = 0.0, False
    for series, number in samples.items():
        series_name = series.split("{", 1)[0]
        if series_name != name:
            continue
        if all(re.search(rf'[{{,]{key}="{re.escape(text)}"', series) for key, text in labels.items()):
            total += number
            found = True
    return total if found else float("nan")


@pytest.fixture(scope="module")
def two_region_swarm(tmp_path_factory):
    directory = tmp_path_factory.mktemp("swarm-metrics")
    swarm = Swarm(directory)
    ports = dict(zip(("coordinator", "us", "eu"), free_ports(3)))  # distinct, unlike three separate looks
    try:
        # the regions "us" and "eu" are not in the price files: a config rule prices their traffic
        swarm.start_coordinator("--no-state", "--metrics-port", str(ports["coordinator"]), *PUBLISH,
                                "--set", "cost.egress_usd_per_gb=[{usd_per_gb: 0.08}]")
        for region in ("us", "eu"):
            swarm.start_trainer(region, *IDLE_SWARM, *PUBLISH, "--region", region, "--cloud", "gcp",
                                "--metrics-port", str(ports[region]), "--wait-for-peers", "2")
        wait_for(lambda: value(scrape(ports["coordinator"]), "geotrain_swarm_peers") == 2, 120,
                 "the coordinator to see both trainers' records")
        wait_for(lambda: value(scrape(ports["us"]), "geotrain_averaging_rounds_total", result="ok") >= 3, 120,
                 "three averaging rounds")
        yield swarm, ports, directory
    finally:
        swarm.stop()
        assert not processes_mentioning(str(directory)), "a peer process outlived the test"


def test_each_trainer_reports_measured_traffic_and_averaging_rounds(two_region_swarm):
    swarm, ports, directory = two_region_swarm
    parameters = next(e["parameters"] for e in read_events(directory / "us.jsonl") if e["event"] == "joined")
    us = scrape(ports["us"])
    rounds = value(us, "geotrain_averaging_rounds_total", result="ok")
    assert value(us, "geotrain_averaging_duration_seconds_count") >= rounds >= 3
    sent_to_eu = wait_for(lambda: value(scrape(ports["us"]), "geotrain_sent_bytes_total", destination_region="eu"),
                          30, "bytes attributed to the eu trainer")
    # In a round of two, each peer sends its half of the fp16 gradients (2 bytes a parameter) to the other,
    # so the measured bytes must be at least that; rounds finished since the last traffic sample are allowed for.
    assert sent_to_eu >= (rounds - 2) * parameters * 2 / 2
    assert value(us, "geotrain_received_bytes_total") > 0


def test_coordinator_aggregates_the_trainers(two_region_swarm):
    swarm, ports, directory = two_region_swarm
    coordinator = scrape(ports["coordinator"])
    assert value(coordinator, "geotrain_swarm_peers", peer_region="us", peer_cloud="gcp") == 1
    assert value(coordinator, "geotrain_swarm_peers", peer_region="eu", peer_cloud="gcp") == 1
    wait_for(lambda: value(scrape(ports["coordinator"]), "geotrain_swarm_global_epoch") >= 3, 30,
             "the swarm epoch (records lag the trainers by up to one publish period)")
    # egress between regions is priced by the config's rule, $0.08/GB; within a region it is free
    rate = wait_for(lambda: value(scrape(ports["coordinator"]), "geotrain_swarm_egress_bytes_per_second",
                                  peer_region="us", destination_region="eu"), 30, "a us->eu traffic rate")
    assert rate > 0
    coordinator = scrape(ports["coordinator"])
    cross_region = sum(number for series, number in coordinator.items()
                       if series.startswith("geotrain_swarm_egress_bytes_per_second{")
                       and re.search(r'peer_region="(\w+)"', series).group(1)
                       != re.search(r'destination_region="(\w+)"', series).group(1))
    assert value(coordinator, "geotrain_swarm_egress_cost_dollars_per_hour") == pytest.approx(
        cross_region * 3600 / 1e9 * 0.08, rel=1e-6)


def test_status_lists_every_peer_from_the_dht(two_region_swarm):
    swarm, ports, directory = two_region_swarm
    result = geotrain("status", "--once", "--json", *PUBLISH,
                      *[argument for address in swarm.initial_peers for argument in ("--initial-peers", address)],
                      timeout_s=90)
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout.splitlines()[-1])
    trainers = {row["region"]: row for row in status["peers"] if row["role"] == "trainer"}
    assert set(trainers) == {"us", "eu"} and status["trainers"] == 2
    assert all(row["samples_per_second"] > 0 and row["epoch"] >= 1 and row["last_seen_s"] < 30
               for row in trainers.values())
    assert [row["role"] for row in status["peers"]].count("coordinator") == 1

    table = geotrain("status", "--once", *PUBLISH, "--initial-peers", swarm.initial_peers[0], timeout_s=90)
    assert table.returncode == 0, table.stderr
    assert "2 trainers" in table.stdout and " us " in table.stdout and " eu " in table.stdout


def test_forged_overwritten_and_malformed_records_are_refused(two_region_swarm):
    swarm, ports, directory = two_region_swarm
    victim = next(e["peer_id"] for e in read_events(directory / "us.jsonl") if e["event"] == "joined")
    attack = run_script(ATTACKER, RUN_ID, victim, *swarm.initial_peers, timeout_s=120)
    assert attack.returncode == 0, attack.stderr
    outcome = json.loads(attack.stdout.splitlines()[-1])
    assert outcome["overwrite_accepted"] is False
    assert outcome["forged_signature_accepted"] and not any(outcome["forged_signature_accepted"])
    assert outcome["malformed_accepted"] is False

    result = geotrain("status", "--once", "--json", *PUBLISH, "--initial-peers", swarm.initial_peers[0],
                      timeout_s=90)
    status = json.loads(result.stdout.splitlines()[-1])
    rows = {row["peer_id"]: row for row in status["peers"]}
    assert "poison" not in rows
    assert 0 < rows[victim]["samples_per_second"] < 1e6, "the victim's record was replaced"
    assert value(scrape(ports["coordinator"]), "geotrain_swarm_samples_per_second") < 1e6


def test_a_flood_of_metric_records_grows_no_memory_and_the_trainers_records_still_arrive(two_region_swarm):
    """A peer floods the metric key with an oversized record, rapid rewrites of one subkey and hundreds of
    subkeys of its own: every node keeps what fits in one DHT response, and the view still follows both
    trainers. (Needs RecordLimits in geotrain.hive.dht.node.record_validators.)"""
    from geotrain.hive.dht.node import record_validators
    from geotrain.hive.dht.record_limits import Limits, RecordLimits

    assert any(isinstance(validator, RecordLimits) for validator in record_validators(RUN_ID)), \
        "RecordLimits(run_id) is not among geotrain.hive.dht.node.record_validators(run_id)"
    swarm, ports, directory = two_region_swarm
    limits, fresh, rewrites = Limits(), 350, 500  # both beyond what the limits let in

    def trainer_epochs() -> dict[str, int]:
        result = geotrain("status", "--once", "--json", *PUBLISH, "--initial-peers", swarm.initial_peers[0],
                          timeout_s=90)
        assert result.returncode == 0, result.stderr
        rows = json.loads(result.stdout.splitlines()[-1])["peers"]
        return {row["region"]: row["epoch"] for row in rows if row["region"] in ("us", "eu")}

    before = trainer_epochs()
    attack = run_script(ATTACKER, "flood", RUN_ID, str(fresh), str(rewrites), *swarm.initial_peers, timeout_s=240)
    assert attack.returncode == 0, attack.stderr
    outcome = json.loads(attack.stdout.splitlines()[-1])

    assert len(outcome["held"]) == 3, "the attacker should reach the coordinator and both trainers"
    assert outcome["oversized_bytes"] > limits.max_value_bytes
    assert not any(node["accepted"] for node in outcome["oversized"].values())
    # a node may also get the flood's records from the others (hivemind replicates and caches what peers read),
    # so what each node accepted from the attacker is bounded, not fixed
    for node in outcome["rewrites"].values():  # no more versions than the token bucket gives
        assert node["accepted"] <= limits.version_burst + limits.max_versions_per_s * node["seconds"], outcome
    assert all(node["accepted"] < fresh for node in outcome["fresh"].values()), outcome["fresh"]
    assert any(node["accepted"] for node in outcome["fresh"].values()), "the flood did not arrive"
    for node, held in outcome["held"].items():
        assert held is not None, f"{node}: its metric records no longer fit in one DHT response"
        assert held["bytes"] <= limits.max_key_bytes and held["subkeys"] < fresh, held
        assert held["honest"] >= 2, f"{node} dropped the trainers' records: {held}"
    wait_for(lambda: all(epoch > before[region] for region, epoch in trainer_epochs().items()), 90,
             "both trainers' records to report a later epoch than before the flood")
    assert "refused under DHT key metrics-test_metrics" in swarm.log("coordinator")
