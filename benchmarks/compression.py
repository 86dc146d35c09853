"""Gradient compressions side by side: bytes on the wire per sample and the loss, same short swarm.

For each compression (none, fp16, uniform8bit, powersgd at rank 1 and 4; and fp16 and powersgd rank 4 with
state averaging every 3 epochs, which PowerSGD leaves in fp16) the same swarm trains on this machine, one
after the other: a bootstrap coordinator (shared) and ``--peers`` trainers on loopback, CV ``tiny``,
synthetic data with fixed data seeds, ``--epochs`` epochs. What is reported per compression:

- the bytes the trainers' sockets sent and received over the whole run (the kernel's counters, from the
  trainers' ``finished`` events: joining, DHT look-ups, every gradient and state averaging round, state
  downloads, and the end-of-run state transfer, the same full-precision state for every compression),
  per sample the swarm trained. Each byte between the trainers is counted twice, sent by one and received
  by the other; a peer samples its counters every few seconds, so a connection that closes between two
  samples loses its last bytes at that end (seen: the end-of-run transfer missing at its sender). The
  larger of the two totals is ``bytes_per_sample``. A trainer that falls an epoch behind downloads the
  whole state (hivemind's catch-up; on a busy machine sometimes every epoch), which outweighs all the
  rounds of a short run: each download is a ``state_download`` event of its trainer, and the wire medians
  are over the runs with none but the end-of-run one where there are such runs;
- the averaging bytes the trainers measured (``geotrain_averaging_payload_bytes_total``, in their ``finished``
  events): every all-reduce message of every gradient and state averaging round, counted once by the peer
  that reduced it, per sample: the rounds alone, without the DHT's traffic (which grows with the run's
  seconds) or state downloads, so the figure the compression acts on;
- the gradient payload of one round: one peer's gradient vector as hivemind serialises it for the
  all-reduce with that compression (PowerSGD: its P and Q factors and the tensors it sends as they are,
  in fp16), computed from the model's shapes; in a group of N each peer sends (N - 1) / N of it and
  as much of the averaged result back;
- the loss per epoch (mean over trainers, by samples), the final epoch's, and whether every trainer
  ended with the same parameters; gradient rounds that failed (trainer log warnings).

    python benchmarks/compression.py --output benchmarks/results/compression.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from hivemind.compression import CompressionInfo
from hivemind.utils.math import get_flatten_greedy_dims

from geotrain.config import TaskConfig
from geotrain.events import read_events
from geotrain.hive.optim.factory import build_compression
from geotrain.tasks import build_task

STATE_EVERY_3 = ["--set", "optimizer.average_state_every=3"]
VARIANTS = {  # name: (flags, compression, PowerSGD rank)
    "none": (["--grad-compression", "none"], "none", None),
    "fp16": (["--grad-compression", "fp16"], "fp16", None),
    "uniform8bit": (["--grad-compression", "uniform8bit"], "uniform8bit", None),
    "powersgd-r1": (["--grad-compression", "powersgd", "--powersgd-rank", "1"], "powersgd", 1),
    "powersgd-r4": (["--grad-compression", "powersgd", "--powersgd-rank", "4"], "powersgd", 4),
    # state averaging (parameters, every epoch by default) is not PowerSGD's to compress: rarer, it costs less
    "fp16-state3": (["--grad-compression", "fp16", *STATE_EVERY_3], "fp16", None),
    "powersgd-r4-state3": (["--grad-compression", "powersgd", "--powersgd-rank", "4", *STATE_EVERY_3], "powersgd", 4),
}
MIN_COMPRESSION_RATIO = 0.5  # hivemind's PowerSGDGradientAverager default, which geotrain keeps
FAILED_ROUND = re.compile(r"gradient averaging round (failed|timed out)")


def state_downloads(events: list[list[dict]]) -> int:
    """Whole states the trainers downloaded (each peer's ``state_download`` events that succeeded)."""
    return sum(1 for peer in events for e in peer if e["event"] == "state_download" and e["result"] == "ok")


def gradient_payload_bytes(variant: str, model: torch.nn.Module) -> int:
    """One peer's gradient vector as hivemind serialises it for one all-reduce round (both PowerSGD phases)."""
    _, name, rank = VARIANTS[variant]
    gradients = [torch.randn_like(p) for p in model.parameters()]
    compression = build_compression(name)
    if rank is None:
        return sum(compression.compress(g, CompressionInfo.from_tensor(g)).ByteSize() for g in gradients)
    sent = []
    for g in gradients:
        if g.ndim <= 1 or 1 - rank * sum(get_flatten_greedy_dims(g)) / g.numel() < MIN_COMPRESSION_RATIO:
            sent.append(g)  # as it is (hivemind/optim/power_sgd_averager.py: _uncompressed_gradients_indexes)
        else:
            rows, columns = get_flatten_greedy_dims(g)
            sent += [torch.randn(rows, rank), torch.randn(columns, rank)]  # P (phase P) and Q (phase Q)
    return sum(compression.compress(t, CompressionInfo.from_tensor(t)).ByteSize() for t in sent)


def start_coordinator(directory: Path) -> tuple[subprocess.Popen, list[str]]:
    peers_file = directory / "initial_peers.txt"
    log = open(directory / "coordinator.log", "w")
    process = subprocess.Popen([sys.executable, "-m", "geotrain", "coordinator", "--port", "0", "--no-state",
                                "--state-dir", str(directory / "coordinator"), "--initial-peers-file", str(peers_file)],
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while not peers_file.exists():
        if time.monotonic() > deadline or process.poll() is not None:
            raise RuntimeError(f"the coordinator did not start; see {directory / 'coordinator.log'}")
        time.sleep(0.2)
    return process, peers_file.read_text().split()


def run_variant(variant: str, round_index: int, args, initial_peers: list[str], directory: Path) -> dict:
    run_id = f"compression-{variant}-{round_index}"  # (variant names are letters, digits and '-')
    processes, event_files, log_files = [], [], []
    started = time.monotonic()
    for index in range(args.peers):
        events, log_path = directory / f"{run_id}-peer{index}.jsonl", directory / f"{run_id}-peer{index}.log"
        event_files.append(events)
        log_files.append(log_path)
        command = [sys.executable, "-m", "geotrain", "peer", "--run-id", run_id, "--task", "cv", "--preset", "tiny",
                   "--network-profile", "loopback", "--max-epochs", str(args.epochs), "--threads", "1",
                   "--target-batch-size", str(args.target_batch_size), "--batch-size", str(args.batch_size),
                   "--lr", str(args.lr), "--wait-for-peers", str(args.peers), "--data-seed", str(index + 1),
                   "--preemption", "signal", "--events", str(events), *VARIANTS[variant][0]]
        command += [x for address in initial_peers for x in ("--initial-peers", address)]
        processes.append(subprocess.Popen(command, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                                          env=dict(os.environ, OMP_NUM_THREADS="1", HIVEMIND_LOGLEVEL="INFO"),
                                          start_new_session=True))
    for process in processes:
        try:
            process.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    wall_s = time.monotonic() - started
    events = [read_events(path) for path in event_files]
    finished = [next((e for e in peer if e["event"] == "finished"), None) for peer in events]
    if any(f is None for f in finished):
        raise RuntimeError(f"{run_id}: a trainer did not finish; see {directory}")
    losses = []
    for epoch in range(1, args.epochs + 1):
        of_epoch = [e for peer in events for e in peer if e["event"] == "epoch" and e["epoch"] == epoch]
        samples = sum(e["samples"] for e in of_epoch)
        losses.append(sum(e["loss"] * e["samples"] for e in of_epoch) / samples if samples else None)
    samples = sum(f["samples"] for f in finished)
    sent = sum(sum(f["sent_bytes_by_region"].values()) for f in finished)
    received = sum(f["received_bytes"] for f in finished)
    averaging = sum(sum(f["averaging_payload_bytes"].values()) for f in finished)
    logs = [path.read_text(errors="replace") for path in log_files]
    powersgd = [line.split("first PowerSGD round done in a group of ", 1)[1] for log in logs
                for line in log.splitlines() if "first PowerSGD round done in a group of " in line]
    return {"samples": samples, "sent_bytes": sent, "received_bytes": received,
            "sent_bytes_per_sample": sent / samples, "received_bytes_per_sample": received / samples,
            "bytes_per_sample": max(sent, received) / samples,
            "averaging_bytes_per_sample": averaging / samples,
            "averaging_bytes_returned_by_trainer": [f["averaging_payload_bytes"]["sent"] for f in finished],
            "state_downloads": state_downloads(events),
            "loss_per_epoch": losses, "final_loss": losses[-1],
            "params_identical": len({f["params_sha256"] for f in finished}) == 1,
            "exit_codes": [p.returncode for p in processes],
            "failed_gradient_rounds": sum(len(FAILED_ROUND.findall(log)) for log in logs),
            "powersgd_first_round": powersgd[0] if powersgd else None, "wall_s": wall_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--target-batch-size", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--rounds", type=int, default=3, help="runs of each variant (alternating order); medians")
    parser.add_argument("--timeout-s", type=float, default=600, help="per run")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR",
                        help="keep the runs' logs and events in DIR (default: a temporary directory)")
    args = parser.parse_args()

    model = build_task(TaskConfig(name="cv", preset="tiny")).build_model()
    payload = {variant: gradient_payload_bytes(variant, model) for variant in args.variants}
    results: dict[str, list[dict]] = {variant: [] for variant in args.variants}
    with tempfile.TemporaryDirectory() as temporary:
        directory = Path(temporary) if args.keep is None else args.keep
        directory.mkdir(parents=True, exist_ok=True)
        coordinator, initial_peers = start_coordinator(directory)
        try:
            for round_index in range(args.rounds):
                order = args.variants if round_index % 2 == 0 else list(reversed(args.variants))
                for variant in order:
                    result = run_variant(variant, round_index, args, initial_peers, directory)
                    results[variant].append(result)
                    print(f"round {round_index + 1}: {variant:<12} {result['averaging_bytes_per_sample']:8.0f} averaging "
                          f"bytes/sample, {result['bytes_per_sample']:8.0f} on the wire "
                          f"(sent {result['sent_bytes_per_sample']:.0f}, received "
                          f"{result['received_bytes_per_sample']:.0f}), final loss {result['final_loss']:.4f}, "
                          f"{result['failed_gradient_rounds']} failed rounds, {result['state_downloads']} state "
                          f"downloads, "
                          f"{result['wall_s']:.0f} s", flush=True)
        finally:
            coordinator.send_signal(signal.SIGTERM)
            coordinator.wait(timeout=30)
    def clean(runs: list[dict]) -> list[dict]:  # without a catch-up download, where there are such runs
        return [r for r in runs if r["state_downloads"] <= 1] or runs

    def median(values: list[float]) -> float:
        return statistics.median(values)

    fp16_bytes = median([r["bytes_per_sample"] for r in clean(results["fp16"])]) if "fp16" in results else None
    fp16_averaging = median([r["averaging_bytes_per_sample"] for r in results["fp16"]]) if "fp16" in results else None
    summary = {}
    for variant, runs in results.items():
        bytes_per_sample = median([r["bytes_per_sample"] for r in clean(runs)])
        averaging_per_sample = median([r["averaging_bytes_per_sample"] for r in runs])
        summary[variant] = {
            "averaging_bytes_per_sample_median": averaging_per_sample,
            "averaging_bytes_per_sample_vs_fp16": averaging_per_sample / fp16_averaging if fp16_averaging else None,
            "every_trainer_returned_averages": all(min(r["averaging_bytes_returned_by_trainer"]) > 0 for r in runs),
            "gradient_payload_bytes_per_round": payload[variant],
            "gradient_payload_vs_fp16": payload[variant] / payload["fp16"] if "fp16" in payload else None,
            "bytes_per_sample_median": bytes_per_sample,
            "bytes_per_sample_vs_fp16": bytes_per_sample / fp16_bytes if fp16_bytes else None,
            "runs_in_bytes_median": len(clean(runs)),
            "final_loss_median": median([r["final_loss"] for r in runs]),
            "params_identical": all(r["params_identical"] for r in runs),
        }
    report = {
        "benchmark": "compression",
        "what": "averaging bytes per trained sample (every all-reduce message, counted once by its reducer), "
                "bytes on the wire per trained sample (whole run, the larger of the trainers' sent and received "
                "totals) and final loss, per gradient compression, same swarm and data",
        "setup": {"peers": args.peers, "task": "cv", "preset": "tiny",
                  "parameters": sum(p.numel() for p in model.parameters()),
                  "target_batch_size": args.target_batch_size, "batch_size_per_step": args.batch_size,
                  "learning_rate": args.lr, "epochs": args.epochs, "rounds": args.rounds,
                  "network_profile": "loopback", "machine": platform.machine(), "cpus": os.cpu_count(),
                  "device": "cpu", "load_average_at_end": os.getloadavg()[0]},
        "summary": summary,
        "runs": results,
        "measured_on": time.strftime("%Y-%m-%d"),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print("variant       payload/round  vs fp16  averaging B/sample  vs fp16   wire B/sample  vs fp16  final loss")
    for variant, row in summary.items():
        print(f"{variant:<13} {row['gradient_payload_bytes_per_round']:>13,}"
              f"  {row['gradient_payload_vs_fp16'] or 0:7.3f}  {row['averaging_bytes_per_sample_median']:>18,.0f}"
              f"  {row['averaging_bytes_per_sample_vs_fp16'] or 0:7.3f}  {row['bytes_per_sample_median']:>13,.0f}"
              f"  {row['bytes_per_sample_vs_fp16'] or 0:7.3f}  {row['final_loss_median']:10.4f}")
    print(f"written to {args.output}")


if __name__ == "__main__":
    main()
