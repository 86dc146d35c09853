"""The optimiser's answer equals a brute-force search over every configuration of small catalogs."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from geotrain.pricing.catalog import Offer
from geotrain.pricing.egress import load_egress
from geotrain.planner.errors import PlannerError
from geotrain.planner.model import Settings, evaluate
from geotrain.planner.network import load_network
from geotrain.planner.profiles import ModelProfile
from geotrain.planner.problem import Inputs, Request, ranking_key, satisfies
from geotrain.planner.solve import plan

PROFILE = ModelProfile(name="test", parameters=200_000_000, bytes_per_parameter=2, target_batch_size=32768,
                       samples_per_second={"T4": 80, "A10": 185}, hivemind_efficiency=0.5, round_overhead_s=20.0)


def offer(cloud, region, continent, gpu, price, spot, line, interruption=None):
    return Offer(cloud=cloud, region=region, continent=continent, instance_type=f"{gpu.lower()}-vm", gpu=gpu,
                 gpu_count=1, vcpus=None, price_usd_per_hour=price, spot=spot,
                 spot_interruption_rate=interruption, source="test", line=line)


# Two continents, two clouds, spot and on-demand, a faster GPU: small enough to enumerate.
CATALOG = [
    offer("gc", "us-central1", "us", "T4", 0.18, True, 1),
    offer("gc", "us-central1", "us", "T4", 0.572, False, 1),
    offer("gc", "europe-west4", "eu", "T4", 0.15, True, 2, interruption=0.10),
    offer("aws", "us-east-1", "us", "A10", 0.45, True, 3),
    offer("azure", "eastus", "us", "T4", 0.40, False, 4),
]


def brute_force(inputs: Inputs, request: Request, objective: str, size: int | None = None):
    """Best configuration by exhaustive enumeration (of exactly ``size`` VMs if given), with the planner's
    coordinator rule."""
    allowed = [o for o in inputs.offers if standalone(o)]
    on_demand = [o for o in inputs.offers if not o.spot]
    coordinator = None
    if inputs.settings.anchor == "coordinator":
        coordinator = min(on_demand, key=lambda o: (o.price_usd_per_hour, o.gpu_count, o.cloud, o.region,
                                                    o.instance_type))
    best = None
    for counts in itertools.product(range(request.max_peers + 1), repeat=len(allowed)):
        if not 1 <= sum(counts) <= request.max_peers or (size is not None and sum(counts) != size):
            continue
        config = {o: c for o, c in zip(allowed, counts) if c}
        if inputs.settings.anchor == "trainer" and not any(not o.spot for o in config):
            continue
        if any(sum(c * o.gpu_count for o, c in config.items() if o.region == region) > quota
               for region, quota in request.region_quota_gpus.items()):
            continue
        prediction = evaluate(config, inputs.profile, inputs.network, inputs.egress, inputs.settings, coordinator)
        if satisfies(prediction, request) and (best is None or
                                               ranking_key(objective)(prediction) < ranking_key(objective)(best)):
            best = prediction
    return best


def standalone(o: Offer) -> bool:
    return o.gpu in PROFILE.samples_per_second


SCENARIOS = [
    ("cost-per-sample", Request(max_peers=4), Settings()),
    ("cost-per-sample", Request(max_peers=5, min_samples_per_second=150), Settings()),
    ("cost-per-sample", Request(max_peers=5, min_samples_per_second=150, region_quota_gpus={"us-central1": 2}),
     Settings()),
    ("cost-per-sample", Request(max_peers=4, min_samples_per_second=120, budget_usd_per_hour=2.0), Settings(overlap=True)),
    ("cost-per-sample", Request(max_peers=4, min_samples_per_second=100), Settings(anchor="trainer")),
    ("cost-per-sample", Request(max_peers=4, region_quota_gpus={"us-east-1": 1, "us-central1": 1}),
     Settings(spread_zones=True)),
    ("throughput", Request(max_peers=5, budget_usd_per_hour=2.5), Settings()),
    ("throughput", Request(max_peers=4, budget_usd_per_hour=1.6, region_quota_gpus={"us-east-1": 2}), Settings()),
    ("throughput", Request(max_peers=4, budget_usd_per_hour=3.0), Settings(overlap=True, anchor="trainer")),
]


# Each VM reads its share of the samples from object storage: free in the US, $0.01/GB elsewhere.
READS_DATA = replace(PROFILE, data_bytes_per_sample=500_000)


@pytest.mark.parametrize("objective,request_,settings,profile", [
    *[(*scenario, PROFILE) for scenario in SCENARIOS],
    ("cost-per-sample", Request(max_peers=5, min_samples_per_second=150, region_quota_gpus={"us-central1": 2}),
     Settings(), READS_DATA),
    ("throughput", Request(max_peers=4, budget_usd_per_hour=1.6), Settings(), READS_DATA),
])
def test_optimiser_matches_brute_force(objective, request_, settings, profile):
    check_against_brute_force(Inputs(CATALOG, profile, load_network(), load_egress(), settings), request_, objective)


def check_against_brute_force(inputs, request_, objective):
    """The plan's best configuration scores what the exhaustive search's does, and meets the request."""
    expected = brute_force(inputs, request_, objective)
    got = plan(inputs, request_, objective=objective).best
    if objective == "throughput":
        assert got.samples_per_second == pytest.approx(expected.samples_per_second, rel=1e-6)
    else:
        assert got.usd_per_million_samples == pytest.approx(expected.usd_per_million_samples, rel=1e-6)
    assert satisfies(got, request_)
    return got


def test_every_swarm_size_is_the_best_of_its_size():
    inputs = Inputs(CATALOG, PROFILE, load_network(), load_egress(), Settings())
    request = Request(max_peers=4, min_samples_per_second=60)
    result = plan(inputs, request, top=request.max_peers)
    assert len(result.candidates) == 4
    for candidate in result.candidates:
        expected = brute_force(inputs, request, "cost-per-sample", size=candidate.peers)
        assert candidate.usd_per_million_samples == pytest.approx(expected.usd_per_million_samples, rel=1e-6)


def test_spreading_over_continents_is_chosen_only_when_a_quota_forces_it():
    inputs = Inputs(CATALOG[:3], PROFILE, load_network(), load_egress(), Settings())
    free = plan(inputs, Request(max_peers=6, min_samples_per_second=150)).best
    assert len({o.region for o, _ in free.counts}) == 1
    forced = plan(inputs, Request(max_peers=6, min_samples_per_second=150,
                                  region_quota_gpus={"us-central1": 3, "europe-west4": 3})).best
    assert {o.region for o, _ in forced.counts} == {"us-central1", "europe-west4"}
    assert forced.egress_usd_per_hour > 0


def test_infeasible_throughput_floor_names_max_peers():
    inputs = Inputs(CATALOG, PROFILE, load_network(), load_egress(), Settings())
    with pytest.raises(PlannerError, match=r"--min-samples-per-second 5000 is out of reach.*--max-peers 4"):
        plan(inputs, Request(max_peers=4, min_samples_per_second=5000))


def test_infeasible_budget_names_the_budget():
    inputs = Inputs(CATALOG, PROFILE, load_network(), load_egress(), Settings())
    with pytest.raises(PlannerError) as error:
        plan(inputs, Request(max_peers=4, budget_usd_per_hour=0.2))
    assert str(error.value) == ("no configuration fits the budget (--budget-usd-per-hour 0.2): the cheapest one, "
                                "1x gc/europe-west4 t4-vm spot with the coordinator azure/eastus t4-vm on-demand "
                                "($0.4/h), costs $0.550/h; raise --budget-usd-per-hour to at least 0.55")


def test_infeasible_budget_with_trainer_anchor_has_no_coordinator_and_respects_quotas():
    inputs = Inputs(CATALOG, PROFILE, load_network(), load_egress(), Settings(anchor="trainer"))
    with pytest.raises(PlannerError) as error:
        plan(inputs, Request(max_peers=4, budget_usd_per_hour=0.2, region_quota_gpus={"eastus": 0}))
    message = str(error.value)
    assert "the cheapest one, 1x gc/us-central1 t4-vm on-demand, costs $0.572/h" in message
    assert "coordinator" not in message


def test_budget_and_floor_together_name_both():
    inputs = Inputs(CATALOG, PROFILE, load_network(), load_egress(), Settings())
    with pytest.raises(PlannerError, match=r"--budget-usd-per-hour 1 and --min-samples-per-second 250 cannot both"):
        plan(inputs, Request(max_peers=8, budget_usd_per_hour=1.0, min_samples_per_second=250))


def test_filters_that_leave_nothing_name_the_filter():
    inputs = Inputs(CATALOG, PROFILE, load_network(), load_egress(), Settings())
    with pytest.raises(PlannerError, match=r"--regions us-central1 leaves no offer.*us-east-1"):
        plan(inputs, Request(clouds=frozenset({"aws"}), regions=frozenset({"us-central1"})))


def test_a_name_the_catalog_does_not_have_is_refused_not_ignored():
    inputs = Inputs(CATALOG, PROFILE, load_network(), load_egress(), Settings())
    with pytest.raises(PlannerError, match=r"--clouds: the catalog has no cloud 'lambda'; its clouds are aws, azure, gc"):
        plan(inputs, Request(clouds=frozenset({"lambda", "gc"})))
    with pytest.raises(PlannerError, match=r"--continents: the catalog has no continent 'eur' \(did you mean eu\?\)"):
        plan(inputs, Request(continents=frozenset({"eur"})))


def test_spot_only_catalog_has_no_anchor():
    spot_only = [o for o in CATALOG if o.spot]
    inputs = Inputs(spot_only, PROFILE, load_network(), load_egress(), Settings())
    with pytest.raises(PlannerError, match="on-demand VM for durable state"):
        plan(inputs, Request(max_peers=3))


@pytest.mark.parametrize("objective,request_", [
    ("cost-per-sample", Request(max_peers=5, min_samples_per_second=100)),
    ("throughput", Request(max_peers=5, budget_usd_per_hour=2.0)),
])
def test_top_table_is_the_best_sizes_in_order(objective, request_):
    inputs = Inputs(CATALOG, PROFILE, load_network(), load_egress(), Settings())
    per_size = []
    for n in range(1, request_.max_peers + 1):
        best = brute_force(inputs, request_, objective, size=n)
        if best is not None:
            per_size.append(best)
    per_size.sort(key=ranking_key(objective))
    got = plan(inputs, request_, objective=objective, top=3).candidates
    attribute = "samples_per_second" if objective == "throughput" else "usd_per_million_samples"
    assert [getattr(p, attribute) for p in got] == pytest.approx([getattr(p, attribute) for p in per_size[:3]],
                                                                 rel=1e-6)


def test_vms_without_a_figure_or_too_small_are_left_out_with_a_line():
    small = offer("aws", "us-east-1", "us", "T4", 0.10, True, 5)
    small = replace(small, instance_type="g4dn.xlarge", memory_gb=16.0)
    a10g = replace(offer("aws", "us-east-1", "us", "A10G", 0.30, True, 6), instance_type="g5.xlarge")
    profile = replace(PROFILE, min_vm_memory_gb=24.0)
    inputs = Inputs([*CATALOG, small, a10g], profile, load_network(), load_egress(), Settings())
    result = plan(inputs, Request(max_peers=3))
    assert all(o.instance_type not in ("g4dn.xlarge", "g5.xlarge") for p in result.candidates for o, _ in p.counts)
    assert result.left_out == [
        "aws g5.xlarge (A10G): profile 'test' has no samples/s for this GPU (add a measured figure to use them)",
        "aws g4dn.xlarge (T4): 16 GB of memory, below the 24 GB that 'test' needs (min_vm_memory_gb)"]
    # Without the minimum, the cheap small VM is used.
    cheap = plan(Inputs([*CATALOG, small], PROFILE, load_network(), load_egress(), Settings()), Request(max_peers=3))
    assert any(o.instance_type == "g4dn.xlarge" for p in cheap.candidates for o, _ in p.counts)
    assert cheap.left_out == []


def test_the_coordinator_is_a_cpu_vm_even_when_the_filters_allow_none():
    cpu = replace(offer("aws", "us-east-1", "us", "T4", 0.17, False, 7), instance_type="c5.xlarge", gpu="none",
                  gpu_count=0)
    inputs = Inputs([*CATALOG, cpu], PROFILE, load_network(), load_egress(), Settings())
    everywhere = plan(inputs, Request(max_peers=2))
    assert everywhere.coordinator == cpu and everywhere.coordinator_note == ""
    gc_only = plan(inputs, Request(max_peers=2, clouds=frozenset({"gc"})))
    assert gc_only.coordinator == cpu and "no CPU-only VM" in gc_only.coordinator_note
    assert gc_only.best.coordinator_usd_per_hour == 0.17  # not the $0.572/h T4 of gc (40% of 8 spot T4s)
