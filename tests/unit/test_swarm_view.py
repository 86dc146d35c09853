"""The swarm view's arithmetic: throughput, peers by place, ETA, churn and cost from records.

Prices come from the shipped planner files (gc us-central1 and europe-west4 t4-vm: $0.18/h spot,
$0.572/h on demand; gc egress between continents $0.08/GB); tests/unit/test_pricing.py checks them
against the planner itself.
"""

from __future__ import annotations

import pytest

from geotrain.config import ConfigError, CostConfig, EgressPrice, load_config
from geotrain.hive.dht.metric_records import MetricRecord
from geotrain.telemetry.swarm_view import SwarmView

GB = 10**9
REGIONS = {"us": "us-central1", "eu": "europe-west4", "asia": "asia-east1"}


def record(peer: str, region: str = "us", *, time: float = 100.0, epoch: int = 3, samples_per_second: float = 100.0,
           sent: dict | None = None, role: str = "trainer", instance_type: str = "t4-vm", cloud: str = "gcp",
           purchase: str | None = "spot", granularity: float | None = 2.0) -> MetricRecord:
    return MetricRecord(peer_id=peer, role=role, region=REGIONS.get(region, region), cloud=cloud,
                        instance_type=instance_type, purchase=purchase, time=time, epoch=epoch, samples_total=1000,
                        samples_per_second=samples_per_second, granularity=granularity, compute_seconds_total=10.0,
                        communication_seconds_total=5.0,
                        sent_bytes_by_region={REGIONS.get(r, r): sent_bytes for r, sent_bytes in (sent or {}).items()},
                        received_bytes_total=0, addresses=["10.0.0.1:31337"])


def test_throughput_epoch_and_places_count_trainers_only():
    view = SwarmView(CostConfig(), target_batch_size=1000)
    snapshot = view.update({"a": record("a", "us", samples_per_second=100.0, epoch=3),
                            "b": record("b", "eu", samples_per_second=50.0, epoch=4, granularity=4.0),
                            "c": record("c", "us", role="coordinator", samples_per_second=0.0, epoch=9)})
    assert snapshot.peers == 2
    assert snapshot.samples_per_second == pytest.approx(150.0)
    assert snapshot.global_epoch == 4  # the coordinator's epoch is the checkpoint's, not training progress
    assert snapshot.granularity == pytest.approx(3.0)
    assert snapshot.peers_by_place == {("us-central1", "gcp"): 1, ("europe-west4", "gcp"): 1}


def test_eta_counts_down_to_the_target_epoch():
    view = SwarmView(CostConfig(), target_batch_size=1000, target_epoch=10)
    snapshot = view.update({"a": record("a", epoch=4, samples_per_second=200.0)})
    assert snapshot.eta_seconds == pytest.approx(6 * 1000 / 200.0)
    assert SwarmView(CostConfig(), 1000, 3).update({"a": record("a", epoch=4)}).eta_seconds == 0.0
    assert SwarmView(CostConfig(), 1000, None).update({"a": record("a")}).eta_seconds is None


def test_joins_and_departures_between_looks():
    view = SwarmView(CostConfig(), target_batch_size=1000)
    first = view.update({"a": record("a"), "b": record("b")})
    second = view.update({"b": record("b"), "c": record("c")})
    assert (first.joined, first.departed) == (2, 0)
    assert (second.joined, second.departed) == (1, 1)


