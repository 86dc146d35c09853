"""`geotrain plan` and `geotrain profile`: argument parsers and entry points.

``geotrain/cli.py`` registers the two subcommands with :func:`add_plan_arguments` /
:func:`run_plan` and :func:`add_profile_arguments` / :func:`run_profile`; ``python -m
geotrain.planner`` does the same without the rest of geotrain. Errors a user can cause print one
line (what was wrong, what was expected, what to do) and return exit code 2.

Examples::

    geotrain plan --profile convnext_large --min-samples-per-second 200
    geotrain plan --profile convnext_large --objective throughput --budget-usd-per-hour 3 --clouds gc,aws
    geotrain plan --profile roberta_xlm --mode diloco --inner-steps 500 --min-samples-per-second 1000
    geotrain local --json run.json && geotrain profile --from-run run.json --name mymodel
    geotrain plan --profile mymodel --plot frontier.png --json plan.json
"""

from __future__ import annotations

import argparse
import math
import sys

from geotrain.planner.errors import PlannerError
from geotrain.planner.model import (DEFAULT_BATCH_SIZE_PER_STEP, DEFAULT_INNER_STEPS, DEFAULT_SPOT_INTERRUPTION_RATE,
                                    MODES, Settings)
from geotrain.planner.network import load_network
from geotrain.planner.problem import DEFAULT_MAX_PEERS, DEFAULT_SOLVER_TIME_LIMIT_S, OBJECTIVES, Inputs, Request
from geotrain.planner.profiles import check_profile_name, load_profile, profile_from_run, save_profile
from geotrain.planner.report import describe_mode, format_table, plan_json, plot_frontier, why_best, write_json
from geotrain.planner.solve import plan
from geotrain.pricing.catalog import load_catalog
from geotrain.pricing.egress import load_egress
from geotrain.pricing.errors import InputFileError


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Choose which VMs to rent where, spot or on demand, for the lowest cost per sample "
                          "(or the most samples/s within a budget), from a catalog, egress prices, a network "
                          "matrix and a model profile.")
    parser.add_argument("--profile", required=True,
                        help="model profile: a shipped one (convnext_large, roberta_xlm), one written by "
                             "`geotrain profile`, or a YAML path")
    parser.add_argument("--objective", choices=OBJECTIVES, default="cost-per-sample",
                        help="minimise $ per sample, or maximise samples/s within the budget (default: %(default)s)")
    parser.add_argument("--budget-usd-per-hour", type=float, help="most $ per hour: VMs, coordinator, egress, data")
    parser.add_argument("--min-samples-per-second", type=float, help="least predicted swarm throughput")
    parser.add_argument("--max-peers", type=int, default=DEFAULT_MAX_PEERS,
                        help="most training VMs (default: %(default)s)")
    parser.add_argument("--clouds", help="comma-separated clouds to allow, e.g. gc,aws")
    parser.add_argument("--regions", help="comma-separated regions to allow")
    parser.add_argument("--continents", help="comma-separated continents to allow, e.g. us,eu")
    parser.add_argument("--quota", action="append", default=[], metavar="REGION=GPUS",
                        help="most GPUs in a region (repeatable), e.g. us-central1=8")
    parser.add_argument("--anchor", choices=("coordinator", "trainer"), default="coordinator",
                        help="where durable state lives: a separate on-demand coordinator VM (default), or at "
                             "least one on-demand training VM (DeepVM's single anchor)")
    parser.add_argument("--mode", choices=MODES, default="sync",
                        help="training mode (optimizer.mode): sync all-reduces gradients every target batch; diloco "
                             "steps each peer locally and all-reduces pseudo-gradients every --inner-steps micro-steps "
                             "per peer (default: %(default)s)")
    parser.add_argument("--inner-steps", type=int, metavar="H",
                        help=f"diloco: micro-steps per peer between outer rounds (default: {DEFAULT_INNER_STEPS}, "
                             "the DiLoCo paper's H)")
    parser.add_argument("--batch-size-per-step", type=int, metavar="SAMPLES",
                        help="diloco: samples per micro-step of one peer (optimizer.batch_size_per_step; default: "
                             f"{DEFAULT_BATCH_SIZE_PER_STEP}, geotrain's default)")
    parser.add_argument("--overlap", action="store_true",
                        help="plan with delayed parameter updates (communication overlaps the next round's compute; "
                             "sync mode only)")
    parser.add_argument("--spread-zones", action="store_true",
                        help="VMs of one region sit in different zones and pay inter-zone egress")
    parser.add_argument("--spot-interruption-rate", type=float, default=DEFAULT_SPOT_INTERRUPTION_RATE,
                        help="share of a spot VM's time lost to interruptions where the catalog has no figure "
                             "(default: %(default)s, the rate [EMJ24] evaluated)")
    parser.add_argument("--train-samples", type=float, help="also show hours and $ to train this many samples")
    parser.add_argument("--top", type=int, default=5, help="configurations to show (default: %(default)s)")
    parser.add_argument("--solver-time-limit", type=float, default=DEFAULT_SOLVER_TIME_LIMIT_S, metavar="SECONDS",
                        help="most seconds the MILP solver (HiGHS) may spend on one program (default: %(default)g); "
                             "when reached, the command fails (exit code 2) naming the best plan found so far, "
                             "never calling the request infeasible")
    parser.add_argument("--catalog", help="instance catalog CSV (default: the shipped one)")
    parser.add_argument("--egress", help="egress price CSV (default: the shipped one)")
    parser.add_argument("--network", help="network matrix CSV (default: the shipped one)")
    parser.add_argument("--profiles-dir", help="user profile directory (default: $GEOTRAIN_PROFILES_DIR or "
                                               "~/.config/geotrain/profiles)")
    parser.add_argument("--json", metavar="PATH", help="write the plan as JSON")
    parser.add_argument("--plot", metavar="PATH", help="draw the cost/throughput frontier as a PNG")


