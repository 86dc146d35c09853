"""A swarm across two emulated regions trains to identical parameters (needs root).

The coordinator and one trainer run in region ``west``, the other trainer in ``east``, 25 ms one-way
apart at 50 Mbit/s; every peer is started with the geotrain CLI through `geotrain lab run`, as a user
would. The bytes a trainer measures it sent to the other region are checked against what the relay
carried over the link. Compute is the ``emulated`` task's tiny preset (5 ms per sample, real gradients), which keeps
the test short on 2 busy cores; an epoch still takes seconds, so the trainers meet within it.
"""

from __future__ import annotations

import json
import time

from lab_helpers import geotrain, needs_lab, spawn_geotrain, start_coordinator
from stopping import stop_processes
from geotrain.events import read_events
from geotrain.lab.relay import STATS_EVERY_S

pytestmark = needs_lab

EPOCHS = 3
TOPOLOGY = """
name: two-regions
regions: {west: {peers: 1}, east: {peers: 1}}
links:
  west-east: {latency_ms: 25, bandwidth_mbit_s: 50}
"""
ADDRESSES = {"west": "10.77.1.2", "east": "10.77.2.2"}
TRAINING = ["--task", "emulated", "--preset", "tiny", "--target-batch-size", "2048", "--batch-size", "32",
            "--network-profile", "continent", "--run-id", "lab-test", "--lr", "0.1",
            "--set", "optimizer.group_size=2"]  # two trainers: a round ends once both are in, not after 10 s


def test_two_regions_train_to_identical_parameters(make_lab, tmp_path):
    lab = make_lab("gtlabtswarm")
    lab.up(TOPOLOGY)
    processes = []
    try:
        coordinator, initial_peers = start_coordinator(lab.name, "west", ADDRESSES["west"], tmp_path, *TRAINING)
        processes.append(coordinator)
        events = {}
        for index, region in enumerate(ADDRESSES, start=1):
            events[region] = tmp_path / f"{region}.jsonl"
            arguments = ["peer", "--host", ADDRESSES[region], "--port", "0", "--events", str(events[region]),
                         "--region", region, "--set", "metrics.publish_interval_s=1",
                         "--preemption", "none", "--data-seed", str(index), "--threads", "1", "--wait-for-peers", "2",
                         "--max-epochs", str(EPOCHS), *TRAINING]
            for address in initial_peers:
                arguments += ["--initial-peers", address]
            processes.append(spawn_geotrain(lab.name, region, tmp_path / f"{region}.log", *arguments))
        for process in processes[1:]:
            process.wait(timeout=150)
        logs = {name: (tmp_path / f"{name}.log").read_text(errors="replace")[-3000:] for name in ADDRESSES}
        assert [p.returncode for p in processes[1:]] == [0, 0], logs

        finished = {region: next(e for e in read_events(path) if e["event"] == "finished")
                    for region, path in events.items()}
        assert [f["epoch"] for f in finished.values()] == [EPOCHS, EPOCHS]
        hashes = {f["params_sha256"] for f in finished.values()}
        assert len(hashes) == 1, f"parameters differ between the regions: {hashes}"
        losses = [[e["loss"] for e in read_events(path) if e["event"] == "epoch"] for path in events.values()]
        assert all(loss[-1] < loss[0] for loss in losses), f"the loss did not fall: {losses}"

        # the gradients crossed the emulated link: at least one fp16 copy of the model each way
        time.sleep(STATS_EVERY_S + 0.5)  # the relay writes its counters every 2 s
        status = geotrain("lab", "status", "--lab", lab.name, "--json")
        pipes = json.loads(status.stdout)["relay_stats"]["pipes"]
        model_bytes_fp16 = 2 * 65_536
        assert pipes["1->2"]["bytes"] > model_bytes_fp16 and pipes["2->1"]["bytes"] > model_bytes_fp16

        # What the east trainer measured it sent (its p2pd sockets' TCP counters, attributed by the records'
        # addresses) is what crossed the emulated link east->west, which the relay counted. The relay counts
        # whole IP packets (headers and ACKs too), the trainer TCP payload up to its last sample before it
        # leaves (and bytes_sent counts what TCP sent, retransmissions included): measured runs gave 0.82-1.10
        # of the relay's bytes. An estimate from the model size, or counting other sockets or both ends of a
        # connection, would fall far outside these bounds.
        sent = finished["east"]["sent_bytes_by_region"]
        assert sent.get("west", 0) >= 0.9 * sum(sent.values()), f"bytes not attributed to west: {sent}"
        ratio = sum(sent.values()) / pipes["2->1"]["bytes"]
        assert 0.7 <= ratio <= 1.25, f"east measured {sent}, the relay carried {pipes['2->1']} east->west"
    finally:
        stop_processes(processes)
