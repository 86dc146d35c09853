"""The planner's input files: shipped defaults load and name their sources; malformed ones name line and column."""

from __future__ import annotations

import csv

import pytest

from geotrain.pricing.catalog import DEFAULT_CATALOG, load_catalog
from geotrain.pricing.egress import DEFAULT_EGRESS, load_egress
from geotrain.pricing.errors import InputFileError as PlannerError  # the planner's and the price files' base
from geotrain.planner.network import DEFAULT_NETWORK, load_network
from geotrain.planner.profiles import available_profiles, load_profile, read_profile

HEADER = ("cloud,region,continent,instance_type,gpu,gpu_count,vcpus,on_demand_usd_per_hour,spot_usd_per_hour,"
          "spot_interruption_rate,source\n")
GOOD = "gc,us-central1,us,t4-vm,T4,1,8,0.572,0.180,,test\n"


def write(tmp_path, text, name="instances.csv"):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("path", [DEFAULT_CATALOG, DEFAULT_EGRESS, DEFAULT_NETWORK])
def test_every_shipped_line_names_its_source(path):
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    for row in csv.DictReader(lines):
        assert row["source"].strip(), f"{path}: a line without a source: {row}"


def test_shipped_inputs_load():
    offers = load_catalog()
    assert {o.cloud for o in offers} >= {"gc", "aws", "azure"}
    egress = load_egress()
    egress.check_clouds({o.cloud for o in offers})
    network = load_network()
    us = next(o for o in offers if o.region == "us-central1")
    eu = next(o for o in offers if o.region == "europe-west4")
    link = network.link(us, eu)
    assert (link.bandwidth_gbit_per_s, link.rtt_ms) == (0.21, 103.1)  # [EMJ24] Table 3
    assert egress.usd_per_gb(us, eu) == 0.08
    assert set(available_profiles()) >= {"convnext_large", "roberta_xlm"}


def test_malformed_price_names_line_and_column(tmp_path):
    path = write(tmp_path, "# comment\n" + HEADER + GOOD + "aws,us-east-1,us,g4dn,T4,1,,cheap,0.158,,test\n")
    with pytest.raises(PlannerError) as error:
        load_catalog(path)
    assert f"{path}:4, column 'on_demand_usd_per_hour'" in str(error.value)
    assert "'cheap' is not a number" in str(error.value)


def test_wrong_field_count_names_the_line(tmp_path):
    path = write(tmp_path, HEADER + GOOD + "gc,us-central1,us,t4-vm,T4,1\n")
    with pytest.raises(PlannerError, match=r"instances.csv:3: has 6 fields but the header has 11"):
        load_catalog(path)


def test_missing_header_column_is_named(tmp_path):
    path = write(tmp_path, HEADER.replace(",source", "") + GOOD.rsplit(",", 1)[0] + "\n")
    with pytest.raises(PlannerError, match=r"header lacks column\(s\) source"):
        load_catalog(path)


@pytest.mark.parametrize("line,column,expected", [
    ("gc,us-central1,us,t4-vm,T4,0,,0.5,0.1,,x\n", "gpu_count", "needs gpu_count >= 1"),
    ("gc,us-central1,us,t4-vm,T4,1,,,,,x\n", None, "neither on_demand_usd_per_hour nor spot_usd_per_hour"),
    ("gc,us-central1,us,t4-vm,T4,1,,0.5,-1,,x\n", "spot_usd_per_hour", "out of range"),
    ("gc,us-central1,us,t4-vm,T4,1,,0.5,0.1,1.5,x\n", "spot_interruption_rate", "between 0 and 0.99"),
    ("gc,us-central1,us,t4-vm,T4,1,,0.5,0.1,,\n", "source", "value is missing"),
    ("gc,us-central1,eu,t4-vm,T4,1,,0.5,0.1,,x\n", "continent", "a region lies on one continent"),
])
def test_bad_catalog_values(tmp_path, line, column, expected):
    path = write(tmp_path, HEADER + GOOD + line)
    with pytest.raises(PlannerError) as error:
        load_catalog(path)
    assert f"{path}:3" in str(error.value) and expected in str(error.value)
    if column:
        assert f"column {column!r}" in str(error.value)


