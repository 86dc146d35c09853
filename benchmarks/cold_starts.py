"""No split swarms: cold starts of a coordinator and four trainers at once, in the lab, counting splits (root).

    sudo .venv/bin/python benchmarks/cold_starts.py               # 100 cold starts, about 50 min on 2 cores
    sudo .venv/bin/python benchmarks/cold_starts.py --starts 5

hivemind issue 624: four peers started with the same initial peers formed two separate DHTs. Here the lab is up
once (topology C: us, eu, asia, aus with [EMJ24] Table 3's links); each cold start launches, at the same moment,
the coordinator in ``us`` and one trainer in each region, every trainer waiting for the coordinator's address
file (``--initial-peers-file``, as `geotrain local` and the docker entrypoint start them), so that all four join
within moments of each other. Each trainer waits for 4 trainers announced in its DHT (``--wait-for-peers 4``);
a split is a trainer that did not see all four within the join timeout (``training.wait_for_peers_timeout_s``,
30 s). A start ends when every trainer has begun training (its ``training`` event); everything is stopped before
the next one (SIGKILL: how peers leave is not measured here), which uses a new run id and new ports.

Writes ``benchmarks/results/cold_starts.json``: ``cold_starts``, ``splits``, and the seconds from the launch to
the last trainer's start of training (median and max).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from geotrain.events import read_events  # noqa: E402

LAB = "gtlabcold"
REGIONS = {"us": "10.77.1.2", "eu": "10.77.2.2", "asia": "10.77.3.2", "aus": "10.77.4.2"}
JOIN_TIMEOUT_S = 30
TRAINING = ["--task", "emulated", "--preset", "tiny", "--target-batch-size", "256", "--batch-size", "32",
            "--network-profile", "intercontinental"]
TRAINER_ONLY = ["--threads", "1", "--preemption", "none"]


def geotrain(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "geotrain", *arguments], capture_output=True, text=True, timeout=120)


def launch(region: str, log: Path, *arguments: str) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "geotrain", "lab", "run", "--lab", LAB, region, "--",
                                 sys.executable, "-m", "geotrain", *arguments], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def stop(processes: list[subprocess.Popen]) -> None:
    """SIGKILL to each peer's process group (the peer and its hivemind daemons): how it leaves is not measured."""
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    for process in processes:
        process.wait()


def cold_start(number: int, directory: Path) -> dict:
    run_dir = directory / f"start-{number}"
    run_dir.mkdir()
    peers_file = run_dir / "initial_peers.txt"
    run_id = f"cold-{number}"
    started = time.time()
    processes = [launch("us", run_dir / "coordinator.log", "coordinator", "--host", REGIONS["us"], "--port", "0",
                        "--no-state", "--state-dir", str(run_dir / "coord"), "--initial-peers-file", str(peers_file),
                        "--run-id", run_id, *TRAINING)]
    events = {}
    for region, address in REGIONS.items():
        events[region] = run_dir / f"{region}.jsonl"
        processes.append(launch(region, run_dir / f"{region}.log", "peer", "--host", address, "--port", "0",
                                "--initial-peers-file", str(peers_file), "--events", str(events[region]),
                                "--run-id", run_id, "--wait-for-peers", str(len(REGIONS)), "--max-epochs", "1",
                                "--set", f"training.wait_for_peers_timeout_s={JOIN_TIMEOUT_S}", *TRAINING,
                                *TRAINER_ONLY))
    training: dict[str, float] = {}
    deadline = time.monotonic() + JOIN_TIMEOUT_S + 90
    try:
        while len(training) < len(REGIONS) and time.monotonic() < deadline:
            for region, path in events.items():
                if region not in training and path.exists():
                    found = [e["time"] for e in read_events(path) if e["event"] == "training"]
                    if found:
                        training[region] = found[0]
            time.sleep(0.2)
    finally:
        stop(processes)
    logs = {region: (run_dir / f"{region}.log").read_text(errors="replace") for region in REGIONS}
    # the trainer's warning when fewer than --wait-for-peers trainers are announced in its DHT in time
    split = sorted(region for region in REGIONS
                   if region not in training or "trainers joined within" in logs[region])
    kept = None
    if split:  # keep what shows why, outside the run's temporary directory
        kept = Path(tempfile.gettempdir()) / "geotrain-cold-start-splits" / f"start-{number}"
        shutil.copytree(run_dir, kept, dirs_exist_ok=True)
    return {"start": number, "split_trainers": split, "logs": None if kept is None else str(kept),
            "seconds_to_all_training": max(training.values()) - started if len(training) == len(REGIONS) else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=100)
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "cold_starts.json")
    args = parser.parse_args()
    up = geotrain("lab", "up", "--lab", LAB, "--topology", "C")
    if up.returncode != 0:
        raise SystemExit(f"geotrain lab up failed:\n{up.stdout}\n{up.stderr}")
    results = []
    summary = summarize(results)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a stopped benchmark still takes its lab down
    try:
        with tempfile.TemporaryDirectory(prefix="geotrain-cold-starts-") as directory:
            for number in range(1, args.starts + 1):
                results.append(cold_start(number, Path(directory)))
                last = results[-1]
                print(f"start {number}: splits {last['split_trainers'] or 'none'}, all training after "
                      f"{last['seconds_to_all_training'] or float('nan'):.1f} s", flush=True)
                summary = summarize(results)
                args.output.write_text(json.dumps(summary, indent=1) + "\n")  # what a stopped run measured
    finally:
        geotrain("lab", "down", "--lab", LAB)
    print(json.dumps({k: v for k, v in summary.items() if k != "starts"}, indent=1))
    return 0 if summary["splits"] == 0 else 1


def summarize(results: list[dict]) -> dict:
    times = [r["seconds_to_all_training"] for r in results if r["seconds_to_all_training"] is not None]
    return {"cold_starts": len(results), "splits": sum(1 for r in results if r["split_trainers"]),
            "topology": "C", "trainers": len(REGIONS), "join_timeout_s": JOIN_TIMEOUT_S,
            "seconds_to_all_training": {"median": statistics.median(times) if times else None,
                                        "max": max(times) if times else None},
            "starts": results}


if __name__ == "__main__":
    sys.exit(main())
