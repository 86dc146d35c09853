"""The lab's contract, measured with plain Python sockets run through `geotrain lab run` (needs root).

- a round trip between two regions takes the configured RTT (twice the one-way latency), within 10%;
- one TCP stream between them gets the configured bandwidth, within 15% (30 Mbit/s: a rate the relay
  sustains on 2 busy cores; docs/lab.md gives the relay's measured limits);
- `geotrain lab down` leaves no namespace, link, relay or process behind, also after the relay was
  SIGKILLed and the state file deleted, and is safe to repeat.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time

import pytest

from lab_helpers import NETPROBE, Lab, geotrain, lab_run, needs_lab, nothing_left
from geotrain.lab.network import LabNames, namespace_pids, relay_pids

pytestmark = needs_lab

LATENCY_MS = 25.0
BANDWIDTH_MBIT_S = 30.0
TOPOLOGY = f"""
name: two-regions
regions: {{west: {{peers: 1}}, east: {{peers: 1}}}}
links:
  west-east: {{latency_ms: {LATENCY_MS}, bandwidth_mbit_s: {BANDWIDTH_MBIT_S}}}
"""
EAST = "10.77.2.2"  # region 2 of the lab: 10.77.2.0/24


@pytest.fixture(scope="module")
def two_regions(tmp_path_factory):
    """One lab for the measurements of this module, taken down (and checked clean) at the end."""
    lab = Lab("gtlabtnet", tmp_path_factory.mktemp("lab"))
    try:
        lab.up(TOPOLOGY)
        yield lab.name
    finally:
        lab.down()
        assert not nothing_left(lab.name), f"lab down left {nothing_left(lab.name)}"


def _serve(lab: str, region: str, *probe: str) -> subprocess.Popen:
    server = lab_run(lab, region, sys.executable, str(NETPROBE), *probe, stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "ready"
    return server


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def test_round_trip_between_regions_takes_the_configured_rtt(two_regions):
    server = _serve(two_regions, "east", "udp-echo", "--host", EAST, "--port", "9400")
    try:
        client = subprocess.run([sys.executable, "-m", "geotrain", "lab", "run", "--lab", two_regions, "west", "--",
                                 sys.executable, str(NETPROBE), "rtt", "--host", EAST, "--port", "9400",
                                 "--count", "40"], capture_output=True, text=True, timeout=60)
    finally:
        _stop(server)
    samples = json.loads(client.stdout)["rtt_ms"]
    assert len(samples) >= 35, f"echoes lost: {client.stdout}{client.stderr}"
    configured_rtt_ms = 2 * LATENCY_MS
    assert statistics.median(samples) == pytest.approx(configured_rtt_ms, rel=0.10)


def test_one_tcp_stream_gets_the_configured_bandwidth(two_regions):
    sink = _serve(two_regions, "east", "tcp-sink", "--host", EAST, "--port", "9401", "--seconds", "6",
                  "--warmup", "2")
    try:
        source = lab_run(two_regions, "west", sys.executable, str(NETPROBE), "tcp-source", "--host", EAST,
                         "--port", "9401", "--seconds", "10")
        output, _ = sink.communicate(timeout=60)
        source.wait(timeout=30)
    finally:
        _stop(sink)
    measured = json.loads(output)
    assert measured["mbit_s"] == pytest.approx(BANDWIDTH_MBIT_S, rel=0.15)


def test_lab_run_passes_the_exit_code_and_says_where_it_runs(two_regions):
    result = subprocess.run([sys.executable, "-m", "geotrain", "lab", "run", "--lab", two_regions, "east", "--",
                             "sh", "-c", "echo $GEOTRAIN_LAB_REGION $GEOTRAIN_LAB_ADDRESS; exit 7"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 7
    assert result.stdout.split() == ["east", EAST]


def test_operator_errors_are_one_line_with_exit_code_2(two_regions):
    unknown = geotrain("lab", "run", "--lab", two_regions, "mars", "--", "true")
    assert unknown.returncode == 2
    assert "region 'mars' is not in lab 'gtlabtnet'; expected one of west, east" in unknown.stderr
    again = geotrain("lab", "up", "--lab", two_regions, "--topology", "B")
    assert again.returncode == 2 and "is already up; run geotrain lab down --lab gtlabtnet first" in again.stderr
    not_up = geotrain("lab", "run", "--lab", "gtlabtnone", "west", "--", "true")
    assert not_up.returncode == 2
    assert "lab 'gtlabtnone' is not up; run geotrain lab up --lab gtlabtnone --topology FILE" in not_up.stderr


def test_down_cleans_up_after_a_killed_relay_and_a_lost_state_file(make_lab):
    lab = make_lab("gtlabtkill")
    lab.up(TOPOLOGY)
    names = LabNames(lab.name)
    sleeper = lab_run(lab.name, "west", "sleep", "600")  # a peer someone forgot
    try:
        deadline = time.monotonic() + 10
        while sleeper.pid not in namespace_pids(names.region("west")) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in relay_pids(names):
            os.kill(pid, signal.SIGKILL)
        names.state_path.unlink()
        status = geotrain("lab", "status", "--lab", lab.name)
        assert status.returncode == 2 and "is not up" in status.stderr

        result = lab.down()
        assert result.returncode == 0, result.stderr
        assert "namespace gtlabtkill-hub" in result.stdout
        assert not nothing_left(lab.name)
        assert sleeper.wait(timeout=10) is not None, "a process started in the lab outlived lab down"
        again = lab.down()
        assert again.returncode == 0 and "nothing to remove" in again.stdout
    finally:
        _stop(sleeper)
