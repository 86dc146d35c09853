"""8-bit parts decode under NumPy 2 once geotrain's decoder is installed (geotrain.hive.patches.quantization).

hivemind's own decoder raises TypeError there, in the receiving peer's handler, so uniform8bit rounds averaged
nothing while they looked done; tests/integration/test_compression.py checks the swarm side.
"""

from __future__ import annotations

import pytest
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2

from geotrain.hive.patches.quantization import install


@pytest.mark.parametrize("compression", [runtime_pb2.UNIFORM_8BIT, runtime_pb2.QUANTILE_8BIT])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_8bit_part_decodes_to_its_tensor_within_the_quantization_error(compression, dtype):
    install()
    generator = torch.Generator().manual_seed(0)
    tensor = (torch.randn(64, 300, generator=generator) * 0.01 + 0.002).to(dtype)
    serialized = serialize_torch_tensor(tensor, compression)
    assert len(serialized.buffer) < tensor.numel() * 1.1, "not 8 bits per value"

    decoded = deserialize_torch_tensor(serialized)

    assert decoded.shape == tensor.shape and decoded.dtype == dtype
    relative_error = float((decoded.float() - tensor.float()).norm() / tensor.float().norm())
    assert relative_error < 0.05, relative_error


def test_a_part_keeps_requires_grad():
    install()
    tensor = torch.linspace(-1, 1, 1000).requires_grad_()
    decoded = deserialize_torch_tensor(serialize_torch_tensor(tensor, runtime_pb2.UNIFORM_8BIT))
    assert decoded.requires_grad
