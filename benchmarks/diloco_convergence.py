"""Benchmark: DiLoCo against sync mode on real training, the same number of samples, side by side in one run.

The NLP task's tiny preset (a masked language model) trains on text (the standard library's docstrings,
:mod:`text_corpus`: nothing is downloaded) in `geotrain local` swarms of 4 trainers on loopback: once in sync
mode (the swarm averages gradients every ``--sync-target-batch-size`` samples and takes one AdamW step), and
once per H in DiLoCo mode (every trainer takes an AdamW step per micro-batch; every H micro-steps per trainer
the swarm averages pseudo-gradients and takes the outer Nesterov step). Each run gets the same sample budget.

Reported per run: the loss curve by samples (PNG), the final loss (the sample-weighted mean training loss
over the last quarter of the budget), samples/s, outer rounds, and the final loss against sync mode's.
Training loss is what both modes see alike; this machine's 2 shared cores make samples/s a figure of the
machine, not of geotrain (see docs/lab.md for the lab's throughput figures).

Run from the repository root::

    python benchmarks/diloco_convergence.py                # writes benchmarks/results/diloco_convergence.json + .png
    python benchmarks/diloco_convergence.py --table        # prints the docs/diloco.md table from that JSON
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from text_corpus import write_corpus  # noqa: E402

from geotrain.events import read_events  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PEERS = 4
BATCH_SIZE = 8
SYNC_TARGET_BATCH_SIZE = 256
SYNC_LEARNING_RATE = 3e-3
INNER_LEARNING_RATE = 1e-3
H_VALUES = (4, 16, 64)
SAMPLES = 6144
FINAL_FRACTION = 0.25  # the final loss: over the last quarter of the budget


def loss_curve(run_dir: Path) -> list[tuple[int, float, int]]:
    """(samples the swarm had processed, loss, samples of that epoch) per epoch event of any peer, in order."""
    events = sorted((event for path in run_dir.glob("peer-*.jsonl") for event in read_events(path)
                     if event["event"] == "epoch" and event.get("loss") is not None),
                    key=lambda event: event["time"])
    curve, seen = [], 0
    for event in events:
        seen += event["samples"]
        curve.append((seen, event["loss"], event["samples"]))
    return curve


def final_loss(weighted_curve, budget: int) -> float:
    """Sample-weighted mean loss of the epochs that end in the last FINAL_FRACTION of ``budget``."""
    window = [(loss, weight) for samples, loss, weight in weighted_curve
              if budget * (1 - FINAL_FRACTION) < samples <= budget * 1.1]
    if not window:  # a run that overshot the budget in one epoch: its last epoch
        window = [(weighted_curve[-1][1], weighted_curve[-1][2])]
    return sum(loss * weight for loss, weight in window) / sum(weight for _, weight in window)


def run(directory: Path, corpus: Path, name: str, flags: list[str], epochs: int, peers: int) -> dict:
    run_dir = directory / name
    summary_path = directory / f"{name}.json"
    command = [sys.executable, "-m", "geotrain", "local", "--peers", str(peers), "--epochs", str(epochs),
               "--task", "nlp", "--preset", "tiny", "--data-source", "folder", "--data-path", str(corpus),
               "--batch-size", str(BATCH_SIZE), "--network-profile", "loopback", "--run-dir", str(run_dir),
               "--json", str(summary_path), *flags]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800, stdin=subprocess.DEVNULL)
    wall_s = time.perf_counter() - started
    if result.returncode != 0 or not summary_path.exists():
        raise RuntimeError(f"{name}: geotrain local failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    summary = json.loads(summary_path.read_text())
    weighted = loss_curve(run_dir)
    curve = [(samples, loss) for samples, loss, _ in weighted]
    outer_rounds = [event for path in run_dir.glob("peer-*.jsonl") for event in read_events(path)
                    if event["event"] == "outer_round"]
    return {"name": name, "flags": flags, "epochs": epochs, "wall_s": wall_s, "curve": curve, "weighted": weighted,
            "samples_total": summary["samples_total"], "samples_per_second": summary["swarm_samples_per_second"],
            "params_identical": summary["params_identical"],
            "outer_rounds_ok": sum(1 for e in outer_rounds if e["result"] == "ok"),
            "outer_rounds": len(outer_rounds)}


def compare(directory: Path, h_values=H_VALUES, samples: int = SAMPLES, peers: int = PEERS,
            sync_target_batch_size: int = SYNC_TARGET_BATCH_SIZE) -> dict:
    """Sync mode and DiLoCo at each H, on the same corpus and sample budget; the figures of the report."""
    corpus = directory / "corpus"
    write_corpus(corpus)
    runs = [run(directory, corpus, "sync", ["--mode", "sync", "--target-batch-size", str(sync_target_batch_size),
                                            "--lr", str(SYNC_LEARNING_RATE)],
                -(-samples // sync_target_batch_size), peers)]
    for h in h_values:
        round_samples = h * BATCH_SIZE * peers
        runs.append(run(directory, corpus, f"diloco-H{h}", ["--mode", "diloco", "--inner-steps", str(h),
                                                            "--lr", str(INNER_LEARNING_RATE)],
                        max(1, -(-samples // round_samples)), peers))
    budget = min(min(r["samples_total"] for r in runs), samples)
    for r in runs:
        r["final_loss"] = final_loss(r.pop("weighted"), budget)
    sync_loss = runs[0]["final_loss"]
    for r in runs:
        r["final_loss_vs_sync"] = r["final_loss"] / sync_loss - 1
    return {"benchmark": "diloco_convergence", "budget_samples": budget, "peers": peers, "batch_size": BATCH_SIZE,
            "sync_target_batch_size": sync_target_batch_size, "sync_learning_rate": SYNC_LEARNING_RATE,
            "inner_learning_rate": INNER_LEARNING_RATE, "outer_learning_rate": 0.7, "outer_momentum": 0.9,
            "runs": runs}


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(figsize=(7, 4))
    for r in report["runs"]:
        xs = [s for s, _ in r["curve"]]
        ys = [loss for _, loss in r["curve"]]
        axes.plot(xs, ys, label=f"{r['name']} (final {r['final_loss']:.3f})", marker=".", linewidth=1)
    axes.axvline(report["budget_samples"], color="grey", linestyle=":", linewidth=1)
    axes.set_xlabel("samples processed by the swarm")
    axes.set_ylabel("training loss (per epoch / outer round)")
    axes.set_title(f"NLP tiny on text, {report['peers']} trainers on loopback: sync vs DiLoCo")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def table(report: dict) -> str:
    lines = ["| run | H | final loss | vs sync | outer rounds ok | samples/s (2 shared cores) |",
             "|---|---|---|---|---|---|"]
    for r in report["runs"]:
        h = r["name"].split("-H")[1] if "-H" in r["name"] else "-"
        rounds = f"{r['outer_rounds_ok']}/{r['outer_rounds']}" if r["outer_rounds"] else "-"
        lines.append(f"| {r['name']} | {h} | {r['final_loss']:.3f} | {100 * r['final_loss_vs_sync']:+.1f}% | {rounds} | "
                     f"{r['samples_per_second']:.1f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=RESULTS / "diloco_convergence.json")
    parser.add_argument("--samples", type=int, default=SAMPLES)
    parser.add_argument("--inner-steps", type=int, nargs="+", default=list(H_VALUES), metavar="H")
    parser.add_argument("--table", action="store_true", help="print the table of the JSON at --output and exit")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.output.read_text())))
        return 0
    with tempfile.TemporaryDirectory(prefix="diloco-convergence-") as directory:
        report = compare(Path(directory), tuple(args.inner_steps), args.samples)
    report["machine"] = {"python": platform.python_version(), "cpus": __import__("os").cpu_count()}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1) + "\n")
    plot(report, args.output.with_suffix(".png"))
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
