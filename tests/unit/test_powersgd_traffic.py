"""What one PowerSGD round sends (geotrain.hive.averaging.powersgd): the count the planner and the trainer's log use,
against hivemind's own choice of the tensors it sends as they are."""

from __future__ import annotations

import hivemind
import torch

from geotrain.hive.averaging.powersgd import PowerSGDKeepingAverager, values_on_the_wire

# a conv kernel (64 x 3*7*7), a bias, a linear layer, and a matrix that rank 4 would not shrink twofold
SHAPES = [(64, 3, 7, 7), (64,), (1000, 512), (8, 8)]


def test_factors_for_matrices_that_shrink_twofold_the_rest_as_it_is():
    factors, plain = values_on_the_wire(SHAPES, rank=4)
    assert factors == 4 * (64 + 147) + 4 * (1000 + 512)
    assert plain == 64 + 8 * 8


def test_the_count_agrees_with_the_tensors_hivemind_sends_as_they_are():
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    parameters = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]
    averager = PowerSGDKeepingAverager(parameters, dht=dht, prefix="traffic", averager_rank=4, start=False)
    try:
        assert averager._uncompressed_gradients_indexes == {1, 3}
        assert averager.describe_traffic().startswith(
            "rank 4 factors of 2 gradient matrices (6892 values) and 2 tensors as they are (128 values)")
    finally:
        averager.shutdown()
        dht.shutdown()
