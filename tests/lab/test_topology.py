"""Topology files: the shipped [EMJ24] setups, and clear errors for malformed files (no root needed)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from geotrain.lab.topology import TopologyError, load_topology, parse_topology

# [EMJ24] Table 3: RTT in ms and single-stream bandwidth in Mbit/s between Google Cloud regions
EMJ24_TABLE_3 = {("us", "eu"): (103.1, 210), ("us", "asia"): (157.1, 130), ("us", "aus"): (176.0, 120),
                 ("eu", "asia"): (253.1, 80), ("eu", "aus"): (272.0, 70), ("asia", "aus"): (131.4, 160)}


def _two_regions(**link) -> dict:
    return {"regions": {"us": {"peers": 1}, "eu": {"peers": 1}},
            "links": {"us-eu": {"latency_ms": 25, "bandwidth_mbit_s": 30, **link}}}


def test_setup_c_has_table_3_figures():
    topology = load_topology("C")
    assert [r.name for r in topology.regions] == ["us", "eu", "asia", "aus"]
    for (a, b), (rtt_ms, bandwidth_mbit_s) in EMJ24_TABLE_3.items():
        link = topology.link(a, b)
        assert link.rtt_ms == pytest.approx(rtt_ms)
        assert link.bandwidth_mbit_s == bandwidth_mbit_s
        assert topology.link(b, a) == link


def test_setups_a_and_b():
    a, b = load_topology("A"), load_topology("B")
    assert [r.name for r in a.regions] == ["us"] and a.within_region.rtt_ms == pytest.approx(0.65)
    assert b.link("us", "eu").rtt_ms == pytest.approx(103.1)


def test_a_region_behind_nat_is_kept_through_the_labs_state():
    data = {"regions": {"us": {"peers": 1}, "home": {"peers": 1, "nat": True}},
            "links": {"us-home": {"latency_ms": 5, "bandwidth_mbit_s": 100}}}
    topology = parse_topology(data, "lab.yaml")
    assert [region.nat for region in topology.regions] == [False, True]
    assert parse_topology(topology.to_dict(), "state").regions[1].nat is True


def test_setup_spreads_peers_evenly_like_emj24():
    assert [r.peers for r in load_topology("C").with_peers(8).regions] == [2, 2, 2, 2]
    assert [r.peers for r in load_topology("C").with_peers(6).regions] == [2, 2, 1, 1]
    assert [r.peers for r in load_topology("B").with_peers(4).regions] == [2, 2]


@pytest.mark.parametrize("data, message", [
    ({"regions": {"us": {}}, "links": {"us-eu": {"latency_ms": 1, "bandwidth_mbit_s": 1}}},
     r"region 'eu' in pair 'us-eu' is not in regions"),
    (_two_regions(latency_ms=-5), r"link 'us-eu': latency_ms is -5; expected a number >= 0"),
    (_two_regions(bandwidth_mbit_s=0), r"bandwidth_mbit_s is 0; expected a number > 0"),
    (_two_regions(bandwidth_mbit_s="fast"), r"bandwidth_mbit_s is 'fast'; expected a number"),
    ({"regions": {"us": {}, "eu": {}, "asia": {}}, "links": {"us-eu": {"latency_ms": 1, "bandwidth_mbit_s": 1}}},
     r"no link for pair\(s\) us-asia, eu-asia"),
    ({"regions": {"us": {}, "eu": {}}, "links": {"us-eu": {"latency_ms": 1, "bandwidth_mbit_s": 1},
                                                 "eu-us": {"latency_ms": 2, "bandwidth_mbit_s": 1}}},
     r"pair 'eu-us' is given twice"),
    ({"regions": {"us": {}}, "links": {"us-us": {"latency_ms": 1, "bandwidth_mbit_s": 1}}},
     r"joins a region to itself"),
    ({"regions": {"us": {}, "eu": {}}, "links": {"us": {"latency_ms": 1, "bandwidth_mbit_s": 1}}},
     r"link 'us' is not a pair"),
    ({"regions": {"US-East": {}}}, r"region name 'US-East' is not valid"),
    ({"regions": {"us": {"peers": -1}}}, r"peers is -1; expected a whole number >= 0"),
    ({"regions": {"us": {}, "eu": {}}, "links": {"us-eu": {"latency_ms": 1}}}, r"bandwidth_mbit_s is missing"),
    ({"regions": {"us": {}, "eu": {}}, "links": {"us-eu": {"latency_ms": 1, "bandwidth_mbit_s": 1, "rtt": 2}}},
     r"unknown key\(s\) rtt"),
    ({"regions": {"us": {}, "eu": {"nat": "yes"}}, "links": {"us-eu": {"latency_ms": 1, "bandwidth_mbit_s": 1}}},
     r"region 'eu': nat is 'yes'; expected true or false"),
    ({"regions": {"us": {"nat": True}, "eu": {}}, "links": {"us-eu": {"latency_ms": 1, "bandwidth_mbit_s": 1}}},
     r"region 'us' is the first region, which holds the coordinator"),
    ({"links": {}}, r"'regions' is missing"),
    ({"regions": {"us": {}}, "zones": {}}, r"unknown key\(s\) zones"),
    (["us", "eu"], r"expected a mapping with regions and links"),
])
def test_malformed_topology_is_explained(data, message):
    with pytest.raises(TopologyError, match=message):
        parse_topology(data, "lab.yaml")


def test_unreadable_and_invalid_files(tmp_path):
    with pytest.raises(TopologyError, match=r"cannot read topology .*nowhere.yaml.*shipped topologies A, B, C"):
        load_topology(tmp_path / "nowhere.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("regions: {us: [\n")
    with pytest.raises(TopologyError, match=r"broken.yaml is not valid YAML at line"):
        load_topology(broken)


def test_lab_up_with_a_malformed_topology_exits_2_naming_the_problem(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("regions: {us: {}}\nlinks: {us-eu: {latency_ms: 1, bandwidth_mbit_s: 1}}\n")
    result = subprocess.run([sys.executable, "-m", "geotrain", "lab", "up", "--lab", "gtlabtbad", "--topology",
                             str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "geotrain lab up:" in result.stderr and "Traceback" not in result.stderr


def _without_root() -> list[str]:
    """As root, a user namespace without a uid mapping makes the command an ordinary user (euid 65534)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("unshare") is None:
        pytest.skip("runs as root and `unshare` (util-linux) is missing to drop it")
    return ["unshare", "--user"]


@pytest.mark.parametrize("action", [["up", "--topology", "B"], ["down"], ["run", "us", "--", "true"]])
def test_lab_without_root_says_it_needs_root(action):
    result = subprocess.run([*_without_root(), sys.executable, "-m", "geotrain", "lab", *action],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert f"geotrain lab {action[0]} needs root (network namespaces); run it with sudo" in result.stderr
    assert "Traceback" not in result.stderr
