"""`geotrain bench`: a real swarm in the lab, measured next to the planner's prediction.

    sudo geotrain bench --setup C-4 --profile convnext_large --json c4.json --plot c4.png

``--setup C-4`` is [EMJ24]'s notation: the shipped topology ``C`` (US, EU, ASIA, AUS; Table 3's RTT and
bandwidth) with 4 trainer VMs spread evenly over its regions. The bench brings up a lab of its own
(``gtlabbench``), starts a bootstrap coordinator in the first region and the trainers in theirs, all
with the geotrain CLI through ``geotrain lab run`` as a user would, trains a few epochs and takes the
lab down again, also when interrupted.

Compute is emulated (task ``emulated``, see geotrain/tasks/emulated.py): each micro-step sleeps what
the profile's GPU needs for it and hands hivemind real gradients of the model's size. Two knobs keep
a study of 200M-parameter models on 2 CPU cores and a few minutes:

- ``--bandwidth-scale K`` divides every link's bandwidth and the model size by K: transfers take as
  long as in the study, but the relay and hivemind move K times fewer bytes.
- ``--time-scale J`` divides every duration by J: the target batch size and the model size (a round's
  compute and its transfers), the links' latencies, and the network profile's matchmaking time, request,
  averaging and state-download timeouts and progress periods. A round then takes J times less and its
  parts keep their ratios, so efficiency is what the unscaled study would give; what does not shrink is
  hivemind's CPU work per round on this machine's 2 cores, which the report measures (below).

The lab's own overhead is measured in the same run: each trainer's achieved compute rate (samples over
the seconds its micro-steps took) against the emulated GPU's. The emulated steps cost real CPU (gradients
of the model's size) on a machine that also runs every peer's hivemind, so they reach less than the sleep
alone would; the efficiency relative to that achieved rate is the swarm's, not the machine's.

Reported: swarm samples/s over the measured epochs (the first ``--warmup-epochs`` excluded), per-peer
efficiency (swarm samples/s over N x one emulated GPU's samples/s) and the same relative to the lab's
achieved compute rate, granularity (compute over
communication time), averaging time per round next to the bandwidth bound 2·M·(N-1)/(N·B) of the
slowest link, and the planner's prediction (geotrain.planner.model.evaluate) for the same scaled setup
and for the unscaled [EMJ24] setup.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from geotrain.config import NETWORK_PROFILES
from geotrain.events import read_events
from geotrain.lab import network
from geotrain.lab.topology import Link, Topology, load_topology, shipped_topologies
from geotrain.launcher import LaunchError, ProcessLauncher
from geotrain.planner.model import Settings, evaluate
from geotrain.planner.network import load_network
from geotrain.planner.profiles import BYTES_PER_PARAMETER, load_profile
from geotrain.pricing.catalog import Offer
from geotrain.pricing.egress import KINDS, EgressPrices

BENCH_LAB = "gtlabbench"
DEFAULT_EPOCHS = 4
SETUP = re.compile(r"^(?P<topology>[A-Za-z0-9_.-]+?)-(?P<peers>[1-9][0-9]*)$")


class BenchError(ValueError):
    """A benchmark request that cannot run; the message says what to change."""


def add_bench_arguments(parser: argparse.ArgumentParser, run_name: str = "bench") -> None:
    """The options of a lab swarm's setup; ``run_name`` names the default run folder (runs/RUN_NAME-SETUP-TIME)."""
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--setup", required=True,
                        help=f"TOPOLOGY-PEERS, e.g. A-4, B-4, C-4 (shipped topologies: "
                             f"{', '.join(shipped_topologies())})")
    parser.add_argument("--topology", help="topology YAML to use instead of the shipped one the setup names")
    parser.add_argument("--profile", default="convnext_large", help="planner profile whose model and GPU speed "
                                                                    "are emulated (default: %(default)s)")
    parser.add_argument("--gpu", help="the profile's GPU to emulate (default: the first it lists, T4 for the "
                                      "shipped ones)")
    parser.add_argument("--bandwidth-scale", type=int, default=10, metavar="K",
                        help="divide link bandwidths and the model size by K (default: %(default)s)")
    parser.add_argument("--time-scale", type=int, default=8, metavar="J",
                        help="divide every duration by J: target batch and model size, latencies, the network "
                             "profile's matchmaking time, timeouts and periods (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per micro-step (default: %(default)s)")
    parser.add_argument("--epochs", type=int, help=f"epochs to train (default: {DEFAULT_EPOCHS})")
    parser.add_argument("--warmup-epochs", type=int, default=1,
                        help="first epochs left out of the measurement: peers join (default: %(default)s)")
    parser.add_argument("--network-profile", choices=("loopback", "lan", "continent", "intercontinental"),
                        help="geotrain's timing profile (default: by the topology's largest RTT)")
    parser.add_argument("--matchmaking-time", type=float, metavar="SECONDS",
                        help="override the network profile's matchmaking time")
    parser.add_argument("--overlap", action="store_true",
                        help="delayed parameter updates: communication overlaps the next round's compute "
                             "(default off, so the averaging time is measured)")
    parser.add_argument("--mode", choices=("sync", "diloco"), default="sync",
                        help="sync (default): gradients every epoch; diloco: local steps, pseudo-gradients every "
                             "--inner-steps (an epoch is then an outer round)")
    parser.add_argument("--inner-steps", type=int, default=500, metavar="H",
                        help="diloco: micro-steps per trainer between outer rounds (default: %(default)s)")
    parser.add_argument("--blocking-rounds", action="store_true",
                        help="diloco: the trainers wait for every outer round (default: rounds run in the "
                             "background, optimizer.diloco.overlap_rounds)")
    parser.add_argument("--lab", default=BENCH_LAB, help="lab name for the run (default: %(default)s)")
    parser.add_argument("--run-dir", type=Path, help=f"logs and events (default: runs/{run_name}-SETUP-TIME)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", type=Path, metavar="PATH", help="draw the results as a PNG")
    parser.add_argument("--timeout", type=float, default=900.0, metavar="SECONDS",
                        help="stop the swarm after this long (default: %(default)s)")