def _names(text: str | None) -> frozenset[str] | None:
    if text is None:
        return None
    names = frozenset(part.strip().lower() for part in text.split(",") if part.strip())
    if not names:
        raise PlannerError(f"{text!r} names nothing; expected a comma-separated list, e.g. gc,aws")
    return names


def _quotas(entries: list[str]) -> dict[str, int]:
    quotas = {}
    for entry in entries:
        region, sep, value = entry.partition("=")
        try:
            gpus = int(value)
        except ValueError:
            gpus = -1
        if not sep or not region.strip() or gpus < 0:
            raise PlannerError(f"--quota {entry!r}: expected REGION=GPUS with a whole number, e.g. us-central1=8")
        quotas[region.strip().lower()] = gpus
    return quotas


def _check_positive(name: str, value: float | None, allow_zero: bool = False) -> None:
    if value is not None and (value < 0 or (value == 0 and not allow_zero) or not math.isfinite(value)):
        raise PlannerError(f"{name} is {value:g}; expected a finite number above 0")


def _settings(args: argparse.Namespace) -> Settings:
    """How the swarm runs; --inner-steps and --batch-size-per-step only mean something in diloco mode."""
    if args.mode != "diloco":
        for flag, value in (("--inner-steps", args.inner_steps), ("--batch-size-per-step", args.batch_size_per_step)):
            if value is not None:
                raise PlannerError(f"{flag} {value} applies only to --mode diloco (--mode {args.mode} all-reduces "
                                   f"every target batch); add --mode diloco or leave out {flag}")
    return Settings(overlap=args.overlap, spread_zones=args.spread_zones,
                    spot_interruption_rate=args.spot_interruption_rate, anchor=args.anchor, mode=args.mode,
                    inner_steps=DEFAULT_INNER_STEPS if args.inner_steps is None else args.inner_steps,
                    batch_size_per_step=DEFAULT_BATCH_SIZE_PER_STEP if args.batch_size_per_step is None
                    else args.batch_size_per_step)


def run_plan(args: argparse.Namespace) -> int:
    try:
        return _plan(args)
    except InputFileError as error:
        print(f"geotrain plan: {error}", file=sys.stderr)
        return 2


