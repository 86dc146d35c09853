"""The embedded default: a whole swarm on this machine, one command.

    geotrain local --peers 3 --task cv --epochs 5 --json summary.json

starts a coordinator and N trainer peers as separate OS processes on loopback (exactly the
commands a user runs on real VMs), shows live progress, stops everything at the end or on Ctrl-C
(exit 0, as any stop on request; the summary then says the run was interrupted instead of comparing the
peers' parameters), prints a summary table and writes it as JSON. Each process logs to ``RUN_DIR/<name>.log``; the
trainers' event files (``RUN_DIR/peer-<i>.jsonl``) feed the progress display and the summary.

With ``--prometheus`` every peer (the coordinator too) serves metrics on a free loopback port, and a
real Prometheus (:mod:`geotrain.telemetry.prometheus_server`) scrapes them, evaluates geotrain's alert rules and
serves the swarm's console page; its config, targets, data and log are kept in ``RUN_DIR/prometheus``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

from tqdm import tqdm

from geotrain.config import GeotrainConfig, write_resolved_config
from geotrain.events import read_events
from geotrain.launcher import LaunchError, PeerProcess, ProcessLauncher
from geotrain.ports import ensure_port_free, free_ports
from geotrain.run_dir import check_outputs, clear_previous_run, lock_run_dir
from geotrain.telemetry.prometheus_server import (DEFAULT_PORT as DEFAULT_PROMETHEUS_PORT,
                                                  DEFAULT_SCRAPE_INTERVAL_S, PrometheusError, PrometheusServer,
                                                  find_prometheus)

POLL_INTERVAL_S = 0.5


class LocalSwarm:
    """A coordinator and ``peers`` trainers on loopback.

    ``metrics_base_port``: trainer *i* serves metrics on this port + *i*, the coordinator on this port +
    ``peers``. ``prometheus``: also start Prometheus on ``prometheus_port`` (0: any free port), scraping
    every ``scrape_interval_s``; without a base port the peers' metrics ports are free ones.
    """

    def __init__(self, config: GeotrainConfig, peers: int, epochs: int, run_dir: Path | None = None,
                 metrics_base_port: int | None = None, prometheus: bool = False,
                 prometheus_port: int = DEFAULT_PROMETHEUS_PORT,
                 scrape_interval_s: float = DEFAULT_SCRAPE_INTERVAL_S):
        self.config = config.model_copy(deep=True)
        self.config.training.max_epochs = epochs
        if peers >= 2 and self.config.optimizer.group_size is None:
            self.config.optimizer.group_size = peers  # every round's group is full once all trainers joined it
        self.peers = peers
        self.epochs = epochs
        self.run_dir = run_dir or Path("runs") / time.strftime("local-%Y%m%d-%H%M%S")
        self.metrics_base_port = metrics_base_port
        self.scrape_interval_s = scrape_interval_s
        self.launcher = ProcessLauncher(self.run_dir, fork=True)
        self.prometheus: PrometheusServer | None = None
        names = [*(f"peer-{i}" for i in range(peers)), "coordinator"]
        self.metrics_ports: dict[str, int] = {}
        if metrics_base_port is not None:
            self.metrics_ports = {name: metrics_base_port + i for i, name in enumerate(names)}
        if prometheus:
            find_prometheus()  # before anything starts: a missing binary or a taken port is the user's to fix
            ensure_port_free("127.0.0.1", prometheus_port, "Prometheus", "--prometheus-port (0 for any free port)")
            ports = free_ports(len(names) + 1)  # distinct: the peers' metrics and Prometheus' own
            self.metrics_ports = self.metrics_ports or dict(zip(names, ports))
            self.prometheus = PrometheusServer(self.run_dir / "prometheus", port=prometheus_port or ports[-1])

    # --- processes -------------------------------------------------------------------------
    def _start_coordinator(self, config_path: Path) -> PeerProcess:
        return self.launcher.spawn_coordinator(
            ["coordinator", "--config", str(config_path), "--port", "0",
             "--state-dir", str(self.run_dir / "coordinator"),
             "--initial-peers-file", str(self.peers_file), *self._metrics_arguments("coordinator")],
            self.peers_file)

    @property
    def peers_file(self) -> Path:
        return self.run_dir / "initial_peers.txt"

    def _start_trainers(self, config_path: Path) -> list[PeerProcess]:
        """Started with the coordinator, not after it: each loads torch and builds its model meanwhile, then
        waits for the coordinator's address in its peers file (--initial-peers-file)."""
        threads = max(1, (os.cpu_count() or 1) // self.peers)
        trainers = []
        for index in range(self.peers):
            events_path = self.run_dir / f"peer-{index}.jsonl"
            arguments = ["peer", "--config", str(config_path), "--events", str(events_path), "--preemption", "signal",
                         "--data-seed", str(index + 1), "--wait-for-peers", str(self.peers),
                         "--threads", str(threads), "--initial-peers-file", str(self.peers_file)]
            arguments += self._metrics_arguments(f"peer-{index}")
            trainers.append(self.launcher.spawn(f"peer-{index}", arguments, events_path, threads))
        return trainers

    def _metrics_arguments(self, name: str) -> list[str]:
        port = self.metrics_ports.get(name)
        return [] if port is None else ["--metrics-port", str(port)]

    def _start_prometheus(self) -> None:
        """Prometheus first: the swarm's first epochs are on its graphs, and a taken port fails fast."""
        self.prometheus.write_targets(self.metrics_ports)
        self.prometheus.write_config(scrape_interval_s=self.scrape_interval_s)
        try:
            self.prometheus.start()
        except PrometheusError as error:
            raise LaunchError(str(error)) from None
        print(f"Prometheus: {self.prometheus.url} (alerts: {self.prometheus.url}/alerts); "
              f"swarm console: {self.prometheus.console_url}", flush=True)

    # --- the run ---------------------------------------------------------------------------
    def run(self, json_path: Path | None = None) -> int:
        """Exit code: 0 when every trainer finished its epochs or the run was stopped on request (Ctrl-C,
        SIGTERM), 1 when a trainer failed or the swarm stopped short; the run directory's earlier run is
        removed first (:mod:`geotrain.run_dir`)."""
        check_outputs(self.run_dir, json_path)  # before anything starts, and before anything is removed
        lock = lock_run_dir(self.run_dir)
        try:
            removed = clear_previous_run(self.run_dir, json_path)
            if removed:
                print(f"geotrain local: {self.run_dir} held an earlier run; removed its files ({', '.join(removed)})",
                      flush=True)
            return self._run(json_path)
        finally:
            lock.close()

    def _run(self, json_path: Path | None) -> int:
        config_path = write_resolved_config(self.config, self.run_dir)
        print(f"geotrain local: {self.peers} trainers, task {self.config.task.name}/{self.config.task.preset}, "
              f"{self.epochs} {self.config.optimizer.describe_rounds()}; logs in {self.run_dir}",
              flush=True)
        interrupted = False
        try:
            if self.prometheus is not None:
                self._start_prometheus()
            coordinator = self._start_coordinator(config_path)
            trainers = self._start_trainers(config_path)
            self.launcher.wait_for_coordinator(coordinator, self.peers_file)
            self._follow(trainers)
        except KeyboardInterrupt:
            interrupted = True
            print("\nstopping the local swarm ...", flush=True)
        except LaunchError as error:
            print(f"geotrain local: {error}", file=sys.stderr)
            return 1
        finally:
            self.launcher.stop_all()
            if self.prometheus is not None:
                self.prometheus.stop()
        trainers = self.launcher.trainers
        summary = summarize(self.config, trainers, self.run_dir, interrupted=interrupted)
        print(format_summary(summary), flush=True)
        if json_path is not None:
            self._write_summary(summary, json_path)
        failed = [p for p in trainers if p.process.returncode not in (0, None)]
        for peer in failed:
            print(f"{peer.name} exited with code {peer.process.returncode}; last lines of {peer.log_path}:\n"
                  f"{peer.log_tail()}", file=sys.stderr)
        if failed:
            return 1
        # stopped on request (Ctrl-C, SIGTERM): exit 0, as every geotrain command (docs/deployment.md, exit codes)
        return 0 if interrupted or summary["epochs_completed"] >= self.epochs else 1

    def _write_summary(self, summary: dict, json_path: Path) -> None:
        """Write the summary to ``json_path``; should that fail after all, to the run directory instead."""
        text = json.dumps(summary, indent=2) + "\n"
        for path in dict.fromkeys([json_path, self.run_dir / "summary.json"]):
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
            except OSError as error:
                print(f"geotrain local: cannot write the summary to {path} ({error.strerror})", file=sys.stderr)
                continue
            print(f"summary written to {path}", flush=True)
            return

    def _follow(self, trainers: list[PeerProcess]) -> None:
        """Live progress until every trainer has exited."""
        bar = tqdm(total=self.epochs, unit="epoch", desc="swarm", dynamic_ncols=True, file=sys.stdout,
                   disable=None)
        shown = {"epoch": 0}

        def show_progress() -> None:
            progress = live_progress([read_events(p.events_path) for p in trainers])
            if progress["epoch"] > shown["epoch"]:
                bar.update(progress["epoch"] - shown["epoch"])
                shown["epoch"] = progress["epoch"]
                if bar.disable:  # not a terminal: one line per epoch instead of a bar
                    print(f"epoch {shown['epoch']}/{self.epochs}: {progress['samples_per_second']:.1f} samples/s, "
                          f"loss {progress['loss']:.4f}", flush=True)
            bar.set_postfix(samples_per_s=f"{progress['samples_per_second']:.1f}",
                            loss=f"{progress['loss']:.4f}", refresh=False)
            bar.refresh()

        try:
            self.launcher.wait_for_trainers(poll_s=POLL_INTERVAL_S, on_poll=show_progress)
        finally:
            bar.close()


def live_progress(peer_events: list[list[dict]]) -> dict:
    """Global epoch, swarm samples/s (sum of each peer's last epoch) and mean loss, from event files."""
    latest = [next((e for e in reversed(events) if e["event"] == "epoch"), None) for events in peer_events]
    latest = [e for e in latest if e is not None]
    if not latest:
        return {"epoch": 0, "samples_per_second": 0.0, "loss": math.nan}
    return {"epoch": max(e["epoch"] for e in latest),
            "samples_per_second": sum(e["samples_per_second"] for e in latest),
            "loss": sum(e["loss"] for e in latest) / len(latest)}


def _weighted_loss(epochs: list[dict]) -> float:
    samples = sum(e["samples"] for e in epochs)
    return sum(e["loss"] * e["samples"] for e in epochs) / samples if samples else math.nan


def _one_or_list(values: list):
    """The value every peer reported, or the list of them when they differ (None: nobody reported)."""
    distinct = sorted({value for value in values if value is not None})
    return distinct[0] if len(distinct) == 1 else (distinct or None)


def summarize(config: GeotrainConfig, trainers: list[PeerProcess], run_dir: Path, interrupted: bool = False) -> dict:
    """The run's summary (also the JSON that ``--json`` writes and ``geotrain profile`` reads).

    ``interrupted``: the run was stopped before its end (Ctrl-C), so the peers' parameters are not compared
    (``params_identical`` is None): each stopped wherever it was, without the end-of-run agreement.
    """
    peers, epoch_events, starts, ends = [], [], [], []
    parameters = None
    for trainer in trainers:
        events = read_events(trainer.events_path)
        finished = next((e for e in events if e["event"] == "finished"), None)
        # training time ends at the last epoch, before the end-of-run agreement
        trained_until = epochs[-1]["time"] if (epochs := [e for e in events if e["event"] == "epoch"]) else None
        joined = next((e for e in events if e["event"] == "joined"), None)
        training = next((e for e in events if e["event"] == "training"), None)
        epoch_events.append(epochs)
        parameters = parameters or (joined or {}).get("parameters")
        if training and trained_until:
            starts.append(training["time"])
            ends.append(trained_until)
        wall_s = (trained_until - training["time"]) if training and trained_until else None
        peers.append({
            "name": trainer.name,
            "peer_id": (joined or {}).get("peer_id"),
            "exit_code": trainer.process.returncode,
            "epoch": (finished or {}).get("epoch", max((e["epoch"] for e in epochs), default=0)),
            "samples": (finished or {}).get("samples", sum(e["samples"] for e in epochs)),
            "samples_per_second": (sum(e["samples"] for e in epochs) / wall_s) if wall_s else None,
            "params_sha256": (finished or {}).get("params_sha256"),
            "final_state_agreed": (finished or {}).get("final_state_agreed"),
            "compute_s": (finished or {}).get("compute_s", sum(e["compute_s"] for e in epochs)),
            "comm_s": (finished or {}).get("comm_s", sum(e["comm_s"] for e in epochs)),
            "data_s": (finished or {}).get("data_s", sum(e.get("data_s", 0.0) for e in epochs)),
            "device": (joined or {}).get("device"),
            "precision": (joined or {}).get("precision"),
            "peak_gpu_memory_bytes": max((e["peak_gpu_memory_bytes"] for e in epochs
                                          if e.get("peak_gpu_memory_bytes") is not None), default=None),
            "state_loads": sum(1 for e in events if e["event"] == "state_loaded"),
        })
    samples_total = sum(p["samples"] for p in peers)
    wall_s = (max(ends) - min(starts)) if starts else 0.0
    compute_s = sum(p["compute_s"] for p in peers)
    comm_s = sum(p["comm_s"] for p in peers)
    first = [epochs[0] for epochs in epoch_events if epochs]
    last_epoch = max((e["epoch"] for epochs in epoch_events for e in epochs), default=0)
    last = [e for epochs in epoch_events for e in epochs if e["epoch"] == last_epoch]
    hashes = {p["params_sha256"] for p in peers}
    return {
        "task": config.task.name,
        "preset": config.task.preset,
        "parameters": parameters,
        "device": _one_or_list([p["device"] for p in peers]),
        "precision": _one_or_list([p["precision"] for p in peers]),
        "data_s": sum(p["data_s"] for p in peers),
        "peak_gpu_memory_bytes": max((p["peak_gpu_memory_bytes"] for p in peers
                                      if p["peak_gpu_memory_bytes"] is not None), default=None),
        "grad_compression": config.optimizer.grad_compression,
        "powersgd_rank": config.optimizer.powersgd_rank if config.optimizer.grad_compression == "powersgd" else None,
        "network_profile": config.optimizer.network_profile,
        "target_batch_size": config.optimizer.target_batch_size,
        "mode": config.optimizer.mode,
        "rounds": config.optimizer.describe_rounds(),
        "batch_size_per_step": config.optimizer.batch_size_per_step,
        "epochs_requested": config.training.max_epochs,
        "epochs_completed": min((p["epoch"] for p in peers), default=0),
        "samples_total": samples_total,
        "wall_s": wall_s,
        "swarm_samples_per_second": samples_total / wall_s if wall_s > 0 else 0.0,
        "loss_first": _weighted_loss(first),
        "loss_last": _weighted_loss(last),
        "loss_per_epoch": [_weighted_loss([e for epochs in epoch_events for e in epochs if e["epoch"] == k])
                           for k in range(1, last_epoch + 1)],
        "granularity": compute_s / comm_s if comm_s > 0 else None,
        "interrupted": interrupted,
        "params_identical": None if interrupted else len(hashes) == 1 and None not in hashes,
        "run_dir": str(run_dir),
        "peers": peers,
    }


def format_summary(summary: dict) -> str:
    header = f"{'peer':<8} {'peer id':<54} {'epoch':>5} {'samples':>8} {'samples/s':>9} {'compute s':>9} " \
             f"{'comm s':>7}  params sha256"
    lines = [header, "-" * len(header)]
    for peer in summary["peers"]:
        rate = peer["samples_per_second"]
        lines.append(f"{peer['name']:<8} {peer['peer_id'] or '?':<54} {peer['epoch']:>5} {peer['samples']:>8} "
                     f"{(f'{rate:.1f}' if rate else '-'):>9} {peer['compute_s']:>9.1f} {peer['comm_s']:>7.1f}  "
                     f"{(peer['params_sha256'] or '-')[:16]}")
    granularity = summary["granularity"]
    lines.append("")
    lines.append(
        f"swarm: {summary['epochs_completed']} {summary.get('rounds') or 'epochs'}, "
        f"{summary['samples_total']} samples in {summary['wall_s']:.1f} s = "
        f"{summary['swarm_samples_per_second']:.1f} samples/s; loss {summary['loss_first']:.4f} -> "
        f"{summary['loss_last']:.4f}; granularity {granularity:.2f}" if granularity is not None else
        f"swarm: {summary['epochs_completed']} epochs, {summary['samples_total']} samples")
    peak = summary.get("peak_gpu_memory_bytes")
    lines.append(f"computed on {summary.get('device') or '?'} in {summary.get('precision') or '?'}; waiting for data "
                 f"{summary.get('data_s', 0.0):.1f} s in all" + (f"; peak GPU memory {peak / 2**30:.2f} GiB" if peak else ""))
    if summary.get("interrupted"):
        lines.append(f"interrupted at epoch {summary['epochs_completed']} of {summary['epochs_requested']}: "
                     "parameters not compared (the peers stopped before the end-of-run agreement)")
    else:
        lines.append("parameters identical on every peer: " + ("yes" if summary["params_identical"] else "NO"))
    return "\n".join(lines)
