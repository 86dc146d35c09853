"""`geotrain lab` and `geotrain bench`: argument parsers and entry points.

``geotrain/cli.py`` registers both with :func:`add_lab_commands`. Examples::

    sudo geotrain lab up --topology C             # shipped [EMJ24] setups A, B, C, or a YAML file
    sudo geotrain lab status
    sudo geotrain lab run eu -- python -m http.server --bind 10.77.2.2 8000
    sudo geotrain lab run us -- curl http://10.77.2.2:8000/     # ~103 ms round trips, 210 Mbit/s
    sudo geotrain lab down                        # also after a crash; safe to repeat
    sudo geotrain bench --setup C-4 --profile convnext_large --json c4.json --plot c4.png

Errors an operator can fix print one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from geotrain.errors import EXIT_BAD_INPUT
from geotrain.lab import network
from geotrain.lab.bench import BenchError, add_bench_arguments, run_benchmark
from geotrain.lab.network import DEFAULT_LAB, DEFAULT_MTU, LabError
from geotrain.lab.topology import TopologyError, load_topology, shipped_topologies
from geotrain.pricing.errors import InputFileError


def _add_lab_name(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lab", default=DEFAULT_LAB,
                        help="name of the lab; its namespaces are called NAME-... (default: %(default)s)")


def add_lab_commands(commands) -> None:
    """Add ``lab`` (up, down, status, run) and ``bench`` to geotrain's subcommands."""
    lab = commands.add_parser("lab", help="emulated regions on this machine: namespaces, latency, bandwidth",
                              description="Emulate regions on this machine (needs root): each region is a network "
                                          "namespace; traffic between regions is delayed and rate-limited as the "
                                          "topology says.")
    actions = lab.add_subparsers(dest="lab_action", required=True, metavar="ACTION")
    up = actions.add_parser("up", help="create the regions of a topology")
    up.add_argument("--topology", required=True,
                    help=f"topology YAML, or a shipped one: {', '.join(shipped_topologies())}")
    up.add_argument("--mtu", type=int, default=DEFAULT_MTU, help="MTU of the lab's links (default: %(default)s)")
    _add_lab_name(up)
    down = actions.add_parser("down", help="remove the lab, and whatever a crashed lab left behind")
    _add_lab_name(down)
    status = actions.add_parser("status", help="regions, addresses, relay counters")
    status.add_argument("--json", action="store_true", help="print the lab's state as JSON")
    _add_lab_name(status)
    run = actions.add_parser("run", help="run a command inside a region: geotrain lab run REGION -- COMMAND")
    run.add_argument("region")
    run.add_argument("region_command", nargs=argparse.REMAINDER, metavar="-- COMMAND")
    _add_lab_name(run)
    lab.set_defaults(handler=run_lab)

    bench = commands.add_parser("bench", help="benchmark a swarm in the lab: [EMJ24] setups such as C-4")
    add_bench_arguments(bench)
    bench.set_defaults(handler=run_bench)


def run_lab(args: argparse.Namespace) -> int:
    try:
        if args.lab_action == "up":
            return _up(args)
        if args.lab_action == "down":
            network.require_lab_support("down")
            removed = network.down(args.lab)
            print(f"lab {args.lab}: " + ("removed " + ", ".join(removed) if removed else "nothing to remove"))
            return 0
        if args.lab_action == "status":
            return _status(args)
        return _run(args)
    except (LabError, TopologyError) as error:
        _print_error(f"geotrain lab {args.lab_action}", error)
        return EXIT_BAD_INPUT


def _print_error(command: str, error: Exception) -> None:
    message = str(error)
    print(message if message.startswith("geotrain ") else f"{command}: {message}", file=sys.stderr)


def _up(args: argparse.Namespace) -> int:
    network.require_lab_support("up")
    topology = load_topology(args.topology)
    state = network.up(topology, args.lab, mtu=args.mtu)
    print(f"lab {args.lab} is up: topology {topology.name} ({topology.source})")
    for name, region in state["regions"].items():
        print(f"  {name:<8} {region['address']:<12} namespace {region['namespace']}, {region['peers']} peer(s)")
    for a, b, link in topology.used_links():
        if a != b:
            print(f"  {a}-{b}: {link.latency_ms:g} ms one-way ({link.rtt_ms:g} ms RTT), "
                  f"{link.bandwidth_mbit_s:g} Mbit/s")
    print(f"run commands in a region with: geotrain lab run {topology.regions[0].name} -- COMMAND")
    return 0


def _status(args: argparse.Namespace) -> int:
    network.require_lab_support("status")
    state = network.require_state(args.lab)
    names = network.check_lab_name(args.lab)
    relay_alive = bool(network.relay_pids(names))
    try:
        stats = json.loads(names.relay_stats_path.read_text())
    except (OSError, json.JSONDecodeError):
        stats = None
    if args.json:
        print(json.dumps({**state, "relay_alive": relay_alive, "relay_stats": stats}, indent=1))
        return 0
    print(f"lab {args.lab}: topology {state['topology']['name']}, relay {'running' if relay_alive else 'NOT RUNNING'}")
    for name, region in state["regions"].items():
        print(f"  {name:<8} {region['address']:<12} namespace {region['namespace']}")
    if stats:
        index = {str(region["index"]): name for name, region in state["regions"].items()}
        for pipe, counters in stats["pipes"].items():
            a, b = pipe.split("->")
            print(f"  {index.get(a, a)}->{index.get(b, b)}: {counters['packets']} packets, "
                  f"{counters['bytes'] / 1e6:.1f} MB, {counters['drops']} dropped")
    return 0


def _run(args: argparse.Namespace) -> int:
    command = _region_command(args)
    network.require_lab_support("run")
    state = network.require_state(args.lab)
    argv, environment = network.region_command(state, args.region, command)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(argv[0], argv, environment)  # the command's exit code and signals are the user's


def _region_command(args: argparse.Namespace) -> list[str]:
    """The command after REGION; ``--lab NAME`` between REGION and ``--`` is taken too, not passed on."""
    rest = list(args.region_command)
    while rest and rest[0] != "--":
        if rest[0] == "--lab" and len(rest) > 1:
            args.lab, rest = rest[1], rest[2:]
        elif rest[0].startswith("--lab="):
            args.lab, rest = rest[0].split("=", 1)[1], rest[1:]
        elif rest[0].startswith("-"):
            raise LabError(f"geotrain lab run: unknown option {rest[0]}; options go before REGION "
                           "(--lab NAME), the command after --: geotrain lab run REGION -- COMMAND")
        else:
            break  # a command given without "--"
    if rest and rest[0] == "--":
        rest = rest[1:]
    if not rest:
        raise LabError("geotrain lab run: no command given; expected geotrain lab run REGION -- COMMAND")
    network.check_lab_name(args.lab)
    return rest


def run_bench(args: argparse.Namespace) -> int:
    try:
        return run_benchmark(args)
    except (LabError, TopologyError, BenchError, InputFileError) as error:
        _print_error("geotrain bench", error)
        return EXIT_BAD_INPUT