def _plan(args: argparse.Namespace) -> int:
    _check_positive("--budget-usd-per-hour", args.budget_usd_per_hour)
    _check_positive("--min-samples-per-second", args.min_samples_per_second)
    _check_positive("--train-samples", args.train_samples)
    _check_positive("--solver-time-limit", args.solver_time_limit)
    if not 0 <= args.spot_interruption_rate < 1:
        raise PlannerError(f"--spot-interruption-rate is {args.spot_interruption_rate:g}; expected 0 <= rate < 1")
    if args.max_peers < 1 or args.max_peers > 256:
        raise PlannerError(f"--max-peers is {args.max_peers}; expected 1 to 256")
    if args.top < 1:
        raise PlannerError(f"--top is {args.top}; expected at least 1")
    if args.objective == "throughput" and args.budget_usd_per_hour is None:
        raise PlannerError("--objective throughput needs --budget-usd-per-hour (otherwise more VMs are always faster)")
    settings = _settings(args)
    profile = load_profile(args.profile, args.profiles_dir)
    offers = load_catalog(args.catalog)
    egress = load_egress(args.egress)
    egress.check_clouds({o.cloud for o in offers})
    inputs = Inputs(offers=offers, profile=profile, network=load_network(args.network), egress=egress,
                    settings=settings)
    request = Request(objective=args.objective, budget_usd_per_hour=args.budget_usd_per_hour,
                      min_samples_per_second=args.min_samples_per_second, max_peers=args.max_peers,
                      clouds=_names(args.clouds), regions=_names(args.regions), continents=_names(args.continents),
                      region_quota_gpus=_quotas(args.quota), solver_time_limit_s=args.solver_time_limit)
    result = plan(inputs, request, top=args.top)
    where = f"; {result.coordinator_note}" if result.coordinator_note else ""
    coordinator = (f"coordinator on {result.coordinator.name} (${result.coordinator.price_usd_per_hour:g}/h, "
                   f"included in compute $/h{where})" if result.coordinator else "anchor: an on-demand training VM")
    if settings.mode == "diloco":  # TBS plays no part, and there is no overlap
        print(f"Plan for {profile.name} ({profile.parameters / 1e6:.1f}M parameters), {describe_mode(settings)}, "
              f"objective {args.objective}; {coordinator}.")
    else:
        overlap = "with overlap (delayed parameter updates)" if args.overlap else "without overlap"
        print(f"Plan for {profile.name} ({profile.parameters / 1e6:.1f}M parameters, TBS {profile.target_batch_size}), "
              f"{describe_mode(settings)}, objective {args.objective}, samples/s {overlap}; {coordinator}.")
    print(format_table(result.candidates, args.train_samples))
    print(why_best(result, request, args.objective))
    reduced = "" if result.exact else (" (a large catalog: reduced to candidate offers first, an approximation; "
                                       "see geotrain.planner.solve.reduce_candidates)")
    print(f"Solved {result.programs_solved} MILPs over {result.offers_after_pruning} of {result.offers_considered} "
          f"offers in {result.solve_s:.2f} s wall-clock{reduced}.")
    for line in result.left_out:
        print(f"Left out: {line}.")
    if args.json:
        write_json(args.json, plan_json(result, request, args.objective, profile.name, args.train_samples))
        print(f"Wrote {args.json}")
    if args.plot:
        everything = plan(inputs, request, top=request.max_peers).candidates
        # The fastest configuration of each size within a few times the chosen one's $/h draws the
        # upper part of the frontier without letting very dear machines squash the plot.
        spend = request.budget_usd_per_hour or 4 * result.best.usd_per_hour
        fastest_request = Request(**{**request.__dict__, "budget_usd_per_hour": spend, "min_samples_per_second": None})
        try:
            everything += plan(inputs, fastest_request, objective="throughput", top=request.max_peers).candidates
        except InputFileError:
            pass
        plot_frontier(args.plot, everything, result.best, request,
                      f"{profile.name}: predicted cost and throughput per swarm size")
        print(f"Wrote {args.plot}")
    return 0


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Write a measured model profile for `geotrain plan` from the JSON summary of a "
                          "`geotrain local --json PATH` run.")
    parser.add_argument("--from-run", required=True, metavar="PATH", help="summary written by `geotrain local --json`")
    parser.add_argument("--name", required=True, help="profile name for `geotrain plan --profile NAME`; not a shipped "
                                                      "profile's, nor one of yours unless --overwrite is given")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace your own profile of that name (a shipped profile is never replaced)")
    parser.add_argument("--device-type", help="the device key the measured samples/s applies to (default: the "
                                              "run's device, e.g. cpu; give the GPU model, e.g. T4, for GPU runs)")
    parser.add_argument("--profiles-dir", help="where to write it (default: $GEOTRAIN_PROFILES_DIR or "
                                               "~/.config/geotrain/profiles)")


def run_profile(args: argparse.Namespace) -> int:
    try:
        check_profile_name(args.name, args.profiles_dir, args.overwrite)  # before reading the run
        profile = profile_from_run(args.from_run, args.name, args.device_type)
        path = save_profile(profile, args.profiles_dir, overwrite=args.overwrite)
    except InputFileError as error:
        print(f"geotrain profile: {error}", file=sys.stderr)
        return 2
    rates = ", ".join(f"{key} {value:g} samples/s" for key, value in profile.samples_per_second.items())
    print(f"Wrote profile {profile.name!r} to {path}: {profile.parameters / 1e6:.2f}M parameters, "
          f"{profile.bytes_per_parameter:g} bytes per parameter on the wire, TBS {profile.target_batch_size}, {rates}, "
          f"{profile.round_overhead_s:.2f} s overhead per averaging round.")
    print(f"Use it with: geotrain plan --profile {profile.name}")
    return 0