def test_egress_cost_from_measured_bytes_between_two_records():
    view = SwarmView(CostConfig(), target_batch_size=1000)
    before = view.update({"a": record("a", "us", time=100.0, sent={"eu": 0, "asia": 0, "us": 0}),
                          "b": record("b", "eu"), "c": record("c", "asia")})
    assert before.egress_usd_per_hour == 0.0  # one record says nothing about a rate
    after = view.update({"a": record("a", "us", time=110.0, sent={"eu": 10 * GB, "asia": 1 * GB, "us": 5 * GB}),
                         "b": record("b", "eu"), "c": record("c", "asia")})
    # per second: 1 GB to eu and 0.1 GB to asia at gc's $0.08/GB between continents, 0.5 GB within us at gc's
    # same-region price ($0.0015/GB, egress.csv)
    expected_per_hour = 3600 * (1 * 0.08 + 0.1 * 0.08 + 0.5 * 0.0015)
    assert after.egress_usd_per_hour == pytest.approx(expected_per_hour)
    assert after.egress_bytes_per_second[("us-central1", "europe-west4")] == pytest.approx(1 * GB)
    assert after.unpriced_routes == set()
    # the same record again keeps the last rate instead of dropping to zero
    again = view.update({"a": record("a", "us", time=110.0, sent={"eu": 10 * GB, "asia": 1 * GB, "us": 5 * GB}),
                         "b": record("b", "eu"), "c": record("c", "asia")})
    assert again.egress_usd_per_hour == pytest.approx(expected_per_hour)


def test_a_departed_peers_region_is_still_priced_from_the_catalog():
    view = SwarmView(CostConfig(), target_batch_size=1000)
    view.update({"a": record("a", "us", time=100.0, sent={"eu": 0})})
    # nobody is in europe-west4 any more, but the catalog knows it is gc's: $0.08/GB from us-central1
    after = view.update({"a": record("a", "us", time=110.0, sent={"eu": 10 * GB})})
    assert after.egress_usd_per_hour == pytest.approx(3600 * 1 * 0.08)


def test_instance_cost_and_cost_per_million_samples():
    view = SwarmView(CostConfig(), target_batch_size=1000)
    snapshot = view.update({"a": record("a", samples_per_second=100.0), "b": record("b", samples_per_second=100.0),
                            "c": record("c", role="coordinator", instance_type="e2-standard-4", purchase=None)})
    assert snapshot.instance_usd_per_hour == pytest.approx(0.36)  # two spot T4 VMs at $0.18/h
    assert snapshot.unpriced_peers == 1  # the coordinator's type is not in the catalog: reported, not guessed
    assert snapshot.usd_per_million_samples == pytest.approx(0.36 / (200 * 3600) * 1e6)
    assert SwarmView(CostConfig(), 1000).update({}).usd_per_million_samples is None


def test_a_record_without_purchase_is_priced_as_its_role_runs():
    view = SwarmView(CostConfig(), target_batch_size=1000)
    snapshot = view.update({"a": record("a", purchase=None),
                            "c": record("c", role="coordinator", purchase=None, samples_per_second=0.0)})
    assert snapshot.instance_usd_per_hour == pytest.approx(0.18 + 0.572)  # trainer spot, coordinator on demand


def test_most_specific_egress_rule_wins():
    cost = CostConfig(same_region_usd_per_gb=0.01, egress_usd_per_gb=[
        EgressPrice(usd_per_gb=0.09), EgressPrice(destination="australia-southeast1", usd_per_gb=0.15),
        EgressPrice(source="us-central1", destination="australia-southeast1", usd_per_gb=0.12)])
    prices = SwarmView(cost, 1000).prices
    us, eu, aus = ("gcp", "us-central1"), ("gcp", "europe-west4"), ("gcp", "australia-southeast1")
    assert prices.egress_usd_per_gb(us, us) == 0.01
    assert prices.egress_usd_per_gb(us, aus) == 0.12
    assert prices.egress_usd_per_gb(eu, aus) == 0.15
    assert prices.egress_usd_per_gb(eu, ("gcp", "asia-east1")) == 0.09