# --- the setup -------------------------------------------------------------------------------------

@dataclasses.dataclass
class BenchPlan:
    setup: str
    topology: Topology  # as emulated: peers spread, bandwidths divided by the bandwidth scale
    full_topology: Topology  # as in the study
    profile: object  # geotrain.planner.profiles.ModelProfile, unscaled
    gpu: str
    samples_per_second_per_gpu: float
    bandwidth_scale: int
    time_scale: int
    parameters: int
    target_batch_size: int
    batch_size: int
    epochs: int
    warmup_epochs: int
    network_profile: str
    overlap: bool
    matchmaking_time_s: float | None
    mode: str = "sync"
    inner_steps: int = 500
    blocking_rounds: bool = False

    @property
    def preset(self) -> str:
        return f"{self.profile.name}@{self.gpu}/{self.bandwidth_scale * self.time_scale}"

    @property
    def peers(self) -> int:
        return self.topology.peers


def scale_bandwidth(topology: Topology, scale: int) -> Topology:
    def scaled(link: Link | None) -> Link | None:
        return None if link is None else Link(link.latency_ms, link.bandwidth_mbit_s / scale)

    return dataclasses.replace(topology, links={pair: scaled(link) for pair, link in topology.links.items()},
                               within_region=scaled(topology.within_region))


def scale_latency(topology: Topology, scale: int) -> Topology:
    def scaled(link: Link | None) -> Link | None:
        return None if link is None else Link(link.latency_ms / scale, link.bandwidth_mbit_s)

    return dataclasses.replace(topology, links={pair: scaled(link) for pair, link in topology.links.items()},
                               within_region=scaled(topology.within_region))


# the network profile's durations that --time-scale divides (geotrain.config.NETWORK_PROFILES)
SCALED_DURATIONS = ("matchmaking_time_s", "request_timeout_s", "averaging_timeout_s", "progress_refresh_s",
                    "progress_expiration_s", "state_download_stall_s")


def scaled_durations(network_profile: str, time_scale: int, matchmaking_time_s: float | None) -> dict[str, float]:
    """optimizer.* settings: the profile's durations divided by the time scale (an explicit matchmaking time
    is taken as given)."""
    profile = NETWORK_PROFILES[network_profile]
    durations = {key: profile[key] / time_scale for key in SCALED_DURATIONS}
    if matchmaking_time_s is not None:
        durations["matchmaking_time_s"] = matchmaking_time_s
    return durations


