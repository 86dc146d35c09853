"""The NLP profile in the lab, side by side: the study's configuration, geotrain's intercontinental profile and DiLoCo.

    sudo python benchmarks/lab_modes.py            # 12 `geotrain bench` runs, about 45 min on 2 shared cores
    python benchmarks/lab_modes.py --table         # the docs/diloco.md table and the plot from the committed JSON
    sudo python benchmarks/lab_modes.py --profile convnext_large --configurations sync,diloco   # CV, 4 runs

[EMJ24]'s NLP model (RoBERTa-XLM, profile ``roberta_xlm``: 208.8 samples/s per T4, target batch 32K) emulated
at setups A-4 (one zone) and C-4 (four continents): the largest of the study's setups this 2-core machine holds
(8 trainers do not fit; the study's A-8/C-8 figures are for 8). Every run has the same time scale (8: target
batch 4,096, model / 80, bandwidths / 10, latencies and the network profile's durations / 8). Configurations:

- ``study``: sync mode, fp16, delayed parameter updates (``--overlap``), the network profile the setup's
  RTT calls for, as [EMJ24] ran it;
- ``intercontinental``: sync mode with geotrain's ``intercontinental`` profile at both setups;
- ``diloco``: DiLoCo mode, H = 64 micro-steps of 32 (the paper's 500 divided by the time scale, rounded:
  one round per 8,192 samples of 4 trainers, twice the sync target batch), rounds overlapped with the next
  inner steps (the default); ``diloco-H256``: H = 256;
- ``diloco-blocking``, ``diloco-H256-blocking``: the same with ``--blocking-rounds`` (the trainers wait for
  every round, as in the DiLoCo paper).

- ``sync``: sync mode, fp16, the network profile the setup's RTT calls for, no delayed updates: the lab
  bench's CV configuration (``benchmarks/lab_bench.py``).

For each: swarm samples/s, per-peer efficiency (of the emulated 208.8 samples/s per trainer), the C-4 vs A-4
penalty, and bytes sent per sample (the trainers' kernel TCP counters over their samples).

``--profile convnext_large`` runs [EMJ24]'s CV model instead (80 samples/s per T4); its results go to
``benchmarks/results/lab_modes/convnext_large/``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from geotrain.events import read_events  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "lab_modes"
NLP_PROFILE = "roberta_xlm"
SETUPS = ("A-4", "C-4")
DILOCO_INNER_STEPS = 64
CONFIGURATIONS = {
    "sync": [],
    "study": ["--overlap"],
    "intercontinental": ["--network-profile", "intercontinental", "--overlap"],
    "diloco": ["--mode", "diloco", "--inner-steps", str(DILOCO_INNER_STEPS)],
    # a round per 32,768 samples (H = 2,048 at full scale): 3 rounds, the first left out, to fit the machine's time
    "diloco-H256": ["--mode", "diloco", "--inner-steps", "256", "--epochs", "3"],
    # the trainers wait for every round (the DiLoCo paper's form; the default overlaps rounds with inner steps)
    "diloco-blocking": ["--mode", "diloco", "--inner-steps", str(DILOCO_INNER_STEPS), "--blocking-rounds"],
    "diloco-H256-blocking": ["--mode", "diloco", "--inner-steps", "256", "--epochs", "3", "--blocking-rounds"],
}


def bytes_per_sample(result: dict) -> float | None:
    """Bytes the trainers sent (kernel TCP counters, every destination) per sample they processed."""
    run_dir = Path(result["run_dir"])
    finished = [event for path in run_dir.glob("peer-*.jsonl") for event in read_events(path)
                if event["event"] == "finished"]
    samples = sum(event.get("samples", 0) for event in finished)
    sent = sum(sum((event.get("sent_bytes_by_region") or {}).values()) for event in finished)
    return sent / samples if samples else None


def results_dir(profile: str) -> Path:
    return RESULTS if profile == NLP_PROFILE else RESULTS / profile


def run(setup: str, name: str, arguments: list[str], profile: str) -> Path:
    path = results_dir(profile) / f"{setup}_{name}.json"
    subprocess.run([sys.executable, "-m", "geotrain", "bench", "--setup", setup, "--profile", profile,
                    "--json", str(path), "--run-dir", str(ROOT / "runs" / f"lab-modes-{profile}-{setup}-{name}"),
                    *arguments], check=False, cwd=ROOT)
    if path.exists():
        result = json.loads(path.read_text())
        result["bytes_per_sample"] = bytes_per_sample(result)
        path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def table(results: dict[tuple[str, str], dict]) -> str:
    lines = ["| configuration | A-4 samples/s | C-4 samples/s | per-peer efficiency A-4 / C-4 (vs lab compute) | "
             "C-4 vs A-4 | bytes sent per sample A-4 / C-4 | parameters identical |", "|---|---|---|---|---|---|---|"]
    for name in CONFIGURATIONS:
        a, c = results.get(("A-4", name)), results.get(("C-4", name))
        if not a and not c:
            continue  # not run
        if not a or not c or "swarm_samples_per_second" not in a["measured"] or \
                "swarm_samples_per_second" not in c["measured"]:
            lines.append(f"| {name} | did not finish | | | | | |")
            continue
        ma, mc = a["measured"], c["measured"]
        penalty = mc["swarm_samples_per_second"] / ma["swarm_samples_per_second"] - 1
        sizes = " / ".join("-" if r.get("bytes_per_sample") is None else f"{r['bytes_per_sample'] / 1e3:.1f} kB"
                           for r in (a, c))
        identical = "yes" if ma["params_identical"] and mc["params_identical"] else "NO"
        lines.append(f"| {name} | {ma['swarm_samples_per_second']:.1f} | {mc['swarm_samples_per_second']:.1f} | "
                     f"{ma['per_peer_efficiency']:.2f} / {mc['per_peer_efficiency']:.2f} "
                     f"({_number(ma.get('efficiency_vs_lab'))} / {_number(mc.get('efficiency_vs_lab'))}) | "
                     f"{100 * penalty:+.0f}% | "
                     f"{sizes} | {identical} |")
    return "\n".join(lines)


def plot(results: dict[tuple[str, str], dict], path: Path, profile: str) -> None:
    """Swarm samples/s at A-4 and C-4 per configuration, and bytes sent per sample."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (rate_axis, bytes_axis) = plt.subplots(1, 2, figsize=(13, 4.5))
    names = [name for name in CONFIGURATIONS if any((setup, name) in results for setup in SETUPS)]
    width = 0.38
    for offset, setup in ((-width / 2, "A-4"), (width / 2, "C-4")):
        rates, sizes = [], []
        for name in names:
            measured = results.get((setup, name), {}).get("measured", {})
            rates.append(measured.get("swarm_samples_per_second", 0.0))
            sizes.append((results.get((setup, name), {}).get("bytes_per_sample") or 0.0) / 1e3)
        xs = [x + offset for x in range(len(names))]
        rate_axis.bar(xs, rates, width, label=setup)
        bytes_axis.bar(xs, sizes, width, label=setup)
    for axis, label in ((rate_axis, "swarm samples/s"), (bytes_axis, "kB sent per sample")):
        axis.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
        axis.set_ylabel(label)
        axis.legend(fontsize=8)
    rate_axis.set_title("throughput (4 trainers)")
    bytes_axis.set_title("traffic")
    figure.suptitle(f"{profile} on T4 in the lab, time scale 8: " + " vs ".join(names), fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _number(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def load(profile: str) -> dict[tuple[str, str], dict]:
    results = {}
    for setup in SETUPS:
        for name in CONFIGURATIONS:
            path = results_dir(profile) / f"{setup}_{name}.json"
            if path.exists():
                results[(setup, name)] = json.loads(path.read_text())
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", action="store_true", help="print the table of the committed JSON and exit")
    parser.add_argument("--configurations", default=",".join(name for name in CONFIGURATIONS if name != "sync"))
    parser.add_argument("--profile", default=NLP_PROFILE, help="planner profile to emulate (default: %(default)s)")
    args = parser.parse_args()
    unknown = sorted(set(args.configurations.split(",")) - set(CONFIGURATIONS))
    if unknown:
        parser.error(f"--configurations: unknown {', '.join(unknown)}; expected some of {', '.join(CONFIGURATIONS)}")
    if not args.table:
        results_dir(args.profile).mkdir(parents=True, exist_ok=True)
        for name in args.configurations.split(","):
            for setup in SETUPS:
                run(setup, name, CONFIGURATIONS[name], args.profile)
    results = load(args.profile)
    print(table(results))
    if results:
        plot(results, results_dir(args.profile) / "lab_modes.png", args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