def test_a_wrong_price_table_is_a_clear_config_error(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("cost:\n  instance_usd_per_hour: {g4dn.xlarge: -1}\n  egress_usd_per_gb: [{usd_per_gb: cheap}]\n"
                    "  same_region_usd_per_gb: -0.01\n  catalog: prices.csv\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert "cost.instance_usd_per_hour" in str(error.value)
    assert "cost.egress_usd_per_gb.0.usd_per_gb" in str(error.value)
    assert "cost.same_region_usd_per_gb" in str(error.value)
    assert "cost.catalog: unknown key" in str(error.value)


def test_exported_series_follow_the_swarm():
    from prometheus_client import generate_latest

    from geotrain.telemetry.metrics import SwarmMetrics
    from geotrain.telemetry.swarm_view import export

    def series(metrics) -> list[str]:
        return [line for line in generate_latest(metrics.registry).decode().splitlines()
                if line.startswith(("geotrain_swarm_peers{", "geotrain_swarm_eta_seconds",
                                    "geotrain_swarm_cost_dollars_per_million_samples"))]

    metrics, cost = SwarmMetrics("run"), CostConfig()
    view = SwarmView(cost, target_batch_size=1000, target_epoch=10)
    export(view.update({"a": record("a", "us"), "b": record("b", "eu")}), metrics, cost)
    assert len(series(metrics)) == 4  # us, eu, an ETA, a cost per 1M samples
    export(view.update({"b": record("b", "eu")}), metrics, cost)
    peers = [line for line in series(metrics) if line.startswith("geotrain_swarm_peers{")]
    assert len(peers) == 1 and 'peer_region="europe-west4"' in peers[0]  # the us series is gone, not left behind
    export(view.update({}), metrics, cost)  # nobody left: no region, no ETA, no cost per sample
    assert series(metrics) == []


def test_unpriced_peers_and_routes_are_exported_as_counts():
    from prometheus_client import generate_latest

    from geotrain.telemetry.metrics import SwarmMetrics
    from geotrain.telemetry.swarm_view import export

    metrics, cost = SwarmMetrics("run"), CostConfig()
    view = SwarmView(cost, target_batch_size=1000)
    view.update({"a": record("a", "us", time=100.0, sent={"eu": 0, "unknown": 0})})
    export(view.update({"a": record("a", "us", time=110.0, sent={"eu": 10 * GB, "unknown": 10 * GB}),
                        "b": record("b", "eu-west-1", cloud="aws", instance_type="g4dn.xlarge")}), metrics, cost)
    text = generate_latest(metrics.registry).decode()
    assert 'geotrain_swarm_unpriced_peers{' in text and 'geotrain_swarm_unpriced_routes{' in text
    value = {line.split("{")[0]: float(line.rpartition(" ")[2]) for line in text.splitlines()
             if line.startswith(("geotrain_swarm_unpriced", "geotrain_swarm_egress_cost", "geotrain_swarm_instance"))}
    # aws g4dn.xlarge is in the catalog for us-east-1 only: eu-west-1 is unpriced, not priced as us-east-1
    assert value["geotrain_swarm_unpriced_peers"] == 1
    assert value["geotrain_swarm_instance_cost_dollars_per_hour"] == pytest.approx(0.18)
    # bytes to a peer of no known region: one unpriced route, and only the eu traffic costs money
    assert value["geotrain_swarm_unpriced_routes"] == 1
    assert value["geotrain_swarm_egress_cost_dollars_per_hour"] == pytest.approx(3600 * 1 * 0.08)


class _DHTHolding:
    """What a DHT node answers for the metrics key: subkey -> record (values as hivemind returns them)."""

    def __init__(self, entries: dict[bytes, dict]):
        from hivemind.utils import ValueWithExpiration
        self.answer = ValueWithExpiration({subkey: ValueWithExpiration(value, 1e12)
                                           for subkey, value in entries.items()}, 1e12)

    def get(self, key, latest=True):
        return self.answer


def test_one_signing_key_is_one_row_however_many_subkeys_it_signs():
    from geotrain.hive.dht.metric_records import read_records

    honest = record("a").dict()
    owner = b"[owner:ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC1]"
    # hivemind accepts any subkey that contains the signer's key: a flood of rows from one key
    forged = {owner + f"-{index}".encode(): record(f"fake{index}").dict() for index in range(50)}
    rows = read_records(_DHTHolding({owner: honest, **forged}), "run")
    assert [row.record.peer_id for row in rows.values()] == ["a"]