def default_network_profile(topology: Topology) -> str:
    rtt_ms = max((link.rtt_ms for _, _, link in topology.used_links()), default=0.0)
    if rtt_ms < 2:
        return "lan"
    return "continent" if rtt_ms < 40 else "intercontinental"


def plan_benchmark(args: argparse.Namespace) -> BenchPlan:

    match = SETUP.match(args.setup)
    if match is None:
        raise BenchError(f"--setup {args.setup!r}: expected TOPOLOGY-PEERS, e.g. C-4 ([EMJ24]'s notation)")
    epochs = DEFAULT_EPOCHS if args.epochs is None else args.epochs
    for name in ("bandwidth_scale", "time_scale", "batch_size"):
        if getattr(args, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')}: expected a whole number >= 1")
    if epochs < 1:
        raise BenchError("--epochs: expected a whole number >= 1")
    if args.mode == "diloco" and args.overlap:
        raise BenchError("--overlap: delayed parameter updates do not apply to --mode diloco (no gradients to delay)")
    if args.inner_steps < 1:
        raise BenchError("--inner-steps: expected a whole number >= 1")
    if not 0 <= args.warmup_epochs < epochs:
        raise BenchError(f"--warmup-epochs {args.warmup_epochs}: expected 0 <= warmup < --epochs ({epochs})")
    full = load_topology(args.topology or match["topology"]).with_peers(int(match["peers"]))
    profile = load_profile(args.profile)
    gpu = args.gpu or next(iter(profile.samples_per_second))
    if gpu not in profile.samples_per_second:
        raise BenchError(f"--gpu {gpu}: profile {profile.name} has no samples/s for it; expected one of "
                         f"{', '.join(profile.samples_per_second)}")
    divisor = args.bandwidth_scale * args.time_scale
    target_batch_size = max(args.batch_size, profile.target_batch_size // args.time_scale)
    return BenchPlan(
        setup=args.setup, topology=scale_latency(scale_bandwidth(full, args.bandwidth_scale), args.time_scale),
        full_topology=full, profile=profile,
        gpu=gpu, samples_per_second_per_gpu=profile.samples_per_second[gpu], bandwidth_scale=args.bandwidth_scale,
        time_scale=args.time_scale, parameters=max(1, profile.parameters // divisor),
        target_batch_size=target_batch_size, batch_size=args.batch_size, epochs=epochs,
        warmup_epochs=args.warmup_epochs, network_profile=args.network_profile or default_network_profile(full),
        overlap=args.overlap, matchmaking_time_s=args.matchmaking_time, mode=args.mode, inner_steps=args.inner_steps,
        blocking_rounds=args.blocking_rounds)


# --- the planner's view --------------------------------------------------------------------------

def planner_prediction(topology: Topology, profile, gpu: str, parameters: int, target_batch_size: int,
                       overlap: bool, mode: str = "sync", inner_steps: int = 500, batch_size: int = 32) -> dict:
    """geotrain.planner.model.evaluate for one VM of ``gpu`` per peer in each region of ``topology``."""

    scaled = dataclasses.replace(profile, parameters=parameters, target_batch_size=target_batch_size,
                                 bytes_per_parameter=BYTES_PER_PARAMETER["fp16"])
    counts = {Offer(cloud="lab", region=r.name, continent=r.continent or r.name, instance_type=f"{gpu}-vm", gpu=gpu,
                    gpu_count=1, vcpus=None, price_usd_per_hour=0.0, spot=False, spot_interruption_rate=None,
                    source="lab topology", line=0): r.peers for r in topology.regions if r.peers}
    within = topology.within_region or Link(0.0, 1e6)
    lines = ["scope,cloud_a,place_a,cloud_b,place_b,bandwidth_gbit_per_s,rtt_ms,source",
             f"same-region,lab,*,lab,*,{within.bandwidth_mbit_s / 1000},{within.rtt_ms},lab within_region"]
    for pair, link in topology.links.items():
        a, b = sorted(pair)
        lines.append(f"between-regions,lab,{a},lab,{b},{link.bandwidth_mbit_s / 1000},{link.rtt_ms},lab link")
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "network.csv"
        path.write_text("\n".join(lines) + "\n")
        network = load_network(path)
    egress = EgressPrices(prices={("*", kind, "*"): 0.0 for kind in KINDS})
    settings = Settings(overlap=overlap, spot_interruption_rate=0.0, mode=mode, inner_steps=inner_steps,
                        batch_size_per_step=batch_size)
    prediction = evaluate(counts, scaled, network, egress, settings)
    return {"samples_per_second": prediction.samples_per_second,
            "compute_s_per_round": prediction.compute_s_per_round, "comm_s_per_round": prediction.comm_s_per_round,
            "granularity": prediction.granularity, "bottleneck": prediction.bottleneck,
            "hivemind_efficiency": profile.hivemind_efficiency, "round_overhead_s": profile.round_overhead_s}


def bandwidth_bound_s(parameters: int, peers: int, topology: Topology) -> tuple[float | None, str]:
    """2·M·(N-1)/(N·B): the all-reduce's transfer time over the slowest link in use (fp16 gradients)."""
    links = topology.used_links()
    if peers < 2 or not links:
        return None, "one peer: nothing to average"
    a, b, slowest = min(links, key=lambda item: item[2].bandwidth_mbit_s)
    gradient_bytes = 2 * parameters
    seconds = 2 * gradient_bytes * (peers - 1) / (peers * slowest.bandwidth_mbit_s * 1e6 / 8)
    where = f"{a}-{b}" if a != b else f"within {a} (not emulated: one namespace)"
    return seconds, f"{where}: {slowest.bandwidth_mbit_s:g} Mbit/s"


# --- running the swarm ----------------------------------------------------------------------------

class LabSwarm:
    """A coordinator and trainers started with ``geotrain lab run`` in their regions."""

    def __init__(self, plan: BenchPlan, lab: str, run_dir: Path):
        self.plan = plan
        self.lab = lab
        self.launcher = ProcessLauncher(run_dir)
        self.run_dir = run_dir

    def _in_region(self, region: str, arguments: list[str]) -> list[str]:
        return ["lab", "run", "--lab", self.lab, region, "--", sys.executable, "-m", "geotrain", *arguments]

    def training_arguments(self) -> list[str]:
        plan = self.plan
        arguments = ["--task", "emulated", "--preset", plan.preset, "--target-batch-size", str(plan.target_batch_size),
                     "--batch-size", str(plan.batch_size), "--network-profile", plan.network_profile,
                     "--run-id", "bench", "--delayed-parameter-updates" if plan.overlap else
                     "--no-delayed-parameter-updates"]
        durations = scaled_durations(plan.network_profile, plan.time_scale, plan.matchmaking_time_s)
        for key, value in durations.items():
            arguments += ["--set", f"optimizer.{key}={value:g}"]
        if plan.mode == "diloco":
            # a round's matchmaking (twice the profile's, at least 5 s: geotrain.config.DiLoCoConfig) scales too
            round_matchmaking_s = max(5.0, 2 * NETWORK_PROFILES[plan.network_profile]["matchmaking_time_s"])
            arguments += ["--set", f"optimizer.diloco.matchmaking_time_s={round_matchmaking_s / plan.time_scale:g}",
                          "--mode", "diloco", "--inner-steps", str(plan.inner_steps)]
            if plan.blocking_rounds:
                arguments += ["--set", "optimizer.diloco.overlap_rounds=false"]
        return arguments

    def start(self, state: dict) -> list[Path]:
        regions = state["regions"]
        first = self.plan.topology.regions[0].name
        peers_file = self.run_dir / "initial_peers.txt"
        try:
            addresses = self.launcher.start_coordinator(self._in_region(first, [
                "coordinator", "--host", regions[first]["address"], "--port", "0", "--no-state", "--region", first,
                "--state-dir", str(self.run_dir / "coordinator"), "--initial-peers-file", str(peers_file),
                *self.training_arguments()]), peers_file)
        except LaunchError as error:
            raise BenchError(str(error)) from None
        initial_peers = [a for a in addresses if regions[first]["address"] in a]
        events = []
        index = 0
        for region in self.plan.topology.regions:
            for _ in range(region.peers):
                index += 1
                path = self.run_dir / f"peer-{index}-{region.name}.jsonl"
                arguments = ["peer", "--host", regions[region.name]["address"], "--port", "0", "--events", str(path),
                             "--preemption", "none", "--data-seed", str(index), "--threads", "1",
                             "--wait-for-peers", str(self.plan.peers), "--max-epochs", str(self.plan.epochs),
                             "--region", region.name, *self.training_arguments()]
                for address in initial_peers:
                    arguments += ["--initial-peers", address]
                self.launcher.spawn(f"peer-{index}-{region.name}", self._in_region(region.name, arguments), path,
                                    threads=1)
                events.append(path)
        return events

    def wait(self, timeout_s: float) -> bool:
        return self.launcher.wait_for_trainers(timeout_s, poll_s=1.0)

    def stop(self) -> None:
        self.launcher.stop_all()


# --- measurement ----------------------------------------------------------------------------------

def measure(plan: BenchPlan, events_paths: list[Path]) -> dict:
    """Swarm samples/s, per-round compute and communication over the measured epochs, from event files."""

    per_peer = [read_events(path) for path in events_paths]
    epochs = [[e for e in events if e["event"] == "epoch"] for events in per_peer]
    finished = [next((e for e in events if e["event"] == "finished"), None) for events in per_peer]
    reached = min((max((e["epoch"] for e in peer), default=0) for peer in epochs), default=0)
    first, last = plan.warmup_epochs, reached
    result = {"epochs_reached": reached, "measured_epochs": [first + 1, last] if last > first else None}
    hashes = {(f or {}).get("params_sha256") for f in finished}
    result["params_identical"] = len(hashes) == 1 and None not in hashes
    if last <= first:
        return result

    def boundary(epoch: int) -> float:
        if epoch == 0:
            return min(e["time"] for events in per_peer for e in events if e["event"] == "training")
        return min(e["time"] for peer in epochs for e in peer if e["epoch"] == epoch)

    window = [e for peer in epochs for e in peer if first < e["epoch"] <= last]
    wall_s = boundary(last) - boundary(first)
    samples = sum(e["samples"] for e in window)
    rounds = last - first
    compute_s = sum(e["compute_s"] for e in window) / (rounds * len(events_paths))
    comm_s = sum(e["comm_s"] for e in window) / (rounds * len(events_paths))
    swarm = samples / wall_s
    per_peer_efficiency = swarm / (plan.peers * plan.samples_per_second_per_gpu)
    # the lab's own overhead: what the emulated micro-steps achieved on this machine, against the GPU they emulate
    compute_total_s = sum(e["compute_s"] for e in window)
    lab_compute_efficiency = (samples / compute_total_s / plan.samples_per_second_per_gpu
                              if compute_total_s > 0 else None)
    result.update({
        "wall_s": wall_s, "samples": samples, "swarm_samples_per_second": swarm,
        "per_peer_efficiency": per_peer_efficiency,
        "lab_compute_efficiency": lab_compute_efficiency,
        "efficiency_vs_lab": per_peer_efficiency / lab_compute_efficiency if lab_compute_efficiency else None,
        "round_s": wall_s / rounds, "compute_s_per_round": compute_s, "comm_s_per_round": comm_s,
        "granularity": compute_s / comm_s if comm_s > 0 else None,
        "loss_first": _mean([e["loss"] for peer in epochs for e in peer if e["epoch"] == 1]),
        "loss_last": _mean([e["loss"] for peer in epochs for e in peer if e["epoch"] == last]),
    })
    return result


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else None


def prepare_run_dir(run_dir: Path) -> Path:
    """The run's folder, without what a previous run left in it: events are appended and the coordinator's
    address file is waited for, so a second run in the same folder would measure the first one's events and
    hand its trainers a dead coordinator's address (its state would be restored, too)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    stale = [*run_dir.glob("peer-*.jsonl"), *run_dir.glob("peer-*.log"), run_dir / "initial_peers.txt",
             run_dir / "coordinator.log"]
    removed = [path for path in stale if path.exists()]
    for path in removed:
        path.unlink()
    if (run_dir / "coordinator").is_dir():
        shutil.rmtree(run_dir / "coordinator")
        removed.append(run_dir / "coordinator")
    if removed:
        print(f"{run_dir}: removed {len(removed)} files of a previous run", flush=True)
    return run_dir


def run_benchmark(args: argparse.Namespace) -> int:

    plan = plan_benchmark(args)
    network.require_lab_support("up")
    run_dir = prepare_run_dir(args.run_dir or Path("runs") / time.strftime(f"bench-{plan.setup}-%Y%m%d-%H%M%S"))
    regions = ", ".join(f"{r.name} x{r.peers}" for r in plan.topology.regions)
    print(f"geotrain bench {plan.setup}: {plan.peers} trainers in {regions}; "
          f"emulated {plan.preset} ({plan.parameters:,} parameters, {plan.samples_per_second_per_gpu:g} samples/s "
          f"per {plan.gpu}); target batch {plan.target_batch_size}; bandwidth / {plan.bandwidth_scale}, model / "
          f"{plan.bandwidth_scale * plan.time_scale}; logs in {run_dir}", flush=True)
    signal.signal(signal.SIGTERM, exit_on_sigterm)  # so that the finally below takes the lab down
    network.up(plan.topology, args.lab)
    swarm = LabSwarm(plan, args.lab, run_dir)
    started = time.time()
    try:
        state = network.require_state(args.lab)
        events = swarm.start(state)
        completed = swarm.wait(args.timeout)
    finally:
        swarm.stop()
        network.down(args.lab)
    measured = measure(plan, events)
    result = report(plan, measured, completed, run_dir, time.time() - started)
    publish(args, result, format_report(result), plot_results)
    return 0 if completed and measured.get("swarm_samples_per_second") else 1


def publish(args: argparse.Namespace, result: dict, text: str, plot) -> None:
    """Print a run's report, write it as JSON (--json) and draw it (--plot, with ``plot(results, path)``)."""
    print(text, flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"results written to {args.json}", flush=True)
    if args.plot:
        plot([result], args.plot)
        print(f"plot written to {args.plot}", flush=True)


def exit_on_sigterm(signum, frame):
    """A SIGTERM handler that raises SystemExit, so that a run's ``finally`` takes its lab down."""
    raise SystemExit(128 + signum)


def report(plan: BenchPlan, measured: dict, completed: bool, run_dir: Path, elapsed_s: float) -> dict:
    bound_s, bound_link = bandwidth_bound_s(plan.parameters, plan.peers, plan.topology)
    return {
        "setup": plan.setup,
        "topology": plan.full_topology.to_dict(),
        "peers": plan.peers,
        "profile": plan.profile.name,
        "gpu": plan.gpu,
        "emulated": {
            "preset": plan.preset,
            "parameters": plan.parameters,
            "samples_per_second_per_gpu": plan.samples_per_second_per_gpu,
            "bandwidth_scale": plan.bandwidth_scale,
            "time_scale": plan.time_scale,
            "note": (f"compute emulated: each micro-step sleeps batch / {plan.samples_per_second_per_gpu:g} s (the "
                     f"profile's {plan.gpu}); bandwidths divided by {plan.bandwidth_scale}; target batch, latencies "
                     f"and the network profile's durations by {plan.time_scale}; model by "
                     f"{plan.bandwidth_scale * plan.time_scale}"),
        },
        "target_batch_size": plan.target_batch_size,
        "batch_size": plan.batch_size,
        "epochs": plan.epochs,
        "warmup_epochs": plan.warmup_epochs,
        "network_profile": plan.network_profile,
        "overlap": plan.overlap,
        "mode": plan.mode,
        "inner_steps": plan.inner_steps if plan.mode == "diloco" else None,
        "completed": completed,
        "measured": measured,
        "bandwidth_bound_s": bound_s,
        "bandwidth_bound_link": bound_link,
        "planner": planner_prediction(plan.topology, plan.profile, plan.gpu, plan.parameters, plan.target_batch_size,
                                      plan.overlap, plan.mode, plan.inner_steps, plan.batch_size),
        "planner_full_scale": planner_prediction(plan.full_topology, plan.profile, plan.gpu, plan.profile.parameters,
                                                 plan.profile.target_batch_size, plan.overlap, plan.mode,
                                                 plan.inner_steps, plan.batch_size),
        "run_dir": str(run_dir),
        "elapsed_s": elapsed_s,
        "machine": {"cpus": os.cpu_count()},
    }


def format_report(result: dict) -> str:
    m, p = result["measured"], result["planner"]

    def number(value, digits=1):
        return "-" if value is None else f"{value:.{digits}f}"

    lines = [f"{result['setup']}: {result['peers']} peers, {result['emulated']['note']}"]
    if "swarm_samples_per_second" not in m:
        lines.append(f"no measurement: the swarm reached epoch {m['epochs_reached']} of {result['epochs']}")
        return "\n".join(lines)
    planner_efficiency = p["samples_per_second"] / (result["peers"] * result["emulated"]["samples_per_second_per_gpu"])
    lines += [
        f"{'':<28} {'measured':>10} {'planner':>10}",
        f"{'swarm samples/s':<28} {number(m['swarm_samples_per_second']):>10} {number(p['samples_per_second']):>10}",
        f"{'per-peer efficiency':<28} {number(m['per_peer_efficiency'], 2):>10} "
        f"{number(planner_efficiency, 2):>10}",
        f"{'lab compute rate / emulated':<28} {number(m.get('lab_compute_efficiency'), 2):>10} {'':>10}",
        f"{'efficiency vs lab compute':<28} {number(m.get('efficiency_vs_lab'), 2):>10} {'':>10}",
        f"{'granularity':<28} {number(m['granularity'], 2):>10} {number(p['granularity'], 2):>10}",
        f"{'compute s per round':<28} {number(m['compute_s_per_round']):>10} {number(p['compute_s_per_round']):>10}",
        f"{'averaging s per round':<28} {number(m['comm_s_per_round']):>10} {number(p['comm_s_per_round']):>10}",
        f"bandwidth bound 2M(N-1)/(NB): {number(result['bandwidth_bound_s'], 2)} s ({result['bandwidth_bound_link']})",
        f"epochs {m['measured_epochs'][0]}-{m['measured_epochs'][1]} measured; parameters identical on every peer: "
        + ("yes" if m["params_identical"] else "NO"),
    ]
    return "\n".join(lines)


def plot_results(results: list[dict], path: Path) -> None:
    """Swarm samples/s and per-round time split, measured next to the planner, one group per setup."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in results if "swarm_samples_per_second" in r["measured"]]
    setups = [r["setup"] for r in results]
    positions = range(len(results))
    figure, (rate_axis, time_axis) = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.38
    rate_axis.bar([x - width / 2 for x in positions], [r["measured"]["swarm_samples_per_second"] for r in results],
                  width, label="measured in the lab")
    rate_axis.bar([x + width / 2 for x in positions], [r["planner"]["samples_per_second"] for r in results],
                  width, label="planner prediction")
    rate_axis.set_xticks(list(positions), setups)
    rate_axis.set_ylabel("swarm samples/s")
    rate_axis.set_title("throughput")
    rate_axis.legend(fontsize=8)
    for offset, key, label in ((-width / 2, "measured", "lab"), (width / 2, "planner", "planner")):
        compute = [r[key]["compute_s_per_round"] for r in results]
        comm = [r[key]["comm_s_per_round"] for r in results]
        xs = [x + offset for x in positions]
        time_axis.bar(xs, compute, width, label=f"compute ({label})", alpha=0.9 if key == "measured" else 0.5,
                      color="tab:blue")
        time_axis.bar(xs, comm, width, bottom=compute, label=f"averaging ({label})",
                      alpha=0.9 if key == "measured" else 0.5, color="tab:orange")
    bounds = [r["bandwidth_bound_s"] for r in results]
    time_axis.scatter([x - width / 2 for x in positions],
                      [r["measured"]["compute_s_per_round"] + (b or 0) for r, b in zip(results, bounds)],
                      marker="_", s=300, color="black", label="compute + bandwidth bound")
    time_axis.set_xticks(list(positions), setups)
    time_axis.set_ylabel("seconds per averaging round (per peer)")
    time_axis.set_title("round time: left measured, right planner")
    time_axis.legend(fontsize=7)
    first = results[0]["emulated"] if results else {}
    figure.suptitle(f"geotrain bench: emulated {results[0]['profile'] if results else ''} on "
                    f"{results[0]['gpu'] if results else ''}, bandwidth / {first.get('bandwidth_scale')}, "
                    f"target batch / {first.get('time_scale')}", fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
