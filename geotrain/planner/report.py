"""Showing a plan: the table of top configurations, the reason the best one wins, JSON, and a PNG frontier."""

from __future__ import annotations

import json
from pathlib import Path

from geotrain.planner.errors import PlannerError
from geotrain.planner.model import Prediction, Settings
from geotrain.planner.problem import Request
from geotrain.planner.solve import Plan


def _vms(prediction: Prediction) -> str:
    return " + ".join(f"{count}x {offer.name}" for offer, count in prediction.counts)


def format_table(candidates: list[Prediction], train_samples: float | None = None) -> str:
    headers = ["#", "VMs", "samples/s", "G", "compute $/h", "egress $/h", "$/1M samples"]
    if train_samples:
        headers += ["hours", "$ total"]
    rows = []
    for rank, p in enumerate(candidates, start=1):
        granularity = "-" if p.peers == 1 else f"{p.granularity:.2f}"
        row = [str(rank), _vms(p), f"{p.samples_per_second:.1f}", granularity, f"{p.compute_usd_per_hour:.3f}",
               f"{p.egress_usd_per_hour + p.data_usd_per_hour:.3f}", f"{p.usd_per_million_samples:.3f}"]
        if train_samples:
            row += [f"{p.hours_to_train(train_samples):.1f}", f"{p.usd_to_train(train_samples):.2f}"]
        rows.append(row)
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    left = {1}

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def describe_mode(settings: Settings) -> str:
    """The training mode, and in diloco mode what one averaging round is, for the plan's header."""
    if settings.mode != "diloco":
        return f"mode {settings.mode}"
    per_peer = settings.inner_steps * settings.batch_size_per_step
    return (f"mode diloco (an outer all-reduce every {settings.inner_steps} inner steps of "
            f"{settings.batch_size_per_step} samples per peer: {per_peer} samples x peers per round)")


def _percent(a: float, b: float) -> str:
    return f"{abs(a / b - 1) * 100:.2g}%"


def why_best(plan: Plan, request: Request, objective: str) -> str:
    """One line on why the first configuration wins: the binding constraint and what the runner-up lacks."""
    best = plan.best
    reasons = []
    if objective == "throughput":
        reasons.append(f"{best.samples_per_second:.1f} samples/s is the most any configuration reaches")
        if request.budget_usd_per_hour is not None:
            reasons.append(f"within ${request.budget_usd_per_hour:g}/h (it spends ${best.usd_per_hour:.2f}/h)")
    else:
        reasons.append(f"${best.usd_per_million_samples:.3f} per 1M samples is the lowest")
        if request.min_samples_per_second is not None:
            reasons.append(f"among configurations reaching {request.min_samples_per_second:g} samples/s")
    if best.peers == 1:
        reasons.append("one VM trains without hivemind, keeping its full samples/s; swarms pay the hivemind "
                       "efficiency and the averaging time (raise --min-samples-per-second to see them)")
    elif len(plan.candidates) > 1:
        runner = plan.candidates[1]
        if objective == "throughput":
            reasons.append(f"the runner-up ({_vms(runner)}) is "
                           f"{_percent(runner.samples_per_second, best.samples_per_second)} slower")
        elif runner.usd_per_million_samples < best.usd_per_million_samples * 1.005:
            reasons.append(f"the runner-up ({_vms(runner)}) is a near tie ({_percent(runner.usd_per_million_samples, best.usd_per_million_samples)} "
                           f"dearer per sample): it reaches {runner.samples_per_second:.1f} samples/s for "
                           f"${runner.usd_per_hour:.2f}/h")
        else:
            def per_million(p: Prediction, usd_per_hour: float) -> float:
                return usd_per_hour / (3600 * p.samples_per_second) * 1e6

            compute = (per_million(best, best.compute_usd_per_hour), per_million(runner, runner.compute_usd_per_hour))
            traffic = (per_million(best, best.egress_usd_per_hour + best.data_usd_per_hour),
                       per_million(runner, runner.egress_usd_per_hour + runner.data_usd_per_hour))
            if compute[1] - compute[0] >= traffic[1] - traffic[0]:
                detail = f"its VMs cost ${compute[0]:.3f} per 1M samples against ${compute[1]:.3f}"
                if abs(runner.granularity - best.granularity) > 0.05 * best.granularity:
                    detail += f" (granularity {best.granularity:.2f} against {runner.granularity:.2f})"
            else:
                detail = f"its egress costs ${traffic[0]:.3f} per 1M samples against ${traffic[1]:.3f}"
            reasons.append(f"the runner-up ({_vms(runner)}) costs "
                           f"{_percent(runner.usd_per_million_samples, best.usd_per_million_samples)} more per sample: "
                           f"{detail}")
    if best.bottleneck and best.peers > 1:
        reasons.append(f"slowest link {best.bottleneck}")
    return "Why #1: " + "; ".join(reasons) + "."


