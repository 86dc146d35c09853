"""A bare hivemind.Optimizer training loop: the baseline that geotrain's trainer is measured against.

It trains the same model on the same data with the same hivemind settings as a geotrain trainer on the
`loopback` profile, and does nothing else: no timing, no events, no metrics. It writes one JSON line
per epoch (time, epoch, samples) so the benchmark can compute samples/s the same way for both.

    python benchmarks/bare_hivemind_peer.py --initial-peers /ip4/... --epochs 6 --events out.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import hivemind
from hivemind.compression import Float16Compression
from hivemind.optim.grad_averager import GradientAverager
import torch

from geotrain.config import NETWORK_PROFILES, TaskConfig
from geotrain.tasks import build_task


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", action="append", required=True)
    parser.add_argument("--run-id", default="bare")
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--target-batch-size", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--data-seed", type=int, required=True)
    parser.add_argument("--events", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    profile = NETWORK_PROFILES["loopback"]

    task = build_task(TaskConfig(name="cv", preset="tiny", seed=0))
    model = task.build_model()
    batches = task.build_data(args.batch_size, args.data_seed)
    dht = hivemind.DHT(initial_peers=args.initial_peers, start=True)
    optimizer = hivemind.Optimizer(
        dht=dht, run_id=args.run_id, target_batch_size=args.target_batch_size,
        batch_size_per_step=args.batch_size, optimizer=partial(torch.optim.AdamW, lr=args.lr),
        params=model.parameters(), matchmaking_time=profile["matchmaking_time_s"],
        averaging_timeout=profile["averaging_timeout_s"],
        grad_compression=Float16Compression(), state_averaging_compression=Float16Compression(),
        tracker_opts={"default_refresh_period": 0.5, "min_refresh_period": 0.5, "max_refresh_period": 2.0},
        grad_averager_factory=partial(GradientAverager, request_timeout=profile["request_timeout_s"]),
        averager_opts={"request_timeout": profile["request_timeout_s"]},
    )
    samples = 0
    with open(args.events, "a", buffering=1) as events:
        events.write(json.dumps({"event": "training", "time": time.time()}) + "\n")
        epoch = optimizer.local_epoch
        while epoch < args.epochs:
            loss = task.loss(model, next(batches))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            samples += args.batch_size
            if optimizer.local_epoch != epoch:
                epoch = optimizer.local_epoch
                events.write(json.dumps({"event": "epoch", "time": time.time(), "epoch": epoch,
                                         "samples": samples}) + "\n")
                samples = 0
    optimizer.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main()
