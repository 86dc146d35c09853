"""State transfers across an emulated slow link go to the nearest donor (needs root).

Region ``west`` holds the coordinator and one trainer, region ``east`` one trainer from the start and one
that joins late (its process starts with the others and joins once given the coordinator's address), region ``south`` one trainer; the regions are 60-100 ms apart at 10-20 Mbit/s. hivemind alone would have the late joiner
download from the coordinator (it announces the highest priority) across the link; geotrain's donor
choice (geotrain/hive/state/donors.py) takes it from the trainer in its own region. At the end of the run the
trainers agree on one final state, which crosses the link into a region at most once (a tree, not a star:
geotrain/hive/state/finalize.py). Every peer is started with the geotrain CLI through `geotrain lab run`.
"""

from __future__ import annotations


from lab_helpers import needs_lab, spawn_geotrain, start_coordinator, wait_for
from stopping import stop_processes
from geotrain.events import read_events

pytestmark = needs_lab

EPOCHS = 8
JOIN_AT_EPOCH = 2
TOPOLOGY = """
name: slow-links
regions: {west: {peers: 1}, east: {peers: 2}, south: {peers: 1}}
links:
  west-east: {latency_ms: 30, bandwidth_mbit_s: 20}
  west-south: {latency_ms: 50, bandwidth_mbit_s: 10}
  east-south: {latency_ms: 40, bandwidth_mbit_s: 10}
"""
ADDRESSES = {"west": "10.77.1.2", "east": "10.77.2.2", "south": "10.77.3.2"}
TRAINING = ["--task", "emulated", "--preset", "tiny", "--target-batch-size", "2048", "--batch-size", "32",
            "--network-profile", "continent", "--run-id", "lab-transfer", "--lr", "0.1",
            "--set", "optimizer.group_size=4",  # all four trainers: once the late one is in, rounds end when full
            "--set", "optimizer.matchmaking_time_s=5"]  # before it is in, three wait this long for a fourth


def _events(path, name: str) -> list[dict]:
    return [e for e in read_events(path) if e["event"] == name] if path.exists() else []


def test_a_late_joiner_and_the_final_state_come_from_the_nearest_donor(make_lab, tmp_path):
    lab = make_lab("gtlabtxfer")
    lab.up(TOPOLOGY)
    processes = []
    try:
        coordinator, initial_peers = start_coordinator(lab.name, "west", ADDRESSES["west"], tmp_path, *TRAINING)
        processes.append(coordinator)
        trainers = {"west": "west", "east": "east", "south": "south", "late": "east"}
        events = {name: tmp_path / f"{name}.jsonl" for name in trainers}

        def start(name: str, wait_for_peers: int, *joining: str) -> None:
            region = trainers[name]
            arguments = ["peer", "--host", ADDRESSES[region], "--port", "0", "--events", str(events[name]),
                         "--region", region, "--set", "metrics.publish_interval_s=1", "--preemption", "none",
                         "--data-seed", str(len(processes)), "--threads", "1", "--wait-for-peers",
                         str(wait_for_peers), "--max-epochs", str(EPOCHS), *TRAINING, *joining]
            processes.append(spawn_geotrain(lab.name, region, tmp_path / f"{name}.log", *arguments))

        joining_now = [argument for address in initial_peers for argument in ("--initial-peers", address)]
        # the late joiner starts now (imports, its model) and joins once its initial peers file appears
        late_peers = tmp_path / "late_initial_peers.txt"
        start("late", 1, "--initial-peers-file", str(late_peers), "--bootstrap-timeout", "150")
        for name in ("west", "east", "south"):
            start(name, 3, *joining_now)
        wait_for(lambda: any(e["epoch"] >= JOIN_AT_EPOCH for e in _events(events["east"], "epoch")), 150,
                  f"epoch {JOIN_AT_EPOCH}")
        partial = late_peers.with_name(late_peers.name + ".partial")
        partial.write_text("\n".join(initial_peers) + "\n")
        partial.rename(late_peers)  # whole or not at all
        for process in processes[1:]:
            process.wait(timeout=240)
        logs = {name: (tmp_path / f"{name}.log").read_text(errors="replace")[-3000:] for name in trainers}
        assert [p.returncode for p in processes[1:]] == [0] * len(trainers), logs

        peer_ids = {name: _events(events[name], "joined")[0]["peer_id"] for name in trainers}
        # the late joiner took the state from the trainer of its own region, not across the link
        loaded = _events(events["late"], "state_loaded")
        assert loaded, f"the late joiner loaded no state: {logs['late']}"
        assert (loaded[0]["donor"], loaded[0]["donor_region"]) == (peer_ids["east"], "east"), loaded[0]
        assert loaded[0]["state_epoch"] >= JOIN_AT_EPOCH

        # one final state on every trainer, and it crossed the link at most once into each region
        finished = {name: _events(events[name], "finished")[0] for name in trainers}
        assert len({f["params_sha256"] for f in finished.values()}) == 1, finished
        assert all(f["epoch"] == EPOCHS for f in finished.values()), finished
        crossings = {region: 0 for region in ADDRESSES}
        for name, region in trainers.items():
            last_epoch_s = max(e["time"] for e in _events(events[name], "epoch"))
            final = [e for e in _events(events[name], "state_download")
                     if e["result"] == "ok" and e["time"] > last_epoch_s]
            crossings[region] += sum(e["donor_region"] != region for e in final)
        assert all(count <= 1 for count in crossings.values()), f"final state transfers across the link: {crossings}"
    finally:
        stop_processes(processes)