def test_egress_unknown_kind_is_named(tmp_path):
    path = write(tmp_path, "cloud,kind,continent,usd_per_gb,source\ngc,outbound,*,0.1,x\n", "egress.csv")
    with pytest.raises(PlannerError, match=r"egress.csv:2, column 'kind': 'outbound' is not allowed"):
        load_egress(path)


def test_network_without_a_matching_line_says_what_to_add(tmp_path):
    path = write(tmp_path, "scope,cloud_a,place_a,cloud_b,place_b,bandwidth_gbit_per_s,rtt_ms,source\n"
                           "same-region,gc,*,gc,*,6.35,0.65,x\n", "network.csv")
    offers = load_catalog()
    us = next(o for o in offers if o.region == "us-central1")
    eu = next(o for o in offers if o.region == "europe-west4")
    with pytest.raises(PlannerError, match="no between-regions line matches gc/us-central1 <-> gc/europe-west4"):
        load_network(path).link(us, eu)


def test_later_network_line_overrides_on_a_tie(tmp_path):
    text = DEFAULT_NETWORK.read_text() + "between-regions,*,us,*,eu,1.0,90,measured by me\n"
    network = load_network(write(tmp_path, text, "network.csv"))
    offers = load_catalog()
    us = next(o for o in offers if o.region == "us-central1")
    eu = next(o for o in offers if o.region == "europe-west4")
    assert network.link(us, eu).bandwidth_gbit_per_s == 1.0


def test_profile_errors_name_the_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: bad\nparameters: -5\nbytes_per_parameter: 2\ntarget_batch_size: 8\n"
                    "samples_per_second: {T4: 10}\n")
    with pytest.raises(PlannerError, match=r"parameters is -5; expected a number >= 1"):
        read_profile(path)
    with pytest.raises(PlannerError, match=r"no profile named 'nope'; available: .*convnext_large"):
        load_profile("nope", tmp_path)


def test_catalog_cloud_without_egress_prices_is_named(tmp_path):
    path = write(tmp_path, "cloud,kind,continent,usd_per_gb,source\ngc,inter_region,*,0.01,x\n"
                           "*,data_loading,*,0.01,x\n", "egress.csv")
    with pytest.raises(PlannerError, match=r"no egress prices for cloud\(s\) aws"):
        load_egress(path).check_clouds({"gc", "aws"})


def test_every_cloud_sells_t4s_on_four_continents_with_labelled_prices():
    """Geo-distributed AWS and Azure plans use regional prices (derived from [EMJ24] Fig. 11b), not US ones."""
    t4 = [o for o in load_catalog() if o.instance_type == "t4-vm" and o.spot]
    for cloud in ("gc", "aws", "azure"):
        mine = {o.continent: o for o in t4 if o.cloud == cloud}
        assert set(mine) == {"us", "eu", "asia", "oce"}, cloud
        assert all(o.source.startswith("derived:") for c, o in mine.items() if c != "us")
        assert mine["us"].source.startswith("[EMJ24] Table 1")


def test_memory_column_is_optional_and_shipped_for_the_small_aws_vms(tmp_path):
    assert load_catalog(write(tmp_path, HEADER + GOOD))[0].memory_gb is None  # catalogs without the column
    small = {o.instance_type: o.memory_gb for o in load_catalog() if o.cloud == "aws"}
    assert small["g4dn.xlarge"] == 16 and small["g5.xlarge"] == 16


def test_same_region_traffic_and_data_loading_are_priced():
    egress = load_egress()
    offers = load_catalog()
    us = next(o for o in offers if o.region == "us-central1")
    eu = next(o for o in offers if o.region == "europe-west4")
    assert egress.usd_per_gb(us, us) == 0.0015  # derived from [EMJ24]'s internal egress
    assert egress.usd_per_gb(us, us, spread_zones=True) == 0.01  # [EMJ24] Table 1 inter-zone
    assert egress.data_loading_usd_per_gb(eu) == 0.01 and egress.data_loading_usd_per_gb(us) == 0.0
