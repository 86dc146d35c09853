"""Two real trainers' optimizers (geotrain's build) on a DHT of two loopback nodes, for tests of what one peer
does with the other's state: the first holds parameters of 1, the second of 0."""

from __future__ import annotations

import contextlib

import hivemind
import torch

from geotrain.hive.optim.factory import build_hivemind_optimizer


@contextlib.contextmanager
def optimizer_pair(config):
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    second = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                          initial_peers=[str(a) for a in first.get_visible_maddrs()])
    made = []
    try:
        for dht, value in ((first, 1.0), (second, 0.0)):
            model = torch.nn.Linear(4, 2)
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.fill_(value)
            made.append((model, build_hivemind_optimizer(config, dht, model)))
        yield made
    finally:
        for _, optimizer in made:
            optimizer.shutdown()
        second.shutdown()
        first.shutdown()
