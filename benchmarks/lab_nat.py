"""A trainer behind NAT against the same trainer with a public address, in the lab (needs root).

    sudo python benchmarks/lab_nat.py                 # about 8 min on 2 shared cores
    sudo python benchmarks/lab_nat.py --repeats 1

Topology: ``office`` holds the coordinator and two trainers, ``home`` one trainer, [EMJ24]'s us-eu link between
them (51.55 ms one way, 210 Mbit/s; Table 3). The same `geotrain bench` run (compute emulated, see
geotrain/lab/bench.py) twice, side by side in turn: ``home`` public, and ``home`` behind NAT (``nat: true``,
geotrain/lab/nat.py), where its trainer finds out at its join that nobody can dial it and trains in client mode.
Writes ``benchmarks/results/lab_nat.json``: per run the swarm's samples/s and each trainer's (its epochs after the
warm-up), and how each joined (its ``joined`` event's ``reachability``); the table goes to docs/deployment.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from geotrain.events import read_events  # noqa: E402

TOPOLOGY = """
name: office
regions:
  office: {{peers: 2, continent: us}}
  home: {{peers: 1, continent: eu{nat}}}
links:
  office-home: {{latency_ms: 51.55, bandwidth_mbit_s: 210}}
"""


def trainer_figures(run_dir: Path, warmup_epochs: int) -> list[dict]:
    """Each trainer's region, how it joined, and its samples/s over its epochs after the warm-up."""
    trainers = []
    for path in sorted(run_dir.glob("peer-*.jsonl")):
        events = read_events(path)
        epochs = [e for e in events if e["event"] == "epoch" and e["epoch"] > warmup_epochs]
        joined = next((e for e in events if e["event"] == "joined"), {})
        wall_s = sum(e["wall_s"] for e in epochs)
        trainers.append({"region": path.stem.split("-", 2)[2], "reachability": joined.get("reachability"),
                         "samples_per_second": sum(e["samples"] for e in epochs) / wall_s if wall_s else None})
    return trainers


def run(nat: bool, directory: Path, epochs: int) -> dict:
    topology = directory / ("nat.yaml" if nat else "public.yaml")
    topology.write_text(TOPOLOGY.format(nat=", nat: true" if nat else ""))
    run_dir, out = directory / f"run-{'nat' if nat else 'public'}", directory / "bench.json"
    result = subprocess.run([sys.executable, "-m", "geotrain", "bench", "--setup", "office-3", "--topology",
                             str(topology), "--epochs", str(epochs), "--run-dir", str(run_dir), "--json", str(out)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"geotrain bench failed:\n{result.stdout}\n{result.stderr}")
    bench = json.loads(out.read_text())
    measured = bench["measured"]
    return {"home_behind_nat": nat, "swarm_samples_per_second": measured["swarm_samples_per_second"],
            "params_identical": measured["params_identical"], "comm_s_per_round": measured["comm_s_per_round"],
            "trainers": trainer_figures(run_dir, bench["warmup_epochs"])}


def summarize(runs: list[dict]) -> dict:
    """Medians over the runs of each kind: the swarm's samples/s as `geotrain bench` measures it (one window for
    the whole swarm) and as the sum of its trainers' own rates, and the ``home`` trainer's; NAT over public."""
    def median(nat: bool, figure) -> float:
        return statistics.median(figure(r) for r in runs if r["home_behind_nat"] == nat)

    figures = {"swarm_samples_per_second": lambda r: r["swarm_samples_per_second"],
               "sum_of_trainers_samples_per_second": lambda r: sum(t["samples_per_second"] for t in r["trainers"]),
               "home_trainer_samples_per_second":
                   lambda r: next(t["samples_per_second"] for t in r["trainers"] if t["region"] == "home")}
    summary = {}
    for name, figure in figures.items():
        public, nat = median(False, figure), median(True, figure)
        summary[name] = {"public": public, "nat": nat, "nat_over_public": nat / public}
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2, help="pairs of runs, public then NAT (default 2)")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "lab_nat.json")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="geotrain-lab-nat-") as directory:
        for _ in range(args.repeats):
            for nat in (False, True):
                runs.append(run(nat, Path(directory), args.epochs))
                home = next(t for t in runs[-1]["trainers"] if t["region"] == "home")
                print(f"home {'behind NAT' if nat else 'public    '}: swarm "
                      f"{runs[-1]['swarm_samples_per_second']:.1f} samples/s, home trainer "
                      f"{home['samples_per_second']:.1f} samples/s ({home['reachability']})", flush=True)

    summary = summarize(runs)
    args.output.write_text(json.dumps({"topology": TOPOLOGY.format(nat=", nat: true (in the NAT runs)").strip(),
                                       "epochs": args.epochs, "runs": runs, "summary": summary}, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
