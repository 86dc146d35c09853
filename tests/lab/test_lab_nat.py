"""A region behind NAT (needs root): what its NAT gateway lets through, and a trainer there that trains.

Topology: the coordinator and one trainer in ``office`` (public), one trainer in ``home`` (``nat: true``), 10 ms
one-way apart. The relay translates ``home``'s packets as a NAT gateway with address 10.77.2.254 would
(geotrain.lab.nat). Checked with plain sockets: ``home`` connects out and is seen at the gateway's address, and a
connection to ``home`` from outside is dropped, to its own address or to the gateway's. Then a swarm: the
``home`` trainer finds out at its join that no one can dial it, rejoins in client mode, trains, and ends with
the same parameters as the public one.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lab_helpers import NETPROBE, lab_run, needs_lab, spawn_geotrain, start_coordinator
from stopping import stop_processes
from geotrain.events import read_events

pytestmark = needs_lab

TOPOLOGY = """
name: office-and-home
regions: {office: {peers: 2}, home: {peers: 1, nat: true}}
links:
  office-home: {latency_ms: 10, bandwidth_mbit_s: 100}
"""
OFFICE, HOME, HOME_GATEWAY = "10.77.1.2", "10.77.2.2", "10.77.2.254"
TRAINING = ["--task", "emulated", "--preset", "tiny", "--target-batch-size", "1024", "--batch-size", "32",
            "--network-profile", "lan", "--run-id", "lab-nat", "--set", "optimizer.group_size=2"]
EPOCHS = 2


@pytest.fixture(scope="module")
def office_and_home(tmp_path_factory):
    from lab_helpers import Lab

    lab = Lab("gtlabtnat", tmp_path_factory.mktemp("lab-nat"))
    try:
        lab.up(TOPOLOGY)
        yield lab
    finally:
        lab.down()


def ask(lab: str, region: str, host: str, port: int) -> dict:
    client = lab_run(lab, region, sys.executable, str(NETPROBE), "tcp-ask", "--host", host, "--port", str(port),
                     "--seconds", "2", stdout=subprocess.PIPE, text=True)
    out, _ = client.communicate(timeout=30)
    return json.loads(out.strip().splitlines()[-1])


def whoami_server(lab: str, region: str, host: str, port: int) -> subprocess.Popen:
    server = lab_run(lab, region, sys.executable, str(NETPROBE), "tcp-whoami", "--host", host, "--port", str(port),
                     stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "ready"
    return server


def test_the_nat_gateway_lets_connections_out_and_none_in(office_and_home):
    lab = office_and_home.name
    servers = [whoami_server(lab, "office", OFFICE, 9002), whoami_server(lab, "home", HOME, 9003)]
    try:
        seen = ask(lab, "home", OFFICE, 9002)  # out: translated to the gateway's address
        assert seen.get("answer", "").startswith(f"{HOME_GATEWAY}:"), seen
        assert ask(lab, "office", HOME, 9003) == {"error": "TimeoutError"}  # in, to its own address: dropped
        assert ask(lab, "office", HOME_GATEWAY, 9003) == {"error": "TimeoutError"}  # in, unsolicited: dropped
    finally:
        stop_processes(servers)


def test_a_trainer_behind_nat_trains_in_client_mode_and_ends_equal(office_and_home, tmp_path):
    lab = office_and_home.name
    processes = []
    try:
        coordinator, initial_peers = start_coordinator(lab, "office", OFFICE, tmp_path, *TRAINING)
        processes.append(coordinator)
        events = {}
        for index, (region, address) in enumerate((("office", OFFICE), ("home", HOME)), start=1):
            events[region] = tmp_path / f"{region}.jsonl"
            arguments = ["peer", "--host", address, "--port", "0", "--events", str(events[region]), "--region", region,
                         "--preemption", "none", "--data-seed", str(index), "--threads", "1", "--wait-for-peers", "2",
                         "--max-epochs", str(EPOCHS), *TRAINING]
            for peer in initial_peers:
                arguments += ["--initial-peers", peer]
            processes.append(spawn_geotrain(lab, region, tmp_path / f"{region}.log", *arguments))
        for process in processes[1:]:
            process.wait(timeout=150)
        logs = {name: (tmp_path / f"{name}.log").read_text(errors="replace")[-3000:] for name in events}
        assert [p.returncode for p in processes[1:]] == [0, 0], logs

        joined = {region: next(e for e in read_events(path) if e["event"] == "joined") for region, path in events.items()}
        assert joined["office"]["reachability"].startswith("dialable: "), joined["office"]
        home = joined["home"]["reachability"]
        assert home.startswith("client mode: ") and f"it sees this peer at {HOME_GATEWAY}" in home, home
        finished = {region: next(e for e in read_events(path) if e["event"] == "finished")
                    for region, path in events.items()}
        assert {f["params_sha256"] for f in finished.values()} == {finished["office"]["params_sha256"]}, logs
        assert finished["home"]["samples"] > 0 and finished["office"]["averaging_payload_bytes"]["received"] > 0
    finally:
        stop_processes(processes)
