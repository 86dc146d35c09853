"""What geotrain's trainer costs in throughput, next to a bare hivemind.Optimizer loop.

Both sides train the same model (CV tiny preset) on the same synthetic data with the same hivemind
settings, as swarms of the same size on this machine, one after the other, alternating, several
rounds. Throughput is measured in steady state (after the first epochs, before the end-of-run
agreement): swarm samples/s = sum over peers of samples in epochs (skip, E] / their duration.

    python benchmarks/trainer_overhead.py --output benchmarks/results/trainer_overhead.json

Target: geotrain costs at most 3% of throughput (ratio >= 0.97).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from geotrain.events import read_events

ROOT = Path(__file__).resolve().parent.parent


def steady_samples_per_second(event_files: list[Path], skip_epochs: int) -> float:
    total = 0.0
    for path in event_files:
        epochs = [e for e in read_events(path) if e["event"] == "epoch"]
        measured = [e for e in epochs if e["epoch"] > skip_epochs]
        # an epoch can be skipped by a peer that caught up by loading state: start at the last one before
        start = max(e["time"] for e in epochs if e["epoch"] <= skip_epochs)
        total += sum(e["samples"] for e in measured) / (measured[-1]["time"] - start)
    return total


def start_coordinator(directory: Path) -> tuple[subprocess.Popen, list[str]]:
    peers_file = directory / "initial_peers.txt"
    process = subprocess.Popen([sys.executable, "-m", "geotrain", "coordinator", "--port", "0", "--state-dir",
                                str(directory / "coordinator"), "--initial-peers-file", str(peers_file)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 90
    while not peers_file.exists():
        if time.monotonic() > deadline:
            raise RuntimeError("coordinator did not start")
        time.sleep(0.2)
    return process, peers_file.read_text().split()


def run_swarm(side: str, round_index: int, args, initial_peers: list[str], directory: Path) -> float:
    run_id = f"{side}-{round_index}"
    processes, event_files = [], []
    for index in range(args.peers):
        events = directory / f"{run_id}-peer{index}.jsonl"
        event_files.append(events)
        common = ["--target-batch-size", str(args.target_batch_size), "--batch-size", str(args.batch_size),
                  "--data-seed", str(index + 1)]
        peers = [x for address in initial_peers for x in ("--initial-peers", address)]
        if side == "geotrain":
            command = [sys.executable, "-m", "geotrain", "peer", "--run-id", run_id, "--task", "cv", "--preset",
                       "tiny", "--network-profile", "loopback", "--max-epochs", str(args.epochs), "--threads", "1",
                       "--events", str(events), *common, *peers]
        else:
            command = [sys.executable, str(ROOT / "benchmarks" / "bare_hivemind_peer.py"), "--run-id", run_id,
                       "--epochs", str(args.epochs), "--events", str(events), *common, *peers]
        environment = dict(os.environ, OMP_NUM_THREADS="1")
        log = open(directory / f"{run_id}-peer{index}.log", "w")
        processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment,
                                          start_new_session=True))
    for process in processes:
        try:
            process.wait(timeout=600)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
    return steady_samples_per_second(event_files, args.skip_epochs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--skip-epochs", type=int, default=2, help="epochs left out as warm-up")
    parser.add_argument("--target-batch-size", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()

    results: dict[str, list[float]] = {"geotrain": [], "bare_hivemind": []}
    with tempfile.TemporaryDirectory() as temporary:
        directory = Path(temporary)
        coordinator, initial_peers = start_coordinator(directory)
        try:
            for round_index in range(args.rounds):
                order = ("geotrain", "bare_hivemind") if round_index % 2 == 0 else ("bare_hivemind", "geotrain")
                for side in order:
                    rate = run_swarm(side, round_index, args, initial_peers, directory)
                    results[side].append(rate)
                    print(f"round {round_index + 1}: {side:<13} {rate:8.1f} samples/s", flush=True)
        finally:
            coordinator.send_signal(signal.SIGTERM)
            coordinator.wait(timeout=30)
    geotrain_median = statistics.median(results["geotrain"])
    bare_median = statistics.median(results["bare_hivemind"])
    ratio = geotrain_median / bare_median
    report = {
        "benchmark": "trainer_overhead",
        "what": "swarm samples/s, geotrain trainer vs bare hivemind.Optimizer loop, same model/data/settings",
        "setup": {"peers": args.peers, "task": "cv", "preset": "tiny", "target_batch_size": args.target_batch_size,
                  "batch_size_per_step": args.batch_size, "epochs": args.epochs, "skip_epochs": args.skip_epochs,
                  "rounds": args.rounds, "network_profile": "loopback", "machine": platform.machine(),
                  "cpus": os.cpu_count(), "device": "cpu"},
        "samples_per_second": results,
        "median_samples_per_second": {"geotrain": geotrain_median, "bare_hivemind": bare_median},
        "ratio_geotrain_over_bare": ratio,
        "target_ratio": 0.97,
        "measured_on": time.strftime("%Y-%m-%d"),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"geotrain / bare hivemind = {ratio:.3f} (median of {args.rounds} rounds each); written to {args.output}")


if __name__ == "__main__":
    main()
