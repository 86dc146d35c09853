"""One price model for the planner and the running swarm: what `geotrain plan` predicts a swarm costs is
what the coordinator reports for that swarm, from the same files; the config overrides them; what
nothing prices is counted, not priced at 0.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from geotrain.config import ConfigError, CostConfig, EgressPrice, MetricsConfig, load_config
from geotrain.hive.dht.metric_records import MetricRecord
from geotrain.planner.model import Settings, bytes_per_pair, evaluate
from geotrain.planner.network import load_network
from geotrain.planner.profiles import load_profile
from geotrain.planner.prune import choose_coordinator
from geotrain.pricing.catalog import Offer, load_catalog
from geotrain.pricing.egress import load_egress
from geotrain.pricing.errors import InputFileError
from geotrain.pricing.price_book import PriceBook, catalog_cloud
from geotrain.telemetry.swarm_view import SwarmView

HOUR_S = 3600.0
PEER_LABELS = {"gc": "gcp"}  # what the startup scripts call the files' clouds (peers/lib/discover.sh)


def offer(cloud: str, region: str, instance_type: str, spot: bool) -> Offer:
    return next(o for o in load_catalog() if (o.cloud, o.region, o.instance_type, o.spot)
                == (cloud, region, instance_type, spot))


def make_record(peer: str, role: str, vm: Offer, time_s: float, sent: dict[str, int],
                samples_per_second: float = 0.0) -> MetricRecord:
    """The record a peer on this VM publishes: labels as the startup scripts set them, purchase as the reporter does."""
    purchase = MetricsConfig(purchase=vm.purchase).purchase_for(role)
    return MetricRecord(peer_id=peer, role=role, region=vm.region, cloud=PEER_LABELS.get(vm.cloud, vm.cloud),
                        instance_type=vm.instance_type, purchase=purchase, time=time_s, epoch=5, samples_total=0,
                        samples_per_second=samples_per_second, granularity=None, compute_seconds_total=0.0,
                        communication_seconds_total=0.0, sent_bytes_by_region=sent, received_bytes_total=0,
                        addresses=[])


def live_snapshot_of_planned_swarm(counts: dict[Offer, int], coordinator: Offer | None):
    """Plan a swarm, then feed the swarm view the records of that swarm sending the planned traffic for an hour."""
    # Reads from object storage are not in the peers' records, so the live view cannot price them: compare
    # without data loading (the planner's data cost is checked in test_planner_model).
    profile = replace(load_profile("convnext_large"), data_bytes_per_sample=0.0)
    prediction = evaluate(counts, profile, load_network(), load_egress(), Settings(), coordinator)
    trainers = [vm for vm, count in prediction.counts for _ in range(count)]
    # the planner's traffic: every round, each trainer sends 2 M / N bytes to every other trainer
    rounds_per_s = prediction.samples_per_second / profile.target_batch_size
    pair_bytes_per_s = bytes_per_pair(profile, prediction.peers) * rounds_per_s
    start, end = {}, {}
    for index, vm in enumerate(trainers):
        sent_per_s: dict[str, float] = {}
        for other_index, other in enumerate(trainers):
            if other_index != index:
                sent_per_s[other.region] = sent_per_s.get(other.region, 0.0) + pair_bytes_per_s
        share = prediction.samples_per_second / len(trainers)
        start[f"t{index}"] = make_record(f"t{index}", "trainer", vm, 1000.0, dict.fromkeys(sent_per_s, 0), share)
        end[f"t{index}"] = make_record(f"t{index}", "trainer", vm, 1000.0 + HOUR_S,
                                       {region: round(rate * HOUR_S) for region, rate in sent_per_s.items()}, share)
    if coordinator is not None:
        for records, time_s in ((start, 1000.0), (end, 1000.0 + HOUR_S)):
            records["coordinator"] = make_record("coordinator", "coordinator", coordinator, time_s, {})
    view = SwarmView(CostConfig(), profile.target_batch_size)
    view.update(start)
    return prediction, view.update(end)


def test_two_regions_cost_what_the_planner_predicts():
    catalog = load_catalog()
    us, eu = offer("gc", "us-central1", "t4-vm", True), offer("gc", "europe-west4", "t4-vm", True)
    coordinator = choose_coordinator(catalog, Settings())  # the planner's: the cheapest on-demand CPU-only VM
    assert (coordinator.cloud, coordinator.instance_type, coordinator.spot) == ("aws", "c5.xlarge", False)
    prediction, live = live_snapshot_of_planned_swarm({us: 2, eu: 2}, coordinator)
    assert live.unpriced_peers == 0 and live.unpriced_routes == set()
    # 2 spot T4 VMs at $0.18/h (US), 2 at $0.1827/h (EU, derived) and the on-demand coordinator at $0.17/h
    assert live.instance_usd_per_hour == pytest.approx(prediction.compute_usd_per_hour) == pytest.approx(0.8954)
    assert prediction.egress_usd_per_hour > 1.0  # gc's $0.08/GB between continents, not a rounding error
    assert live.egress_usd_per_hour == pytest.approx(prediction.egress_usd_per_hour, rel=1e-9)
    assert live.usd_per_hour == pytest.approx(prediction.usd_per_hour, rel=1e-9)
    assert live.usd_per_million_samples == pytest.approx(prediction.usd_per_million_samples, rel=1e-9)


def test_three_clouds_cost_what_the_planner_predicts():
    # across clouds the sender pays its internet price; a region's cloud comes from the peers there
    counts = {offer("gc", "us-central1", "t4-vm", True): 2, offer("aws", "us-east-1", "g4dn.xlarge", True): 1,
              offer("azure", "eastus", "t4-vm", False): 1}
    prediction, live = live_snapshot_of_planned_swarm(counts, offer("aws", "us-east-1", "c5.xlarge", False))
    assert live.unpriced_peers == 0 and live.unpriced_routes == set()
    assert live.instance_usd_per_hour == pytest.approx(prediction.compute_usd_per_hour)
    assert prediction.egress_usd_per_hour > 0
    assert live.egress_usd_per_hour == pytest.approx(prediction.egress_usd_per_hour, rel=1e-9)
    assert live.usd_per_hour == pytest.approx(prediction.usd_per_hour, rel=1e-9)


def test_every_route_of_the_catalog_has_the_planners_price():
    egress, prices = load_egress(), PriceBook.from_config(CostConfig())
    sites = {o.site: o for o in load_catalog()}
    for source in sites.values():
        for destination in sites.values():
            label = (PEER_LABELS.get(source.cloud, source.cloud), source.region)
            assert prices.egress_usd_per_gb(label, destination.site) == egress.usd_per_gb(source, destination), \
                f"{source.site} -> {destination.site}"


def test_config_overrides_win_over_the_files():
    cost = CostConfig(instance_usd_per_hour={"t4-vm": 0.25}, egress_usd_per_gb=[
        EgressPrice(source="us-central1", destination="europe-west4", usd_per_gb=0.05),
        EgressPrice(destination="europe-west4", usd_per_gb=0.07)])
    prices = PriceBook.from_config(cost)
    assert prices.instance_usd_per_hour("gcp", "us-central1", "t4-vm", "spot") == 0.25
    assert prices.instance_usd_per_hour("aws", "eu-west-1", "t4-vm", "on-demand") == 0.25  # any cloud and region
    assert prices.instance_usd_per_hour("aws", "us-east-1", "g4dn.xlarge", "spot") == 0.158  # the catalog's
    us, eu, asia = ("gcp", "us-central1"), ("gcp", "europe-west4"), ("gcp", "asia-east1")
    assert prices.egress_usd_per_gb(us, eu) == 0.05  # the most specific rule
    assert prices.egress_usd_per_gb(asia, eu) == 0.07
    assert prices.egress_usd_per_gb(eu, us) == 0.08  # no rule: gc between continents, from egress.csv
    assert prices.egress_usd_per_gb(us, us) == 0.0015  # rules price traffic between regions only: egress.csv's
    assert PriceBook.from_config(CostConfig(same_region_usd_per_gb=0.01)).egress_usd_per_gb(us, us) == 0.01


def test_price_files_from_the_config(tmp_path):
    catalog, egress = tmp_path / "instances.csv", tmp_path / "egress.csv"
    catalog.write_text("cloud,region,continent,instance_type,gpu,gpu_count,vcpus,on_demand_usd_per_hour,"
                       "spot_usd_per_hour,spot_interruption_rate,source\n"
                       "gc,us-central1,us,n1-standard-8,T4,1,8,0.73,0.22,,my price list\n"
                       "gc,europe-west4,eu,n1-standard-8,T4,1,8,0.80,0.24,,my price list\n")
    egress.write_text("cloud,kind,continent,usd_per_gb,source\ngc,between_continents,*,0.05,my price list\n")
    path = tmp_path / "run.yaml"
    path.write_text(f"cost:\n  catalog_path: {catalog}\n  egress_prices_path: {egress}\n")
    prices = PriceBook.from_config(load_config(path).cost)
    assert prices.instance_usd_per_hour("gcp", "europe-west4", "n1-standard-8", "spot") == 0.24
    assert prices.instance_usd_per_hour("gcp", "us-central1", "t4-vm", "spot") is None  # not in this catalog
    assert prices.egress_usd_per_gb(("gcp", "us-central1"), ("gcp", "europe-west4")) == 0.05

    with pytest.raises(InputFileError, match=r"cost\.catalog_path: cannot read .*missing\.csv"):
        PriceBook.from_config(CostConfig(catalog_path=tmp_path / "missing.csv"))


def test_what_nothing_prices_is_counted_not_priced_at_zero():
    prices = PriceBook.from_config(CostConfig())
    assert prices.instance_usd_per_hour("gcp", "us-central1", "n1-standard-8", "spot") is None  # unknown type
    # g4dn.xlarge is listed for us-east-1 only; another region's price is not assumed
    assert prices.instance_usd_per_hour("aws", "us-east-1", "g4dn.xlarge", "spot") == 0.158
    assert prices.instance_usd_per_hour("aws", "eu-west-1", "g4dn.xlarge", "spot") is None
    assert prices.instance_usd_per_hour("lambda", "us-lambda", "gpu_1x_a10", "spot") is None  # no spot market
    assert prices.egress_usd_per_gb(("aws", "us-east-1"), ("aws", "eu-west-1")) is None
    assert prices.egress_usd_per_gb(("gcp", "us-central1"), (None, "unknown")) is None

    us = offer("gc", "us-central1", "t4-vm", True)
    # a startup script's example (peers/aws/user-data.sh): a g4dn.xlarge spot VM in eu-west-1
    eu_west_1 = Offer(cloud="aws", region="eu-west-1", continent="eu", instance_type="g4dn.xlarge", gpu="T4",
                      gpu_count=1, vcpus=None, price_usd_per_hour=0.0, spot=True, spot_interruption_rate=None,
                      source="not in the catalog", line=0)
    unknown_vm = make_record("b", "trainer", eu_west_1, 100.0, {})
    view = SwarmView(CostConfig(), target_batch_size=1000)
    view.update({"a": make_record("a", "trainer", us, 100.0, {"eu-west-1": 0}), "b": unknown_vm})
    snapshot = view.update({"a": make_record("a", "trainer", us, 110.0, {"eu-west-1": 10**10}), "b": unknown_vm})
    assert snapshot.unpriced_peers == 1 and snapshot.instance_usd_per_hour == pytest.approx(0.18)
    assert snapshot.unpriced_routes == {("us-central1", "eu-west-1")} and snapshot.egress_usd_per_hour == 0.0
    assert snapshot.egress_bytes_per_second[("us-central1", "eu-west-1")] == pytest.approx(1e9)  # still shown

    # a rule prices what the files do not
    view = SwarmView(CostConfig(egress_usd_per_gb=[EgressPrice(destination="eu-west-1", usd_per_gb=0.09)]), 1000)
    view.update({"a": make_record("a", "trainer", us, 100.0, {"eu-west-1": 0}), "b": unknown_vm})
    snapshot = view.update({"a": make_record("a", "trainer", us, 110.0, {"eu-west-1": 10**10}), "b": unknown_vm})
    assert snapshot.unpriced_routes == set() and snapshot.egress_usd_per_hour == pytest.approx(3600 * 0.09)


def test_google_cloud_labels_are_the_catalogs_gc():
    prices = PriceBook.from_config(CostConfig())
    assert catalog_cloud("gcp") == catalog_cloud("GCP") == catalog_cloud("google") == catalog_cloud("gc") == "gc"
    assert catalog_cloud("AWS") == "aws"
    for label in ("gcp", "GCP", "google", "gc"):
        assert prices.instance_usd_per_hour(label, "us-central1", "t4-vm", "spot") == 0.18
        assert prices.instance_usd_per_hour(label, "US-Central1", "t4-vm", "on-demand") == 0.572
        assert prices.egress_usd_per_gb((label, "us-central1"), ("gc", "europe-west4")) == 0.08
    # same region, gcp and gc: one site, so the same-region price
    assert prices.egress_usd_per_gb(("gcp", "us-central1"), ("gc", "us-central1")) == 0.0015


def test_peers_say_how_their_vm_is_rented(tmp_path):
    assert MetricsConfig().purchase_for("trainer") == "spot"
    assert MetricsConfig().purchase_for("coordinator") == "on-demand"
    assert MetricsConfig(purchase="spot").purchase_for("coordinator") == "spot"
    path = tmp_path / "run.yaml"
    path.write_text("metrics: {purchase: preemptible}\n")
    with pytest.raises(ConfigError, match="metrics.purchase"):
        load_config(path)
