"""A hostile trainer, for tests: joins a swarm as a geotrain trainer does and poisons what it contributes.

    python tests/integration/hostile_peer.py --mode nan|scale|weight [geotrain peer flags: --initial-peers ...,
        --task cv --preset tiny --target-batch-size 1024 --batch-size 32 --network-profile loopback ...]

It reads its config exactly as ``geotrain peer`` does (the same flags, ``--config`` and ``--set``), builds
the same model from the same task and preset (so hivemind's schema matches the honest peers'), and joins
with geotrain's own :func:`~geotrain.hive.optim.factory.build_hivemind_optimizer`. It trains on real batches
and reports its real progress; only its gradient averager, a subclass of hivemind's plain
``GradientAverager`` (none of geotrain's checks), lies in every averaging round:

- ``nan``: its share of the round's gradients is all NaN;
- ``scale``: its share is its real gradients times 1e6;
- ``weight``: its real gradients, but a weight (sample count) of 1e9, so the mean is all its own.

It refuses and checks nothing: it steps with whatever the rounds bring, and shares its state like any
trainer. It prints one JSON line ``{"hostile_peer_id": ..., "mode": ...}`` once it has joined, so that a
test can look for its libp2p peer id in the honest peers' events, and trains until SIGTERM or SIGINT.
With ``--events`` it writes a ``joined`` event and, for each gradient averaging group it takes part in,
an ``averaging_group`` event with the group's peer ids and the weight it sent (whom its poison reached).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# run as a script from anywhere: geotrain is importable from the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SCALE = 1.0e6
FORGED_WEIGHT = 1.0e9
PEER_WAIT_POLL_S = 0.5


def append_event(path: Path | None, event: str, **fields) -> None:
    """One line in the events file, from any process (hivemind's averagers run in forks of their own)."""
    if path is not None:
        with open(path, "a") as handle:
            handle.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")


def poisoned_averager_class(mode: str, events_path: Path | None) -> type:
    """hivemind's plain GradientAverager with this mode's lie; it writes the peers of each group it averages
    with (event ``averaging_group``), so that a test knows which honest peers received its gradients."""
    import torch
    from hivemind.optim.grad_averager import GradientAverager

    class RecordingGroups(GradientAverager):
        async def _aggregate_with_group(self, group_info, *args, **kwargs):
            # each member's averaging mode (0 node, 1 client, 2 auxiliary) and bandwidth as it told the group:
            # a member that reduces no part (client mode) receives no poison to refuse
            told = [self.serializer.loads(data)[:2] for data in group_info.gathered]
            # and the weight it sends: 0 when hivemind's optimizer only tags along (a peer that has just loaded
            # the state joins a scheduled round with no gradients of its own: no lie is told then)
            append_event(events_path, "averaging_group", peer_id=self.peer_id.to_base58(),
                         peers=[peer.to_base58() for peer in group_info.peer_ids],
                         modes=[mode for _, mode in told], bandwidths=[bandwidth for bandwidth, _ in told],
                         weight=kwargs.get("weight"))
            return await super()._aggregate_with_group(group_info, *args, **kwargs)

    class NaNGradients(RecordingGroups):
        @torch.no_grad()
        def load_accumulators_into_averager_(self):
            super().load_accumulators_into_averager_()
            with self.get_tensors() as averaged_gradients:
                for gradient in averaged_gradients:
                    gradient.fill_(float("nan"))

    class ScaledGradients(RecordingGroups):
        @torch.no_grad()
        def load_accumulators_into_averager_(self):
            super().load_accumulators_into_averager_()
            with self.get_tensors() as averaged_gradients:
                for gradient in averaged_gradients:
                    gradient.mul_(SCALE)

    class ForgedWeight(RecordingGroups):
        def step(self, weight=None, **kwargs):
            return super().step(weight=FORGED_WEIGHT, **kwargs)

    poisoned = {"nan": NaNGradients, "scale": ScaledGradients, "weight": ForgedWeight}[mode]
    # hivemind names an averager's RPCs after its class ("{prefix}::GradientAverager.rpc_join_group"), and
    # geotrain's averagers answer under the names of hivemind's classes (geotrain.hive.averaging.handle_names): under a
    # name of its own this peer could not even join the honest peers' groups, and would poison nothing
    poisoned.__name__ = poisoned.__qualname__ = GradientAverager.__name__
    return poisoned


def wait_for_trainers(dht, run_id: str, wanted: int, timeout_s: float, stop, reader) -> None:
    """As a trainer does: start with the others, or the first epochs would be this peer's alone."""
    deadline = time.monotonic() + timeout_s
    while wanted > 1 and not stop.is_set() and time.monotonic() < deadline:
        if len(reader(dht, run_id)) >= wanted:
            return
        time.sleep(PEER_WAIT_POLL_S)


def main(argv: list[str]) -> int:
    modes = argparse.ArgumentParser(add_help=False)
    modes.add_argument("--mode", required=True, choices=["nan", "scale", "weight"])
    known, peer_arguments = modes.parse_known_args(argv)

    from geotrain.cli import PEER_FLAGS, SWARM_FLAGS, TRAINING_FLAGS, build_parser, config_from_args, setup_logging

    args = build_parser().parse_args(["peer", *peer_arguments])
    setup_logging(args.log_level, f"hostile-{known.mode}")
    config = config_from_args(args, [SWARM_FLAGS, TRAINING_FLAGS, PEER_FLAGS])

    import torch

    from geotrain.events import EventLog
    from geotrain.hive.dht.node import start_dht
    from geotrain.hive.dht.keys import announce_trainer, announced_trainers, read_progress
    from geotrain.hive.optim.leave import leave_swarm
    from geotrain.hive.optim.factory import build_hivemind_optimizer
    from geotrain.stopping.stopper import Stopper
    from geotrain.tasks import build_task

    stopper = Stopper().install_signal_handlers()
    stop = stopper.stop
    torch.set_num_threads(config.training.threads or 1)
    task = build_task(config.task)
    model = task.build_model()
    batch_size = config.optimizer.batch_size_per_step
    data_seed = config.training.data_seed if config.training.data_seed is not None else 1000
    loader = task.build_loader(batch_size, data_seed, workers=0, pin_memory=False)
    run_id = config.swarm.run_id
    wanted, timeout_s = config.training.wait_for_peers, config.training.wait_for_peers_timeout_s
    events_path = config.training.events_path
    events = EventLog(events_path)
    try:
        dht = start_dht(config.swarm)
        peer_id = str(dht.peer_id)
        print(json.dumps({"hostile_peer_id": peer_id, "mode": known.mode}), flush=True)
        events.write("joined", peer_id=peer_id, hostile_mode=known.mode)
        optimizer = build_hivemind_optimizer(config, dht, model,
                                             grad_averager_class=poisoned_averager_class(known.mode, events_path),
                                             checked=False)
        stopper.reclaim_signals()  # hivemind's averagers set SIGINT to SIG_IGN in this process
        try:
            announce_trainer(dht, run_id, peer_id)
            wait_for_trainers(dht, run_id, wanted, timeout_s, stop, announced_trainers)
            model.train()
            steps = 0
            while not stop.is_set():
                loss = task.loss(model, next(loader))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                steps += 1
                if steps == 1:  # hivemind publishes progress after the first step: meet the others again
                    wait_for_trainers(dht, run_id, wanted, timeout_s, stop, read_progress)
        finally:
            leave_swarm(dht, optimizer, run_id, stopper)
    finally:
        events.close()
        loader.close()
        from geotrain.stopping.processes import kill_descendants

        kill_descendants(grace_s=2.0)  # p2pd and hivemind's forks must not outlive this peer
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
