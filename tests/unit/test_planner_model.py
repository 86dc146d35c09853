"""The cost and throughput arithmetic, checked by hand on a worked example."""

from __future__ import annotations

import pytest

from geotrain.pricing.catalog import Offer
from geotrain.pricing.egress import load_egress
from geotrain.planner.model import Settings, evaluate
from geotrain.planner.network import load_network
from geotrain.planner.profiles import ModelProfile


def vm(region, continent, price, spot, interruption=None, gpu="T4", count=1, instance="t4-vm", cloud="gc"):
    return Offer(cloud=cloud, region=region, continent=continent, instance_type=instance, gpu=gpu, gpu_count=count,
                 vcpus=None, price_usd_per_hour=price, spot=spot, spot_interruption_rate=interruption,
                 source="test", line=1)


PROFILE = ModelProfile(name="worked", parameters=100_000_000, bytes_per_parameter=2, target_batch_size=1000,
                       samples_per_second={"T4": 10.0}, hivemind_efficiency=0.5, round_overhead_s=10.0)
US_SPOT = vm("us-central1", "us", 0.18, True, interruption=0.1)
EU_ON_DEMAND = vm("europe-west4", "eu", 0.572, False)
COORDINATOR = vm("us-east-1", "us", 0.17, False, gpu="none", count=0, instance="c5.xlarge", cloud="aws")


def test_worked_example_two_continents():
    p = evaluate({US_SPOT: 2, EU_ON_DEMAND: 2}, PROFILE, load_network(), load_egress(), Settings(), COORDINATOR)
    # Rates: spot 10 x 0.5 (efficiency) x 0.9 (interruptions) = 4.5; on demand 10 x 0.5 = 5.0; R = 19.
    assert p.compute_s_per_round == pytest.approx(1000 / 19)  # 52.632 s
    # Each peer sends 2 M / N = 2 x 200 MB / 4 = 100 MB to each other peer. The slowest pair is US-EU:
    # 0.8 Gbit / 0.21 Gbit/s = 3.8095 s, plus 4 round trips of 103.1 ms = 0.4124 s; plus 10 s overhead.
    assert p.comm_s_per_round == pytest.approx(10 + 0.8 / 0.21 + 4 * 0.1031)  # 14.222 s
    assert p.granularity == pytest.approx((1000 / 19) / 14.221924, rel=1e-6)
    round_s = 1000 / 19 + 14.221924
    assert p.samples_per_second == pytest.approx(1000 / round_s, rel=1e-6)  # 14.958
    assert p.samples_per_second_overlap == pytest.approx(19.0)  # compute-bound: TBS / T_calc
    # Without interruptions R = 20: T_calc = 50 s.
    assert p.preemption_loss_samples_per_second == pytest.approx(1000 / (50 + 14.221924) - 1000 / round_s, rel=1e-5)
    # VMs 2 x 0.18 + 2 x 0.572 = 1.504 $/h, coordinator 0.17 $/h.
    assert p.vm_usd_per_hour == pytest.approx(1.504)
    assert p.compute_usd_per_hour == pytest.approx(1.674)
    # Egress per round: 4 US->EU and 4 EU->US peer pairs x 0.1 GB x $0.08/GB (GC between continents) = $0.064,
    # plus 4 same-region pairs x 0.1 GB x $0.0015/GB (GC same region) = $0.0006. Rounds per hour: 3600 / 66.8536.
    assert p.egress_usd_per_hour == pytest.approx(0.0646 * 3600 / round_s, rel=1e-6)  # 3.479 $/h
    assert p.usd_per_hour == pytest.approx(1.674 + 0.0646 * 3600 / round_s, rel=1e-6)  # 5.153 $/h
    assert p.usd_per_million_samples == pytest.approx(5.1528 / (14.958 * 3600) * 1e6, rel=1e-3)  # $95.69
    assert p.usd_to_train(1e6) == pytest.approx(p.usd_per_million_samples)
    assert p.hours_to_train(1e6) == pytest.approx(1e6 / 14.958 / 3600, rel=1e-3)


def test_one_vm_trains_alone_without_hivemind_or_egress():
    p = evaluate({EU_ON_DEMAND: 1}, PROFILE, load_network(), load_egress(), Settings(), COORDINATOR)
    assert p.samples_per_second == pytest.approx(10.0)  # full standalone rate, no averaging
    assert p.comm_s_per_round == 0 and p.egress_usd_per_hour == 0
    assert p.usd_per_million_samples == pytest.approx((0.572 + 0.17) / (10 * 3600) * 1e6)


def test_spread_zones_bills_inter_zone_traffic():
    network, egress = load_network(), load_egress()
    one_zone = evaluate({US_SPOT: 3}, PROFILE, network, egress, Settings())
    spread = evaluate({US_SPOT: 3}, PROFILE, network, egress, Settings(spread_zones=True))
    # 3 x 2 ordered pairs x (2 x 200 MB / 3) per round: $0.0015/GB in one zone (GC same region), $0.01 spread
    pairs_gb = 6 * (0.4 / 3)
    assert one_zone.egress_usd_per_hour == pytest.approx(pairs_gb * 0.0015 * 3600 * one_zone.samples_per_second / 1000)
    assert spread.egress_usd_per_hour == pytest.approx(pairs_gb * 0.01 * 3600 * spread.samples_per_second / 1000)


def test_data_loading_is_paid_by_each_vm_at_its_continents_price():
    profile = ModelProfile(name="x", parameters=100_000_000, bytes_per_parameter=2, target_batch_size=1000,
                           samples_per_second={"T4": 10.0}, hivemind_efficiency=0.5, round_overhead_s=10.0,
                           data_bytes_per_sample=1e6)
    eu_spot = vm("europe-west4", "eu", 0.18, True, interruption=0.1)
    p = evaluate({US_SPOT: 1, eu_spot: 1}, profile, load_network(), load_egress(), Settings())
    # 1 GB per round (1000 samples of 1 MB), read half in the US (free, next to the data) and half in the EU
    # ($0.01/GB, [EMJ24] object storage); both peers compute at the same rate.
    rounds_per_hour = 3600 * p.samples_per_second / 1000
    assert p.data_usd_per_hour == pytest.approx(0.5 * 0.01 * rounds_per_hour)
    alone = evaluate({US_SPOT: 1}, profile, load_network(), load_egress(), Settings())
    assert alone.data_usd_per_hour == 0


def test_whole_instance_figure_wins_over_per_gpu_figure():
    profile = ModelProfile(name="x", parameters=1, bytes_per_parameter=2, target_batch_size=100,
                           samples_per_second={"V100": 100.0, "8xV100": 413.0})
    dgx = vm("onprem-us", "us", 6.3, True, interruption=0.0, gpu="V100", count=8, instance="dgx-2", cloud="onprem")
    assert evaluate({dgx: 1}, profile, load_network(), load_egress()).samples_per_second == pytest.approx(413.0)


def test_state_averaging_adds_parameter_traffic():
    profile = ModelProfile(name="x", parameters=100_000_000, bytes_per_parameter=2, target_batch_size=1000,
                           samples_per_second={"T4": 10.0}, round_overhead_s=0.0, state_averaging_every_epochs=2)
    # gradients every round (200 MB) plus parameters every second round (100 MB on average)
    assert profile.bytes_averaged_per_round == pytest.approx(300e6)
