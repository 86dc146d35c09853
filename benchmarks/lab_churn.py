"""The churn soak next to its baseline: one soak (benchmarks/churn_soak.py) without churn, then one with it.

    sudo .venv/bin/python benchmarks/lab_churn.py --duration 600            # 30-40 min on 2 cores (300 s: 20 min)
    sudo .venv/bin/python benchmarks/lab_churn.py --duration 600 --churn 3 --churn-seed 7
    sudo .venv/bin/python benchmarks/lab_churn.py --duration 600 -- --time-scale 4   # passed to each soak

Both runs are the same soak (setup, epochs, a coordinator that checkpoints on a fixed port; see
benchmarks/churn_soak.py), each a `python -m benchmarks.churn_soak` process that brings the lab up and takes it
down, one after the other; the second adds preemption notices at ``--churn`` per trainer per emulated hour, one
SIGKILL and one coordinator restart. Writes ``benchmarks/results/lab_churn/{baseline,churn}.json``, draws
``lab_churn.png`` (epochs over time, both runs) and prints the markdown table of docs/state-transfer.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.churn_soak import plot_soaks  # noqa: E402


def _number(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _yes(value) -> str:
    return {True: "yes", False: "NO", None: "-"}[value]


def summary_table(baseline: dict | None, churn: dict | None) -> str:
    """One row per run: throughput, rejoins (median and worst against the bound) and the three checks."""
    lines = ["| run | churn (notices/trainer/emulated h) | notices, kills, restarts | swarm samples/s | vs baseline "
             "| trainer time lost | rejoins | start to first samples s (median, max) | worst ratio to bound "
             "| joined to first samples: worst ratio to bound "
             "| start to first epoch s (median, max) | worst ratio to bound "
             "| epochs monotonic | checkpoints kept | parameters identical |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base_rate = (baseline or {}).get("measured", {}).get("swarm_samples_per_second")
    for name, result in (("baseline", baseline), ("churn", churn)):
        if result is None:
            lines.append(f"| {name} | did not run | | | | | | | | | | | | | |")
            continue
        m, done = result["measured"], [d for d in result["churn"]["done"] if d.get("result") == "done"]
        counts = ", ".join(str(sum(d["kind"] == kind for d in done)) for kind in ("notice", "kill",
                                                                                  "coordinator_restart"))
        rate = m.get("swarm_samples_per_second")
        lost = _number(100 * m["interruption_fraction"]) + "%" if m.get("interruption_fraction") is not None else "-"
        columns = []

        def worst(ratio_key: str) -> str:
            ratios = [r[ratio_key] for r in m["rejoins"] if r.get(ratio_key) is not None]
            return _number(max(ratios) if ratios else None, 2)

        for time_key, ratio_key in (("to_contributing_s", "contributing_ratio"),
                                    ("to_first_epoch_s", "first_epoch_ratio")):
            times = sorted(r[time_key] for r in m["rejoins"] if r.get(time_key) is not None)
            columns.append(f"{_number(times[len(times) // 2] if times else None)}, "
                           f"{_number(times[-1] if times else None)} | {worst(ratio_key)}")
            if ratio_key == "contributing_ratio":
                columns.append(worst("joined_contributing_ratio"))
        lines.append(
            f"| {name} | {result['churn']['rate_per_trainer_emulated_hour']:g} | {counts} | {_number(rate)} | "
            f"{_number(rate / base_rate, 2) if rate and base_rate else '-'} | "
            f"{lost} | "
            f"{len(m['rejoins'])} | {' | '.join(columns)} | {_yes(m['epochs_monotonic'])} | "
            f"{_yes(m['checkpoints_kept'])} | {_yes(m['parameters']['identical'])} |")
    return "\n".join(lines)


def rejoin_table(churn: dict | None) -> str:
    lines = ["| rejoin | region | start to joined s | start to state loaded s | start to first samples s "
             "| start to first epoch s | state MB | donor region | download s | bound s (nearest donor) "
             "| download / bound | first samples / bound | from joined | first epoch / bound | downloads |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in (churn or {}).get("measured", {}).get("rejoins", []):
        lines.append(f"| {r['name']} | {r['region']} | {_number(r.get('to_joined_s'))} | "
                     f"{_number(r['to_state_loaded_s'])} | {_number(r.get('to_contributing_s'))} | "
                     f"{_number(r['to_first_epoch_s'])} | "
                     f"{_number(r['state_bytes'] / 1e6 if r['state_bytes'] else None)} | {r['donor_region'] or '-'} | "
                     f"{_number(r.get('download_s'))} | "
                     f"{_number(r['bound_s'], 2)} ({r['bound_donor_region'] or '-'}) | "
                     f"{_number(r.get('download_ratio'), 2)} | {_number(r.get('contributing_ratio'), 2)} | "
                     f"{_number(r.get('joined_contributing_ratio'), 2)} | "
                     f"{_number(r['first_epoch_ratio'], 2)} | "
                     f"{r.get('state_downloads', '-')} |")
    return "\n".join(lines)


def _soak(setup: str, duration_s: float, churn: float, seed: int, rejoin_delay_s: float, path: Path,
          lab: str, run_dir: str, extra: list[str]) -> dict | None:
    """One soak, `python -m benchmarks.churn_soak` from the repository root; its JSON, or None without one."""
    subprocess.run([sys.executable, "-m", "benchmarks.churn_soak", "--setup", setup, "--duration", f"{duration_s:g}",
                    "--churn", f"{churn:g}", "--churn-seed", str(seed), "--rejoin-delay", f"{rejoin_delay_s:g}",
                    "--lab", lab, "--run-dir", run_dir, "--json", str(path), *extra], check=False, cwd=ROOT)
    return json.loads(path.read_text()) if path.exists() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setup", default="C-4", help="C-4 is the largest setup 2 cores hold (default: %(default)s)")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds per run (default: %(default)s)")
    parser.add_argument("--churn", type=float, default=2.0,
                        help="notices per trainer per emulated hour in the churn run (default: %(default)s)")
    parser.add_argument("--churn-seed", type=int, default=1)
    parser.add_argument("--rejoin-delay", type=float, default=10.0)
    parser.add_argument("--lab", default="gtlabchurn")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results" / "lab_churn")
    parser.add_argument("--skip-runs", action="store_true", help="only redraw the plot and the tables")
    parser.add_argument("bench_arguments", nargs="*",
                        help="passed to each soak, python -m benchmarks.churn_soak (after --)")
    args = parser.parse_args()
    args.results.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, rate in (("baseline", 0.0), ("churn", args.churn)):
        path = args.results / f"{name}.json"
        if not args.skip_runs:
            results[name] = _soak(args.setup, args.duration, rate, args.churn_seed, args.rejoin_delay, path,
                                  args.lab, f"runs/lab-churn-{name}", args.bench_arguments)
        elif path.exists():
            results[name] = json.loads(path.read_text())
    ran = [r for r in results.values() if r is not None]
    if ran:
        plot_soaks(ran, args.results / "lab_churn.png")
    print(summary_table(results.get("baseline"), results.get("churn")))
    print()
    print(rejoin_table(results.get("churn")))


if __name__ == "__main__":
    main()
