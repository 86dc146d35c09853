"""Benchmark: how long `geotrain plan` takes to choose VMs, in wall-clock seconds, against the catalog size.

Catalogs of 10 to 10,000 offers are generated (seeded, so every run sees the same ones): three
clouds, regions on four continents, five GPU types in 1/2/4/8-GPU instance types, on-demand prices
per GPU type scaled per region with a little noise per line, spot at 25-45% of on-demand. The
prices and the GPU figures of the synthetic profile are made up for the benchmark only; the egress
prices and network matrix are the shipped [EMJ24] defaults. Each catalog is planned, for every
objective, with the default 16 peers: the lowest cost per sample at >= 400 samples/s, and the most
samples/s within $6/h. Beside each plan, in the same run, a greedy baseline on the same pruned
offers (add the VM that helps the objective most, one at a time) shows what the MILPs buy.

Run from the repository root::

    python benchmarks/planner_solve_time.py            # writes benchmarks/results/planner_solve_time.json (+ .png)
    python benchmarks/planner_solve_time.py --table    # prints the docs/benchmarks.md table from that JSON
    python benchmarks/planner_solve_time.py --plot     # redraws the PNG from that JSON
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from geotrain.pricing.catalog import Offer  # noqa: E402
from geotrain.pricing.egress import load_egress  # noqa: E402
from geotrain.planner.model import Settings  # noqa: E402
from geotrain.planner.network import load_network  # noqa: E402
from geotrain.planner.profiles import ModelProfile  # noqa: E402
from geotrain.planner import prune  # noqa: E402
from geotrain.planner.problem import Inputs, Request  # noqa: E402
from geotrain.planner.model import Prediction, evaluate  # noqa: E402
from geotrain.planner.problem import ranking_key, satisfies  # noqa: E402
from geotrain.planner.solve import plan  # noqa: E402

SIZES = [10, 30, 100, 300, 1000, 3000, 10000]
REPEATS = 3
AGREEMENT_OFFERS, AGREEMENT_SEEDS = 300, 5
RESULTS = Path(__file__).resolve().parent / "results"
# Synthetic: standalone samples/s and on-demand $/h per GPU (benchmark only, not shipped figures).
GPUS = {"T4": (80.0, 0.55), "L4": (130.0, 0.80), "A10": (185.0, 1.00), "V100": (200.0, 2.50), "A100": (420.0, 3.70)}
PROFILE = ModelProfile(name="benchmark", parameters=197_800_000, bytes_per_parameter=2, target_batch_size=32768,
                       samples_per_second={gpu: rate for gpu, (rate, _) in GPUS.items()},
                       hivemind_efficiency=0.4883, round_overhead_s=20.08)
CONTINENTS = ["us", "eu", "asia", "oce"]


def catalog(offers: int, seed: int = 0, gpu_counts: tuple[int, ...] = (1, 2, 4, 8)) -> list[Offer]:
    """About ``offers`` offers (two per line: spot and on demand)."""
    rng = np.random.default_rng(seed)
    lines = max(1, offers // 2)
    types = [(gpu, count) for gpu in GPUS for count in gpu_counts]
    regions_per_cloud = max(1, min(40, round((lines / len(types)) / 3)))
    regions = [(cloud, f"{cloud}-{CONTINENTS[i % 4]}-{i}", CONTINENTS[i % 4])
               for cloud in ("gc", "aws", "azure") for i in range(regions_per_cloud)]
    factor = {region: rng.uniform(0.9, 1.3) for _, region, _ in regions}
    result = []
    for line in range(lines):
        cloud, region, continent = regions[line % len(regions)]
        gpu, count = types[(line // len(regions)) % len(types)]
        variant = line // (len(regions) * len(types))
        on_demand = GPUS[gpu][1] * count * factor[region] * rng.uniform(0.95, 1.05)
        spot = on_demand * rng.uniform(0.25, 0.45)
        common = dict(cloud=cloud, region=region, continent=continent, instance_type=f"{gpu.lower()}x{count}-v{variant}",
                      gpu=gpu, gpu_count=count, vcpus=None, spot_interruption_rate=None, source="synthetic",
                      line=line + 2)
        result.append(Offer(price_usd_per_hour=round(on_demand, 4), spot=False, **common))
        result.append(Offer(price_usd_per_hour=round(spot, 4), spot=True, **common))
    return result


def pruned_offers(inputs: Inputs, request: Request) -> tuple[list[Offer], Offer | None]:
    """The offers the planner's MILPs see (filters, exact pruning, candidate reduction), and its coordinator."""
    allowed = prune.select_offers(inputs, request)
    coordinator = prune.choose_coordinator(allowed, inputs.settings, inputs.offers)
    usable, _ = prune.trainable_offers(allowed, inputs.profile)
    kept = prune.prune_dominated(usable, inputs.profile, inputs.settings, request.region_quota_gpus)
    kept = prune.prune_dominated_sites(kept, inputs, request.region_quota_gpus)
    return prune.reduce_candidates(kept, inputs, request), coordinator


