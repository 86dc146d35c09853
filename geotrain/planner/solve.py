"""Choosing which VMs to rent: mixed-integer programs per swarm size, solved with HiGHS.

What is optimised
    ``cost-per-sample``: the lowest $ per sample, under an optional budget ($/h: VMs, coordinator,
    egress, data) and an optional minimum throughput; ``throughput``: the most samples/s within the
    budget. Constraints: at most ``max_peers`` training VMs, GPUs per region (quotas), allowed
    clouds/regions/continents, and an on-demand anchor for durable state (a separate coordinator
    VM, or at least one on-demand training VM).

How the non-linear model becomes MILPs (see docs/planning.md)
    Throughput ``S / (T_calc + T_comm)`` (S: samples per round) is not linear in the VM counts, cost
    per sample is a ratio, and egress is quadratic (every pair of peers talks). Three devices handle that:

    1. *Enumerated swarm size.* One search per peer count ``n = 1..max_peers`` (n = 1 is evaluated
       directly: a lone VM has no all-reduce). With n fixed, the samples per round (TBS, or ``H x b x n``
       in diloco mode), the bytes each pair exchanges per round (``2 M / n``), every link's time and
       the hivemind efficiency are constants.
    2. *Exact linearisations.* ``T_comm`` is the overhead plus the slowest link in use: the distinct
       link times are levels, one binary per level, and a level below a pair's time forbids using
       both ends of that pair. ``cost x T_comm`` is split over the levels. Egress, ``sum over sites
       of count x (price-weighted peers elsewhere)``, is linearised by writing each site's count in
       binary (one continuous variable per bit).
    3. *Branch and bound over compute time.* ``cost x T_calc`` with ``T_calc = S / R`` is the
       remaining non-linearity. A node is an interval [a, b] of ``T_calc``; its MILP bounds R to
       [S/b, S/a] and minimises a linear lower bound of the objective: ``cost x T_calc`` is
       ``S x sum(price/rate x throughput share)`` with each share bounded by the node's R interval.
       The MILP's configuration is evaluated with the exact model (:func:`model.evaluate`) and the
       node is split at its ``T_calc``, where the bound becomes exact; nodes whose bound cannot beat
       the best configuration found are dropped (HiGHS gets that bound as a constraint).

    The result is the exact optimum of the model, up to a relative tolerance of 1e-6 on compute
    time; the unit tests check it against brute-force search over every configuration of small
    catalogs. Unless HiGHS reaches ``Request.solver_time_limit_s`` (``--solver-time-limit``) on a
    program: then nothing is proven, and :func:`plan` raises :class:`SolverTimeLimitError`, which
    names the best plan found so far and carries it. Sizes are visited in order of a closed-form
    bound, with n VMs of one site (one or two offers) as quick incumbents, and sizes that cannot
    enter the top ``top`` are skipped.

Pruning
    Exact: within a region, an offer is dropped when another is at least as fast after
    interruptions, no dearer, needs no more GPUs of a quota, and is on demand whenever it is; a whole
    region is dropped when another region of the same cloud and continent covers all its offers.
    Approximate, only above EXACT_OFFER_LIMIT offers: :func:`reduce_candidates` (the plan then says
    so, and the benchmark measures how often it changes the answer).

Why not one MILP over all n, Dinkelbach, or a grid: with n free, ``2 M / n`` multiplies every egress
term and link time; Dinkelbach handles a ratio of linear terms, but cost per sample is ``cost x
(S/R + T_comm) + egress``; a binary-encoded ``T_calc`` grid was tried and gave weak relaxations
(about 1 s per program). Enumerating n also yields the best configuration of every size, which the
table and the frontier plot show.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from geotrain.pricing.catalog import Offer
from geotrain.planner.errors import PlannerError, SolverTimeLimitError
from geotrain.planner.milp import INF
from geotrain.planner.model import Prediction, Settings
from geotrain.planner.problem import OBJECTIVES, Inputs, Request, ranking_key, satisfies  # noqa: F401 (re-exported)
from geotrain.planner import prune
from geotrain.planner.prune import (choose_coordinator, prune_dominated, prune_dominated_sites, reduce_candidates,
                                    select_offers, trainable_offers)
from geotrain.planner.size_search import SizeSearch


@dataclass
class Plan:
    candidates: list[Prediction]  # the best configuration of each swarm size, best first
    coordinator: Offer | None
    offers_considered: int
    offers_after_pruning: int
    programs_solved: int
    solve_s: float
    exact: bool = True  # False when a large catalog was reduced to candidates (reduce_candidates)
    # HiGHS's time limit: programs stopped by it (with or without a solution), the largest relative
    # MIP gap it reported when it stopped with one, and the limit itself (seconds per program).
    time_limited: int = 0
    time_limited_unsolved: int = 0
    largest_gap: float | None = None
    solver_time_limit_s: float | None = None
    left_out: list[str] = field(default_factory=list)  # kinds of VM the profile cannot use, and why
    coordinator_note: str = ""  # why the coordinator is where it is, when that is not the obvious place
    settings: Settings = Settings()  # how the swarm runs (training mode, overlap, ...), as planned

    @property
    def best(self) -> Prediction:
        return self.candidates[0]

    @property
    def proven_optimal(self) -> bool:
        """False when a program stopped at the time limit: a better configuration may exist."""
        return self.time_limited == 0

    def summary(self) -> str:
        """The best configuration in one line (for messages)."""
        best = self.best
        return (f"{best.describe()}, {best.samples_per_second:.1f} samples/s, ${best.usd_per_hour:.2f}/h, "
                f"${best.usd_per_million_samples:.3f} per 1M samples")


def plan(inputs: Inputs, request: Request, objective: str | None = None, top: int = 5) -> Plan:
    """The best configuration of each swarm size, the ``top`` best of them ranked by the objective.

    Sizes are visited in order of a cheap bound; a size whose bound cannot beat the ``top``-th best
    found so far is skipped, so ``top=request.max_peers`` yields every size (the frontier plot).
    """
    objective = objective or request.objective
    if objective not in OBJECTIVES:
        raise PlannerError(f"objective {objective!r} is unknown; expected one of {', '.join(OBJECTIVES)}")
    if request.max_peers < 1:
        raise PlannerError(f"--max-peers is {request.max_peers}; expected at least 1")
    started = time.perf_counter()
    allowed = select_offers(inputs, request)
    coordinator = choose_coordinator(allowed, inputs.settings, inputs.offers)
    coordinator_note = ""
    if coordinator is not None and coordinator not in allowed:
        coordinator_note = "outside the allowed offers: it needs no GPU, and they have no CPU-only VM"
    elif coordinator is not None and coordinator.gpu_count:
        coordinator_note = "a GPU VM: the catalog has no on-demand CPU-only VM"
    usable, left_out = trainable_offers(allowed, inputs.profile)
    pruned = prune_dominated(usable, inputs.profile, inputs.settings, request.region_quota_gpus)
    pruned = prune_dominated_sites(pruned, inputs, request.region_quota_gpus)
    exact = len(pruned) <= prune.EXACT_OFFER_LIMIT
    pruned = reduce_candidates(pruned, inputs, request)
    context = SizeSearch(pruned, inputs, request, coordinator)
    found: list[Prediction] = []
    sizes = [n for n in range(1, request.max_peers + 1) if context.could_meet(n, request)]
    # Quick incumbents (n VMs of one site, one or two offers) give every size a start and the top-k a
    # first threshold: the k-th best of the sizes' known values bounds the k-th best size from above.
    starts = {n: context.homogeneous(n, objective, request) for n in sizes if n > 1}
    known = {n: context.value(context.evaluate(c), objective) for n, c in starts.items() if c}
    for bound, n in sorted((context.lower_bound(n, objective), n) for n in sizes):
        own = known.pop(n, None)
        others = sorted(known.values())
        threshold = others[top - 1] if len(others) >= top else INF
        if bound >= threshold * (1 - 1e-9):
            continue  # this size cannot enter the top
        if own is not None and own <= bound * (1 + 1e-9):
            counts = starts[n]  # its quick incumbent already meets the bound: optimal, no MILP needed
        else:
            counts = context.solve(n, objective, request.budget_usd_per_hour, request.min_samples_per_second,
                                   threshold, starts.get(n))
        if counts:
            prediction = context.evaluate(counts)
            if satisfies(prediction, request, tolerance=1e-9):
                found.append(prediction)
                known[n] = context.value(prediction, objective)
    found.sort(key=ranking_key(objective))
    result = None
    if found:
        result = Plan(candidates=found[:top], coordinator=coordinator, offers_considered=len(usable),
                      offers_after_pruning=len(pruned), programs_solved=context.programs_solved,
                      solve_s=time.perf_counter() - started, exact=exact, time_limited=context.time_limited,
                      time_limited_unsolved=context.time_limited_unsolved, largest_gap=context.largest_gap,
                      solver_time_limit_s=request.solver_time_limit_s, left_out=left_out,
                      coordinator_note=coordinator_note, settings=inputs.settings)
    if context.time_limited:
        raise SolverTimeLimitError(time_limit_message(context, request, result), result)
    if result is None:
        raise PlannerError(diagnose(context, request))
    return result


def time_limit_message(context: SizeSearch, request: Request, best_so_far: Plan | None = None) -> str:
    """HiGHS stopped before proving a program optimal (or infeasible): nothing is proven, say what was found."""
    unsolved = "" if not context.time_limited_unsolved else \
        f", {context.time_limited_unsolved} of them before finding any solution"
    gap = "" if context.largest_gap is None else f" (largest MIP gap when stopped: {context.largest_gap:.2%})"
    found = ("no configuration was found, so whether one exists is unknown" if best_so_far is None else
             f"best plan found so far, not proven best: {best_so_far.summary()}")
    return (f"the solver's time limit was reached: HiGHS stopped {context.time_limited} of {context.programs_solved} "
            f"MILPs at --solver-time-limit {request.solver_time_limit_s:g} s{unsolved}{gap}; {found}; raise "
            "--solver-time-limit, or make the search smaller: lower --max-peers, or allow fewer offers "
            "(--clouds, --regions, --continents)")


def diagnose(context: SizeSearch, request: Request) -> str:
    """Name the constraint that makes the request infeasible, with what would be reachable instead."""
    max_peers = request.max_peers
    quota_note = " and the region quotas" if request.region_quota_gpus else ""
    budget, min_sps = request.budget_usd_per_hour, request.min_samples_per_second
    if budget is not None:
        # Checked first and without a MILP: the cheapest configuration is one VM.
        cheapest = context.cheapest_single_vm()
        if cheapest is not None and cheapest.usd_per_hour > budget * (1 + 1e-9) + 1e-9:
            coordinator = context.coordinator
            with_coordinator = "" if coordinator is None else \
                f" with the coordinator {coordinator.name} (${coordinator.price_usd_per_hour:g}/h)"
            enough = math.ceil(cheapest.usd_per_hour * 100 - 1e-6) / 100
            return (f"no configuration fits the budget (--budget-usd-per-hour {budget:g}): the cheapest one, "
                    f"{cheapest.describe()}{with_coordinator}, costs ${cheapest.usd_per_hour:.3f}/h; raise "
                    f"--budget-usd-per-hour to at least {enough:.2f}")

    def best(objective_name: str, budget: float | None, min_sps: float | None) -> Prediction | None:
        options = []
        for n in range(1, max_peers + 1):
            counts = context.solve(n, objective_name, budget, min_sps)
            if counts:
                options.append(context.evaluate(counts))
        options.sort(key=ranking_key(objective_name))
        return options[0] if options else None

    fastest = best("throughput", None, None)
    if context.time_limited:
        raise SolverTimeLimitError(time_limit_message(context, request))
    if fastest is None:
        return (f"no configuration satisfies --max-peers {max_peers}{quota_note} with the on-demand anchor "
                f"({context.inputs.settings.anchor}); allow more GPUs per region or another anchor")
    if min_sps is not None and fastest.samples_per_second < min_sps:
        return (f"--min-samples-per-second {min_sps:g} is out of reach: with --max-peers {max_peers}{quota_note} "
                f"the fastest configuration ({fastest.describe()}) reaches {fastest.samples_per_second:.1f} samples/s; "
                "raise --max-peers, allow more regions/clouds, or lower --min-samples-per-second")
    if budget is not None:
        within = best("throughput", budget, None)
        if context.time_limited:
            raise SolverTimeLimitError(time_limit_message(context, request))
        if within is not None and min_sps is not None:
            return (f"--budget-usd-per-hour {budget:g} and --min-samples-per-second {min_sps:g} cannot both hold: "
                    f"within the budget the fastest configuration ({within.describe()}) reaches "
                    f"{within.samples_per_second:.1f} samples/s at ${within.usd_per_hour:.2f}/h; "
                    "raise the budget or lower the minimum throughput")
    return "no configuration satisfies the request; relax --budget-usd-per-hour or --min-samples-per-second"
