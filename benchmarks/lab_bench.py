"""[EMJ24] setups A-4, B-4 and C-4 in the lab: one `geotrain bench` run each, one plot, one table (README and docs/benchmarks.md).

    sudo python benchmarks/lab_bench.py                      # about 10 min on 2 shared cores
    sudo python benchmarks/lab_bench.py --setups C-4 --profile roberta_xlm

Each setup runs as its own `geotrain bench` command (a real swarm in the lab, compute emulated; see
geotrain/lab/bench.py) and writes ``benchmarks/results/lab_<setup>.json``; this script then draws
``benchmarks/results/lab_bench.png`` from all of them and prints the table rows for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from geotrain.lab.bench import plot_results  # noqa: E402


def table(results: list[dict]) -> str:
    lines = ["| setup | peers | swarm samples/s (planner) | per-peer efficiency (vs lab compute) | granularity "
             "(planner) | averaging s/round | bandwidth bound s | slowest link |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        m, p = r["measured"], r["planner"]
        if "swarm_samples_per_second" not in m:
            lines.append(f"| {r['setup']} | {r['peers']} | did not finish | | | | | |")
            continue
        bound = "-" if r["bandwidth_bound_s"] is None else f"{r['bandwidth_bound_s']:.2f}"
        lines.append(f"| {r['setup']} | {r['peers']} | {m['swarm_samples_per_second']:.1f} "
                     f"({p['samples_per_second']:.1f}) | {m['per_peer_efficiency']:.2f} "
                     f"({_number(m.get('efficiency_vs_lab'))}) | "
                     f"{m['granularity']:.2f} ({p['granularity']:.2f}) | {m['comm_s_per_round']:.1f} | {bound} | "
                     f"{r['bandwidth_bound_link']} |")
    return "\n".join(lines)


def _number(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setups", default="A-4,B-4,C-4")
    parser.add_argument("--profile", default="convnext_large")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--skip-runs", action="store_true", help="only redraw the plot and the table")
    parser.add_argument("bench_arguments", nargs="*", help="passed to geotrain bench (after --)")
    args = parser.parse_args()
    results = []
    for setup in args.setups.split(","):
        path = args.results / f"lab_{setup}.json"
        if not args.skip_runs:
            subprocess.run([sys.executable, "-m", "geotrain", "bench", "--setup", setup, "--profile", args.profile,
                            "--json", str(path), "--run-dir", f"runs/lab-bench-{setup}", *args.bench_arguments],
                           check=False, cwd=ROOT)
        if path.exists():
            results.append(json.loads(path.read_text()))
    plot_results(results, args.results / "lab_bench.png")
    print(table(results))


if __name__ == "__main__":
    main()
