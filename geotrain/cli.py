"""``geotrain <command>``: one entry point; each command is a thin call into its module.

    geotrain local --peers 3 --task cv --epochs 5        # a whole swarm on this machine
    geotrain coordinator --host 0.0.0.0 --port 31337     # the bootstrap peer on a durable VM
    geotrain peer --initial-peers /ip4/.../p2p/Qm...     # a trainer on any VM
    geotrain doctor --initial-peers /ip4/.../p2p/Qm...   # will a peer here join and be reachable?
    geotrain status --initial-peers /ip4/.../p2p/Qm...   # a live table of the swarm
    geotrain plan --profile convnext_large --budget-usd-per-hour 10
    geotrain lab up --topology C                         # emulated regions on this machine (root)
    geotrain bench --setup C-4                           # a swarm measured in the lab (root)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import warnings
from pathlib import Path

from geotrain.capacity import check_trainer_count
from geotrain.config import GeotrainConfig, load_config
from geotrain.errors import (EXIT_BAD_INPUT, EXIT_OK, EXIT_SWARM_UNREACHABLE, EXIT_UNEXPECTED, ConfigError,
                             OperatorError, StopRequested, SwarmUnreachableError, UserError)
from geotrain.hive.dht.admission_files import check_admission_files
from geotrain.lab.command import add_lab_commands
from geotrain.stopping.stopper import Stopper
from geotrain.local import LocalSwarm
from geotrain.planner.command import add_plan_arguments, add_profile_arguments, run_plan, run_profile
from geotrain.stopping.processes import kill_descendants
from geotrain.telemetry.prometheus_server import PrometheusNotInstalled

# Commands that train or join a swarm import torch and hivemind when they run (see run_peer and friends),
# so that `geotrain plan`, `geotrain lab up` and `geotrain local` start instantly and need neither.
# A trainer that left because of a preemption notice exits with geotrain.stopping.notices.EXIT_PREEMPTED (75).

# flag -> (config key, argparse options). Every flag is optional and only overrides when given.
SWARM_FLAGS = {
    "--run-id": ("swarm.run_id", {}),
    "--initial-peers": ("swarm.initial_peers", {"action": "append", "metavar": "MULTIADDR",
                                                "help": "address of a peer in the swarm (repeatable)"}),
    "--host": ("swarm.host", {"help": "address to listen on (0.0.0.0 on a cloud VM)"}),
    "--port": ("swarm.port", {"type": int, "help": "TCP port to listen on (0: any free port)"}),
    "--announce-host": ("swarm.announce_host", {"help": "public address that other peers dial"}),
    "--announce-port": ("swarm.announce_port", {"type": int}),
    "--identity": ("swarm.identity_path", {"metavar": "PATH", "help": "private key file; a stable peer id"}),
    "--client-mode": ("swarm.client_mode", {"action": "store_const", "const": True,
                                            "help": "dial out only (no open port)"}),
    "--bootstrap-timeout": ("swarm.bootstrap_timeout_s", {"type": float, "metavar": "SECONDS"}),
    "--token-file": ("swarm.token_file", {"metavar": "PATH",
                                          "help": "a private swarm's secret token (or GEOTRAIN_SWARM_TOKEN)"}),
    "--allow-file": ("swarm.allow_file", {"metavar": "PATH",
                                          "help": "peer ids admitted to averaging and state downloads, one per line"}),
    "--metrics-port": ("metrics.port", {"type": int, "help": "serve Prometheus metrics on this port"}),
    "--metrics-host": ("metrics.host", {}),
    "--region": ("metrics.region", {"help": "label for metrics: this VM's region"}),
    "--cloud": ("metrics.cloud", {"help": "label for metrics: this VM's cloud (aws, gcp, azure, ...)"}),
    "--instance-type": ("metrics.instance_type", {"help": "label for metrics: this VM's instance type"}),
}
STATUS_FLAGS = {flag: SWARM_FLAGS[flag] for flag in ("--run-id", "--initial-peers", "--bootstrap-timeout",
                                                     "--token-file")}
TRAINING_FLAGS = {
    "--task": ("task.name", {"help": "cv, nlp or asr"}),
    "--preset": ("task.preset", {"help": "model size preset, e.g. tiny, resnet50, roberta-base"}),
    "--data-source": ("task.data.source", {"help": "synthetic, folder or webdataset"}),
    "--data-path": ("task.data.path", {"help": "folder, file, glob or fsspec URL of the data"}),
    "--tokenizer": ("task.data.tokenizer_path", {"metavar": "PATH"}),
    "--seed": ("task.seed", {"type": int, "help": "seed of the initial weights (equal on all peers)"}),
    "--network-profile": ("optimizer.network_profile",
                          {"help": "loopback, lan, continent or intercontinental (sets timeouts and compression)"}),
    "--target-batch-size": ("optimizer.target_batch_size", {"type": int}),
    "--batch-size": ("optimizer.batch_size_per_step", {"type": int, "help": "samples per micro-step"}),
    "--optimizer": ("optimizer.optimizer", {}),
    "--mode": ("optimizer.mode", {"help": "sync (default: average gradients every epoch) or diloco (local steps, "
                                          "average pseudo-gradients every --inner-steps)"}),
    "--inner-steps": ("optimizer.diloco.inner_steps", {"type": int, "metavar": "H",
                                                       "help": "diloco: micro-steps per trainer between outer rounds"}),
    "--outer-lr": ("optimizer.diloco.outer_learning_rate", {"type": float, "help": "diloco: outer SGD learning rate"}),
    "--lr": ("optimizer.learning_rate", {"type": float}),
    "--grad-compression": ("optimizer.grad_compression", {"help": "none, fp16, uniform8bit or powersgd"}),
    "--powersgd-rank": ("optimizer.powersgd_rank", {"type": int, "metavar": "R",
                                                    "help": "powersgd: rank of the gradient factors (default 4)"}),
    "--delayed-parameter-updates": ("optimizer.delayed_parameter_updates",
                                    {"action": argparse.BooleanOptionalAction}),
    "--local-updates": ("optimizer.use_local_updates", {"action": argparse.BooleanOptionalAction}),
    "--matchmaking-time": ("optimizer.matchmaking_time_s", {"type": float, "metavar": "SECONDS"}),
    "--averaging-timeout": ("optimizer.averaging_timeout_s", {"type": float, "metavar": "SECONDS"}),
    "--device": ("training.device", {"help": "auto (default: the first CUDA GPU, else the CPU), cpu, cuda or cuda:N"}),
    "--precision": ("training.precision", {"help": "auto (default), fp32, fp16 or bf16"}),
    "--data-workers": ("training.data_workers", {"type": int, "metavar": "N",
                                                 "help": "DataLoader worker processes (default 2; 0: none)"}),
    "--data-part": ("task.data.part", {"metavar": "I/N", "help": "webdataset: read only part I of N of the shards"}),
    "--offload-optimizer": ("optimizer.offload_optimizer", {"action": argparse.BooleanOptionalAction,
                                                            "help": "optimizer state in host memory (default on)"}),
    "--lr-schedule": ("optimizer.lr_schedule", {"help": "constant (default), cosine or linear, by the swarm's epoch"}),
    "--warmup-epochs": ("optimizer.warmup_epochs", {"type": int, "metavar": "N"}),
    "--schedule-epochs": ("optimizer.schedule_epochs", {"type": int, "metavar": "N",
                                                        "help": "epoch the decay ends at (default: --max-epochs)"}),
    "--min-lr": ("optimizer.min_learning_rate", {"type": float}),
    "--grad-clip-norm": ("optimizer.grad_clip_norm", {"type": float, "metavar": "NORM"}),
}


PEER_FLAGS = {
    "--max-epochs": ("training.max_epochs", {"type": int}),
    "--preemption": ("preemption.source",
                     {"help": "where spot preemption notices come from: auto (default), aws, gcp, azure, signal, none"}),
    "--data-seed": ("training.data_seed", {"type": int, "help": "seed of this peer's data order (default: a random one, logged)"}),
    "--events": ("training.events_path", {"metavar": "JSONL", "help": "write one JSON line per state change here"}),
    "--wait-for-peers": ("training.wait_for_peers",
                         {"type": int, "metavar": "N",
                          "help": "before the first step, wait until N trainers (this one included) are in the swarm"}),
    "--threads": ("training.threads", {"type": int, "help": "torch CPU threads (default: torch's choice)"}),
    "--known-peers-file": ("swarm.known_peers_file",
                           {"metavar": "PATH", "help": "keep the peers seen here and, after a restart, join through "
                                                       "them too (on a disk that survives the VM's restart)"}),
    "--initial-peers-file": ("swarm.initial_peers_file",
                             {"metavar": "PATH", "help": "wait for the file the coordinator's --initial-peers-file "
                                                         "writes and join through its addresses"}),
}
COORDINATOR_FLAGS = {
    "--state-dir": ("coordinator.state_dir", {"metavar": "PATH",
                                              "help": "where the identity and the checkpoints are kept "
                                                      "(default: geotrain-state)"}),
    "--no-state": ("coordinator.hold_state", {"action": "store_const", "const": False,
                                             "help": "bootstrap only: hold no training state, write no checkpoints"}),
    "--checkpoint-every-epochs": ("coordinator.checkpoint_every_epochs", {"type": int, "metavar": "N"}),
    "--checkpoint-every": ("coordinator.checkpoint_every_s", {"type": float, "metavar": "SECONDS"}),
    "--keep-checkpoints": ("coordinator.keep_checkpoints", {"type": int, "metavar": "K"}),
    "--mirror-url": ("coordinator.mirror_url", {"metavar": "URL", "help": "mirror checkpoints, e.g. s3://bucket/run"}),
}


def _add_config_flags(parser: argparse.ArgumentParser, table: dict) -> None:
    for flag, (key, options) in table.items():
        if "action" not in options:
            options = {"metavar": flag.lstrip("-").upper().replace("-", "_"), **options}
        parser.add_argument(flag, dest=key, default=None, **options)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, metavar="YAML", help="config file (flags override it)")
    parser.add_argument("--set", dest="set_args", action="append", default=[], metavar="KEY=VALUE",
                        help="override any config key, e.g. --set optimizer.learning_rate=0.01")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def config_from_args(args: argparse.Namespace, tables: list[dict], extra: dict | None = None,
                     defaults: dict | None = None) -> GeotrainConfig:
    overrides = {key: getattr(args, key) for table in tables for key, _ in table.values()}
    overrides.update(extra or {})
    config = load_config(args.config, overrides=overrides, set_args=args.set_args, defaults=defaults)
    check_admission_files(config.swarm)  # a wrong token or allow file: exit 2 before torch, hivemind or a wait
    return config


def setup_logging(level: str, role: str) -> None:
    logging.basicConfig(level=level, stream=sys.stderr,
                        format=f"%(asctime)s {role} %(levelname)s %(message)s", datefmt="%H:%M:%S")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.jit")
    if level != "DEBUG":
        # hivemind logs every matchmaking attempt; operators want our one line per state change.
        # hivemind reads its level from the environment when it is first imported.
        os.environ.setdefault("HIVEMIND_LOGLEVEL", "ERROR")
        os.environ.setdefault("GOLOG_LOG_LEVEL", "error")
    if "hivemind.utils.logging" in sys.modules:  # imported already (a child of geotrain.fork_server): set it now
        logging.getLogger("hivemind").setLevel(os.environ.get("HIVEMIND_LOGLEVEL", "INFO"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="geotrain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    peer = commands.add_parser("peer", help="train as one peer of a swarm")
    _add_common(peer)
    _add_config_flags(peer, SWARM_FLAGS)
    _add_config_flags(peer, TRAINING_FLAGS)
    _add_config_flags(peer, PEER_FLAGS)

    coordinator = commands.add_parser("coordinator", help="run the swarm's bootstrap peer and durable state")
    _add_common(coordinator)
    _add_config_flags(coordinator, SWARM_FLAGS)
    _add_config_flags(coordinator, TRAINING_FLAGS)
    _add_config_flags(coordinator, COORDINATOR_FLAGS)
    coordinator.add_argument("--initial-peers-file", type=Path, default=None,
                             help="also write the join addresses to this file")

    local = commands.add_parser("local", help="run a coordinator and N trainers on this machine")
    _add_common(local)
    _add_config_flags(local, TRAINING_FLAGS)
    local.add_argument("--peers", type=int, default=2, help="number of trainer peers (default 2)")
    local.add_argument("--epochs", type=int, default=5, help="global epochs to train (default 5)")
    local.add_argument("--json", type=Path, metavar="PATH", help="write the run summary as JSON here")
    local.add_argument("--run-dir", type=Path, default=None, help="logs and events (default: runs/local-TIME)")
    local.add_argument("--metrics-base-port", type=int, default=None,
                       help="serve trainer i's metrics on this port + i, the coordinator's on this port + PEERS "
                            "(default: no metrics; free ports with --prometheus)")
    local.add_argument("--prometheus", action="store_true",
                       help="start Prometheus (apt-get install prometheus) scraping every peer, with geotrain's "
                            "alert rules and swarm console page; stopped with the swarm")
    local.add_argument("--prometheus-port", type=int, default=None, metavar="PORT",
                       help="Prometheus' port on 127.0.0.1 (default 9090; 0: any free port)")
    local.add_argument("--prometheus-scrape-interval", type=float, default=None, metavar="SECONDS",
                       help="how often Prometheus scrapes the peers (default 5)")

    doctor = commands.add_parser("doctor", help="check, before training, that a peer with these flags joins and "
                                                "can be dialled (takes `geotrain peer`'s flags)")
    _add_common(doctor)
    _add_config_flags(doctor, SWARM_FLAGS)
    _add_config_flags(doctor, TRAINING_FLAGS)
    _add_config_flags(doctor, PEER_FLAGS)
    doctor.add_argument("--json", action="store_true", help="print the findings as JSON")

    status = commands.add_parser("status", help="a live table of the swarm's peers, from the DHT (joins as a client)")
    _add_common(status)
    _add_config_flags(status, STATUS_FLAGS)
    status.add_argument("--once", action="store_true", help="print the table once and exit")
    status.add_argument("--json", action="store_true", help="print JSON (one object per refresh)")
    status.add_argument("--interval", type=float, default=5.0, metavar="SECONDS", help="refresh period (default 5)")

    identity = commands.add_parser("identity", help="a peer's private key file (made if missing) and its peer id")
    identity.add_argument("path", type=Path, metavar="PATH", help="the key file, as given to --identity")
    identity.set_defaults(handler=run_identity)

    plan = commands.add_parser("plan", help="which VMs to rent where, for the lowest cost per sample")
    add_plan_arguments(plan)
    plan.set_defaults(handler=run_plan)
    profile = commands.add_parser("profile", help="add a measured model profile for the planner")
    add_profile_arguments(profile)
    profile.set_defaults(handler=run_profile)

    add_lab_commands(commands)  # `geotrain lab up|down|status|run` and `geotrain bench`
    return parser


def run_peer(args: argparse.Namespace) -> int:
    config = config_from_args(args, [SWARM_FLAGS, TRAINING_FLAGS, PEER_FLAGS])
    if config.swarm.identity_path is not None:
        from geotrain.hive.dht.identity import check_identity_file  # hivemind

        check_identity_file(config.swarm.identity_path, f"--identity {config.swarm.identity_path}")
    from geotrain.trainer import Trainer  # torch and hivemind: only for the commands that train

    stopper = Stopper().install_signal_handlers()
    try:
        Trainer(config).run(stopper)
    except StopRequested:
        logging.getLogger("geotrain").info("stopped before joining the swarm (%s)", stopper.reason)
    return stopper.exit_code if stopper.exit_code is not None else EXIT_OK


def run_coordinator(args: argparse.Namespace) -> int:
    config = config_from_args(args, [SWARM_FLAGS, TRAINING_FLAGS, COORDINATOR_FLAGS])
    from geotrain.coordinator import Coordinator  # hivemind (and torch when it holds state)

    coordinator = Coordinator(config, args.initial_peers_file)  # run() checks its files before anything starts
    stopper = Stopper().install_signal_handlers()
    try:
        coordinator.run(stopper)
    except StopRequested:
        logging.getLogger("geotrain").info("stopped before joining the swarm (%s)", stopper.reason)
    return EXIT_OK


def run_local(args: argparse.Namespace) -> int:
    if args.peers < 1:
        raise ConfigError("--peers: expected at least 1 trainer")
    if args.epochs < 1:
        raise ConfigError("--epochs: expected at least 1 epoch")
    check_trainer_count(args.peers)  # before anything starts: 1000 trainers would drown this machine
    config = config_from_args(args, [TRAINING_FLAGS], {"training.max_epochs": args.epochs},
                              defaults={"optimizer.network_profile": "loopback"})
    if args.metrics_base_port is not None and not 1 <= args.metrics_base_port <= 65535 - args.peers:
        raise ConfigError(f"--metrics-base-port: {args.peers} trainers and the coordinator serve metrics on ports "
                          f"{args.metrics_base_port} to {args.metrics_base_port + args.peers}; expected a base port "
                          f"from 1 to {65535 - args.peers}")
    prometheus_options = {}
    for flag, key in (("--prometheus-port", "prometheus_port"), ("--prometheus-scrape-interval", "scrape_interval_s")):
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            if not args.prometheus:
                raise ConfigError(f"{flag}: only with --prometheus")
            prometheus_options[key] = value
    if not 0 <= prometheus_options.get("prometheus_port", 0) <= 65535:
        raise ConfigError("--prometheus-port: expected a TCP port (0 for any free port)")
    if prometheus_options.get("scrape_interval_s", 1) <= 0:
        raise ConfigError("--prometheus-scrape-interval: expected seconds > 0")
    try:
        swarm = LocalSwarm(config, peers=args.peers, epochs=args.epochs, run_dir=args.run_dir,
                           metrics_base_port=args.metrics_base_port, prometheus=args.prometheus,
                           **prometheus_options)
    except PrometheusNotInstalled as error:
        print(f"geotrain local: --prometheus: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    # Ctrl-C and SIGTERM stop the local swarm (exit 0: stopped on request), also when this process was started
    # with SIGINT ignored (a background job of a non-interactive shell inherits that, and Python then keeps it)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    return swarm.run(json_path=args.json)


def run_status_command(args: argparse.Namespace) -> int:
    config = config_from_args(args, [STATUS_FLAGS])
    if not config.swarm.initial_peers:
        raise ConfigError("--initial-peers: give the address of a peer of the swarm (the coordinator prints it)")
    if args.interval <= 0:
        raise ConfigError("--interval: expected a positive number of seconds")
    from geotrain.telemetry.status import run_status  # hivemind: joins the DHT as a client

    stopper = Stopper().install_signal_handlers()
    try:
        return run_status(config, once=args.once, as_json=args.json, interval_s=args.interval, stop=stopper.stop)
    except StopRequested:
        return EXIT_OK


def run_doctor(args: argparse.Namespace) -> int:
    config = config_from_args(args, [SWARM_FLAGS, TRAINING_FLAGS, PEER_FLAGS])
    if not config.swarm.initial_peers:
        raise ConfigError("--initial-peers: give the address of a peer of the swarm (the coordinator prints it)")
    from geotrain.doctor import examine, exit_code, findings_json, format_report  # hivemind

    stopper = Stopper().install_signal_handlers()
    findings = examine(config, stopper.stop)
    print(json.dumps(findings_json(findings)) if args.json else format_report(findings), flush=True)
    return exit_code(findings)


def run_identity(args: argparse.Namespace) -> int:
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.jit")
    from geotrain.hive.dht.identity import peer_id_of  # hivemind

    print(peer_id_of(args.path, create=True))
    return EXIT_OK


HANDLERS = {"peer": run_peer, "coordinator": run_coordinator, "local": run_local, "status": run_status_command,
            "doctor": run_doctor}


def main(argv: list[str] | None = None, *, embedded: bool = False) -> int:
    """Run one command; its exit code.

    ``embedded``: called from a Python program that goes on afterwards (the test suite checks refusals this
    way): the process is not ended, its signal handlers are put back, and other children of the process are
    left alone."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None) or HANDLERS[args.command]
    if hasattr(args, "log_level"):
        setup_logging(args.log_level, args.command)
    if embedded:
        handlers = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
        try:
            return _run_handler(handler, args, reap_children=False)
        finally:
            for number, previous in handlers.items():
                signal.signal(number, previous)
    code = _run_handler(handler, args)
    if args.command in ("peer", "coordinator", "status", "doctor"):
        # hivemind's objects can crash the interpreter's teardown after their processes are gone;
        # everything worth keeping is flushed, so leave without running it.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _run_handler(handler, args: argparse.Namespace, reap_children: bool = True) -> int:
    try:
        return handler(args)
    except UserError as error:
        print(f"geotrain {args.command}: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except SwarmUnreachableError as error:
        print(f"geotrain {args.command}: {error}", file=sys.stderr)
        return EXIT_SWARM_UNREACHABLE
    except OperatorError as error:
        print(f"geotrain {args.command}: {error}", file=sys.stderr)
        return EXIT_UNEXPECTED
    except (KeyboardInterrupt, StopRequested):
        return EXIT_OK
    except Exception:
        logging.getLogger("geotrain").exception("geotrain %s failed unexpectedly", args.command)
        return EXIT_UNEXPECTED
    finally:
        # whatever happened above, no hivemind child or p2pd may outlive this command
        if reap_children:
            kill_descendants(grace_s=2.0, final=True)
