"""A swarm of two geotrain versions: trainers of an older commit and of this checkout train together.

    .venv/bin/python benchmarks/mixed_versions.py                  # against f5cc354, about 3 min on 2 cores
    .venv/bin/python benchmarks/mixed_versions.py --old v0.3 --epochs 8

geotrain keeps its commands, flags, config keys, event names and DHT wire formats, and its averagers answer under
hivemind's handler names, so peers of two versions can share one swarm while a fleet is upgraded. This checks it
on loopback: the older commit is checked out into a temporary git worktree and run with this checkout's
virtualenv (``PYTHONPATH`` set to the worktree), so only geotrain's own code differs.

Two runs, each with one trainer of each version (data seeds 1 and 2) and ``optimizer.group_size=2``:

- ``sync``: the coordinator is the old version; the trainers average gradients every epoch.
- ``diloco``: the coordinator is this checkout; the trainers average pseudo-gradients every outer round.

A run passes when both trainers exit 0, every averaging round of each trainer had both (hivemind's "Averaged
gradients with 2 peers" / an ``outer_round`` event of group size 2, one per epoch), both agreed on the final state
and end with identical parameters. Writes ``benchmarks/results/mixed_versions.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from geotrain.events import read_events  # noqa: E402

# the last commit before #31 moved the hivemind layer into subpackages and renamed its classes
DEFAULT_OLD = "f5cc354"
TRAINING = ["--task", "cv", "--preset", "tiny", "--target-batch-size", "256", "--batch-size", "32",
            "--network-profile", "loopback"]
MODES = {"sync": ("old", ["--mode", "sync"]), "diloco": ("new", ["--mode", "diloco", "--inner-steps", "8"])}
RESULTS = ROOT / "benchmarks" / "results" / "mixed_versions.json"


def start(source: Path, log: Path, *arguments: str) -> subprocess.Popen:
    """``python -m geotrain ARGUMENTS`` from the checkout at ``source``, in its own process group."""
    # hivemind logs "Averaged gradients with N peers" at DEBUG when its optimizer is not verbose
    environment = {**os.environ, "PYTHONPATH": str(source), "HIVEMIND_LOGLEVEL": "DEBUG"}
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "geotrain", *arguments], cwd=source, env=environment,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, 15)
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()


def wait_for_file(path: Path, timeout_s: float, coordinator: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if coordinator.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the coordinator wrote no address to {path} (see {path.parent}/coordinator.log)")
        time.sleep(0.2)


def rounds_with_both(mode: str, log_text: str, events: list[dict]) -> tuple[int, int]:
    """(averaging rounds with both trainers, all averaging rounds) as this trainer saw them."""
    if mode == "diloco":
        rounds = [e for e in events if e["event"] == "outer_round"]
        return sum(e.get("group_size") == 2 and e.get("result") == "ok" for e in rounds), len(rounds)
    sizes = [int(n) for n in re.findall(r"Averaged gradients with (\d+) peers", log_text)]
    skipped = log_text.count("Skipped averaging")
    return sum(size == 2 for size in sizes), len(sizes) + skipped


def run_mode(mode: str, sources: dict[str, Path], epochs: int, directory: Path) -> dict:
    coordinator_version, mode_flags = MODES[mode]
    run_dir = directory / mode
    run_dir.mkdir()
    peers_file = run_dir / "initial_peers.txt"
    run_id = f"mixed-{mode}"
    coordinator = start(sources[coordinator_version], run_dir / "coordinator.log", "coordinator", "--host",
                        "127.0.0.1", "--port", "0", "--no-state", "--state-dir", str(run_dir / "coord"),
                        "--initial-peers-file", str(peers_file), "--run-id", run_id, *TRAINING, *mode_flags)
    processes = [coordinator]
    trainers = {}
    try:
        wait_for_file(peers_file, 120, coordinator)
        for seed, version in enumerate(("old", "new"), start=1):
            events = run_dir / f"{version}.jsonl"
            trainers[version] = (start(sources[version], run_dir / f"{version}.log", "peer", "--host", "127.0.0.1",
                                       "--port", "0", "--initial-peers-file", str(peers_file), "--run-id", run_id,
                                       "--events", str(events), "--max-epochs", str(epochs), "--wait-for-peers", "2",
                                       "--data-seed", str(seed), "--threads", "1", "--preemption", "signal",
                                       "--set", "optimizer.group_size=2", *TRAINING, *mode_flags), events)
            processes.append(trainers[version][0])
        for process, _ in trainers.values():
            process.wait(timeout=600)
    finally:
        stop(processes)
    result = {"mode": mode, "coordinator": coordinator_version, "epochs": epochs, "trainers": {}}
    for version, (process, events_path) in trainers.items():
        events = read_events(events_path) if events_path.exists() else []
        finished = next((e for e in events if e["event"] == "finished"), {})
        with_both, rounds = rounds_with_both(mode, (run_dir / f"{version}.log").read_text(errors="replace"), events)
        result["trainers"][version] = {"exit_code": process.returncode, "epoch": finished.get("epoch"),
                                       "samples": finished.get("samples"), "rounds": rounds,
                                       "rounds_with_both": with_both,
                                       "final_state_agreed": finished.get("final_state_agreed"),
                                       "params_sha256": finished.get("params_sha256")}
    peers = result["trainers"].values()
    result["passed"] = (all(p["exit_code"] == 0 and p["final_state_agreed"] and p["rounds"] >= epochs
                            and p["rounds_with_both"] == p["rounds"] for p in peers)
                        and len({p["params_sha256"] for p in peers}) == 1)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", default=DEFAULT_OLD, help="the older commit (default: %(default)s)")
    parser.add_argument("--new", help="the newer commit (default: this checkout as it is)")
    parser.add_argument("--epochs", type=int, default=6, help="epochs (outer rounds) per run (default: %(default)s)")
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=list(MODES))
    parser.add_argument("--json", type=Path, default=RESULTS, help="where to write the results (default: %(default)s)")
    args = parser.parse_args(argv)
    old_commit = subprocess.run(["git", "rev-parse", "--short", args.old], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
    new_commit = subprocess.run(["git", "rev-parse", "--short", args.new or "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.strip()
    results = []
    with tempfile.TemporaryDirectory(prefix="geotrain-mixed-") as temporary:
        sources = {"old": Path(temporary) / "old", "new": Path(temporary) / "new" if args.new else ROOT}
        worktrees = [(sources["old"], old_commit)] + ([(sources["new"], new_commit)] if args.new else [])
        for worktree, commit in worktrees:
            subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(worktree), commit], cwd=ROOT,
                           check=True)
        try:
            for mode in args.modes:
                results.append(run_mode(mode, sources, args.epochs, Path(temporary)))
                trainers = results[-1]["trainers"]
                print(f"{mode}: {'passed' if results[-1]['passed'] else 'FAILED'}; "
                      + "; ".join(f"{version}: exit {p['exit_code']}, {p['rounds_with_both']} of {p['rounds']} rounds "
                                  f"with both, parameters {(p['params_sha256'] or '-')[:16]}"
                                  for version, p in trainers.items()), flush=True)
                if not results[-1]["passed"]:
                    kept = Path(tempfile.mkdtemp(prefix="geotrain-mixed-failed-"))
                    subprocess.run(["cp", "-r", str(Path(temporary) / mode), str(kept)], check=False)
                    print(f"logs kept in {kept}", flush=True)
        finally:
            for worktree, _ in worktrees:
                subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT, check=False)
    if not args.new and subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "geotrain"], cwd=ROOT).returncode:
        new_commit += " with uncommitted changes to geotrain/"
    summary = {"old_commit": old_commit, "new_commit": new_commit, "runs": results,
               "passed": all(r["passed"] for r in results)}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"results written to {args.json}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