def greedy(inputs: Inputs, request: Request) -> Prediction | None:
    """Baseline: on the pruned offers, add one VM at a time, the one that helps the objective most.

    Throughput: the addition with the most samples/s that stays within the budget. Cost per sample: the
    addition with the lowest $ per 1M samples (while below the throughput floor: the most samples/s per
    $/h). The best configuration met on the way is the answer.
    """
    offers, coordinator = pruned_offers(inputs, request)
    key = ranking_key(request.objective)

    def run(counts: dict[Offer, int]) -> Prediction:
        return evaluate(counts, inputs.profile, inputs.network, inputs.egress, inputs.settings, coordinator)

    counts: dict[Offer, int] = {}
    best = None
    for _ in range(request.max_peers):
        options = [run({**counts, o: counts.get(o, 0) + 1}) for o in offers]
        if request.objective == "throughput":
            options = [p for p in options if satisfies(p, Request(budget_usd_per_hour=request.budget_usd_per_hour))]
            step = max(options, key=lambda p: p.samples_per_second, default=None)
        else:
            floor = request.min_samples_per_second or 0
            below = all(p.samples_per_second < floor for p in options)
            step = max(options, key=lambda p: p.samples_per_second / p.usd_per_hour) if below else \
                min(options, key=lambda p: p.usd_per_million_samples)
        if step is None:
            break
        counts = dict(step.counts)
        if satisfies(step, request) and (best is None or key(step) < key(best)):
            best = step
    return best


def measure(offers: list[Offer], request: Request) -> dict:
    """Median wall-clock (and CPU) seconds of the planner and of the greedy baseline, with their answers."""
    inputs = Inputs(offers, PROFILE, load_network(), load_egress(), Settings())
    walls, cpus, greedy_walls, result, baseline = [], [], [], None, None
    for _ in range(REPEATS):
        wall, cpu = time.perf_counter(), time.process_time()
        result = plan(inputs, request)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        wall = time.perf_counter()
        baseline = greedy(inputs, request)
        greedy_walls.append(time.perf_counter() - wall)
    key = "samples_per_second" if request.objective == "throughput" else "usd_per_million_samples"
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus),
            "programs": result.programs_solved, "offers_after_pruning": result.offers_after_pruning,
            "best": result.best.describe(), "best_samples_per_second": result.best.samples_per_second,
            "best_usd_per_million_samples": result.best.usd_per_million_samples,
            "greedy_wall_s": statistics.median(greedy_walls),
            "greedy_best": None if baseline is None else baseline.describe(),
            "greedy_value": None if baseline is None else getattr(baseline, key),
            "planner_value": getattr(result.best, key), "objective_quantity": key}


def agreement() -> list[dict]:
    """Catalogs just above the exact limit, solved with and without the candidate reduction."""
    results = []
    for seed in range(AGREEMENT_SEEDS):
        inputs = Inputs(catalog(AGREEMENT_OFFERS, seed=seed), PROFILE, load_network(), load_egress(), Settings())
        for request in (Request(max_peers=8, min_samples_per_second=400),
                        Request(max_peers=8, objective="throughput", budget_usd_per_hour=6.0)):
            reduced = plan(inputs, request)
            limit = prune.EXACT_OFFER_LIMIT
            prune.EXACT_OFFER_LIMIT = 10 ** 9
            try:
                started = time.process_time()
                exact = plan(inputs, request)
                exact_cpu_s = time.process_time() - started
            finally:
                prune.EXACT_OFFER_LIMIT = limit
            key = "samples_per_second" if request.objective == "throughput" else "usd_per_million_samples"
            results.append({"seed": seed, "objective": request.objective, "reduced": getattr(reduced.best, key),
                            "exact": getattr(exact.best, key), "exact_offers": exact.offers_after_pruning,
                            "reduced_offers": reduced.offers_after_pruning, "exact_cpu_s": exact_cpu_s,
                            "same": abs(getattr(reduced.best, key) / getattr(exact.best, key) - 1) < 1e-6})
            print(f"agreement seed {seed} {request.objective}: reduced {results[-1]['reduced']:.4f}, "
                  f"exact {results[-1]['exact']:.4f}", flush=True)
    return results