def plan_json(plan: Plan, request: Request, objective: str, profile_name: str,
              train_samples: float | None = None) -> dict:
    return {
        "profile": profile_name,
        "objective": objective,
        "request": {"budget_usd_per_hour": request.budget_usd_per_hour,
                    "min_samples_per_second": request.min_samples_per_second, "max_peers": request.max_peers,
                    "clouds": sorted(request.clouds) if request.clouds else None,
                    "regions": sorted(request.regions) if request.regions else None,
                    "continents": sorted(request.continents) if request.continents else None,
                    "region_quota_gpus": request.region_quota_gpus},
        "settings": {"mode": plan.settings.mode, "overlap": plan.settings.overlap,
                     "inner_steps": plan.settings.inner_steps if plan.settings.mode == "diloco" else None,
                     "batch_size_per_step": plan.settings.batch_size_per_step if plan.settings.mode == "diloco"
                     else None, "spread_zones": plan.settings.spread_zones,
                     "spot_interruption_rate": plan.settings.spot_interruption_rate, "anchor": plan.settings.anchor},
        "coordinator": plan.coordinator.name if plan.coordinator else None,
        "coordinator_note": plan.coordinator_note or None,
        "left_out": plan.left_out,
        "candidates": [p.to_dict(train_samples) for p in plan.candidates],
        "solver": {"offers_considered": plan.offers_considered, "offers_after_pruning": plan.offers_after_pruning,
                   "programs_solved": plan.programs_solved, "solve_s": plan.solve_s, "exact": plan.exact,
                   "proven_optimal": plan.proven_optimal, "time_limit_s": plan.solver_time_limit_s,
                   "time_limited_programs": plan.time_limited,
                   "time_limited_without_solution": plan.time_limited_unsolved, "largest_mip_gap": plan.largest_gap},
    }


def write_json(path: Path, data: dict) -> None:
    try:
        Path(path).write_text(json.dumps(data, indent=2) + "\n")
    except OSError as error:
        raise PlannerError(f"cannot write {path}: {error.strerror}; choose another --json path") from None


def pareto_frontier(points: list[Prediction]) -> list[Prediction]:
    """Configurations that no other one beats on both $/h (lower) and samples/s (higher)."""
    ordered = sorted(points, key=lambda p: (p.usd_per_hour, -p.samples_per_second))
    frontier, fastest = [], -1.0
    for p in ordered:
        if p.samples_per_second > fastest:
            frontier.append(p)
            fastest = p.samples_per_second
    return frontier


def plot_frontier(path: Path, points: list[Prediction], best: Prediction, request: Request, title: str) -> None:
    """Cost per hour against samples/s of every evaluated configuration, the frontier and the chosen one."""
    try:
        import matplotlib
    except ImportError:
        raise PlannerError("--plot needs matplotlib, which is not installed; `pip install matplotlib` "
                           "or leave out --plot") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frontier = pareto_frontier(points)
    figure, axes = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    axes.scatter([p.usd_per_hour for p in points], [p.samples_per_second for p in points], s=18, color="#9aa5b1",
                 label="best configuration of one swarm size")
    axes.plot([p.usd_per_hour for p in frontier], [p.samples_per_second for p in frontier], "-o", color="#1f77b4",
              markersize=4, label="cost/throughput frontier")
    for p in frontier:
        axes.annotate(str(p.peers), (p.usd_per_hour, p.samples_per_second), textcoords="offset points",
                      xytext=(4, -10), fontsize=7, color="#1f77b4")
    axes.scatter([best.usd_per_hour], [best.samples_per_second], marker="*", s=220, color="#d62728", zorder=5,
                 label=f"chosen: ${best.usd_per_million_samples:.2f} per 1M samples")
    if request.budget_usd_per_hour is not None:
        axes.axvline(request.budget_usd_per_hour, color="#555", linestyle="--", linewidth=1, label="budget")
    if request.min_samples_per_second is not None:
        axes.axhline(request.min_samples_per_second, color="#555", linestyle=":", linewidth=1,
                     label="minimum samples/s")
    axes.set_xlabel("cost, $ per hour (VMs, coordinator, egress)")
    axes.set_ylabel("predicted samples per second")
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="lower right")
    figure.tight_layout()
    try:
        figure.savefig(path)
    except OSError as error:
        raise PlannerError(f"cannot write {path}: {error.strerror}; choose another --plot path") from None
    finally:
        plt.close(figure)