def main() -> None:
    import os

    load_at_start = os.getloadavg()[0]
    plan(Inputs(catalog(10), PROFILE, load_network(), load_egress()), Request(max_peers=2))  # import scipy once
    runs = []
    for size in SIZES:
        offers = catalog(size)
        row = {"offers": len(offers),
               "cost_per_sample": measure(offers, Request(min_samples_per_second=400)),
               "throughput": measure(offers, Request(objective="throughput", budget_usd_per_hour=6.0))}
        runs.append(row)
        print(f"{len(offers):6d} offers: " + "; ".join(
            f"{name} {row[name]['wall_s']:.2f} s wall ({row[name]['cpu_s']:.2f} s CPU, {row[name]['programs']} MILPs), "
            f"greedy {row[name]['greedy_wall_s']:.2f} s" for name in ("cost_per_sample", "throughput")), flush=True)
    # With 8-GPU instance types one VM wins both requests (a swarm pays hivemind's efficiency and 20 s
    # per round), so the greedy baseline ties; with 1-GPU types only, the answer is a swarm.
    offers = catalog(SIZES[-1], gpu_counts=(1,))
    swarm = {"offers": len(offers), "gpu_counts": [1],
             "cost_per_sample": measure(offers, Request(min_samples_per_second=400)),
             "throughput": measure(offers, Request(objective="throughput", budget_usd_per_hour=6.0))}
    print(f"{len(offers):6d} offers of 1-GPU types: " + "; ".join(
        f"{name} {swarm[name]['wall_s']:.2f} s wall, greedy {swarm[name]['greedy_value']:.3f} vs "
        f"{swarm[name]['planner_value']:.3f}" for name in ("cost_per_sample", "throughput")), flush=True)
    import scipy

    RESULTS.mkdir(exist_ok=True)
    data = {"benchmark": "planner_solve_time", "max_peers": 16, "repeats": REPEATS, "python": platform.python_version(),
            "scipy": scipy.__version__, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "load_average_1min_at_start": load_at_start, "load_average_1min_at_end": os.getloadavg()[0],
            "runs": runs, "one_gpu_types": swarm, "agreement": agreement()}
    (RESULTS / "planner_solve_time.json").write_text(json.dumps(data, indent=2) + "\n")
    plot()


def plot() -> None:
    """Wall-clock solve time against catalog size from the committed JSON: planner solid, greedy dotted."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    data = json.loads((RESULTS / "planner_solve_time.json").read_text())
    runs = data["runs"]
    figure, axes = plt.subplots(figsize=(6.5, 4), dpi=120)
    sizes = [r["offers"] for r in runs]
    for (key, label), color in zip((("cost_per_sample", "lowest $/sample, >= 400 samples/s"),
                                    ("throughput", "most samples/s within $6/h")), ("#1f77b4", "#ff7f0e")):
        axes.plot(sizes, [r[key]["wall_s"] for r in runs], "-o", color=color, label=f"{label}: planner")
        axes.plot(sizes, [r[key]["greedy_wall_s"] for r in runs], ":", color=color, alpha=0.7,
                  label=f"{label}: greedy baseline")
    axes.axhline(2.0, color="#555", linestyle="--", linewidth=1, label="2 s target")
    axes.set_xscale("log")
    axes.set_xlabel("offers in the catalog")
    axes.set_ylabel(f"wall-clock s (median of {data['repeats']})")
    axes.set_title(f"{data['machine']}, load average {data['load_average_1min_at_start']:.1f} at the start, "
                   f"{data['load_average_1min_at_end']:.1f} at the end", fontsize=9)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(RESULTS / "planner_solve_time.png")


def table() -> str:
    data = json.loads((RESULTS / "planner_solve_time.json").read_text())
    lines = ["| offers in catalog | lowest $/sample: wall s (CPU s) | MILPs | greedy wall s | greedy $/1M vs planner "
             "| most samples/s: wall s (CPU s) | MILPs | greedy wall s | greedy samples/s vs planner |",
             "|---|---|---|---|---|---|---|---|---|"]

    def gap(r: dict) -> str:
        if r["greedy_value"] is None:
            return "none found"
        return f"{(r['greedy_value'] / r['planner_value'] - 1) * 100:+.1f}%"

    for r in [*data["runs"], {**data["one_gpu_types"], "offers": f"{data['one_gpu_types']['offers']} (1-GPU types)"}]:
        c, t = r["cost_per_sample"], r["throughput"]
        lines.append(f"| {r['offers']} | {c['wall_s']:.2f} ({c['cpu_s']:.2f}) | {c['programs']} | "
                     f"{c['greedy_wall_s']:.2f} | {gap(c)} | {t['wall_s']:.2f} ({t['cpu_s']:.2f}) | {t['programs']} | "
                     f"{t['greedy_wall_s']:.2f} | {gap(t)} |")
    same = sum(a["same"] for a in data["agreement"])
    lines.append("")
    lines.append(f"Candidate reduction (catalogs of {AGREEMENT_OFFERS} offers, {AGREEMENT_SEEDS} seeds, both objectives): "
                 f"same answer as the exact solve in {same} of {len(data['agreement'])} cases; worst gap "
                 + f"{max(abs(a['reduced'] / a['exact'] - 1) for a in data['agreement']) * 100:.2f}%.")
    return "\n".join(lines)


if __name__ == "__main__":
    if "--table" in sys.argv:
        print(table())
    elif "--plot" in sys.argv:
        plot()
    else:
        main()
