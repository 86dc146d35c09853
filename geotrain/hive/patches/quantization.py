"""hivemind's 8-bit quantizations, made decodable under NumPy 2.

hivemind 1.1.12 reads the codebook size of an 8-bit part (``uniform8bit``, and its quantile variant) as
``int(np.frombuffer(buffer, count=1, dtype=np.int64))``: a one-element array made a scalar, which NumPy 2
refuses (TypeError: only 0-dimensional arrays can be converted to Python scalars). So every 8-bit part that
a peer received failed in its handler, each reducer averaged its own part alone, and every trainer stepped
on its own gradients, while hivemind called the rounds done ("Reducer: received 50.0% of input tensors", a
warning). :func:`install` gives hivemind's 8-bit quantizations a decoder that works: the buffer's layout is
the one their encoder writes (the codebook size as a native int64, the float32 codebook, then one uint8 code
per value).
"""

from __future__ import annotations

import struct

import numpy as np
import torch
from hivemind.compression.quantization import Quantization
from hivemind.proto import runtime_pb2

_CODEBOOK_SIZE = struct.Struct("=q")  # np.int64(n).tobytes(): native byte order


def extract_quantized(self: Quantization, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
    """The tensor an 8-bit part encodes: each code looked up in the part's codebook."""
    buffer = serialized_tensor.buffer
    (codebook_size,) = _CODEBOOK_SIZE.unpack_from(buffer)
    codebook_start = _CODEBOOK_SIZE.size
    codes_start = codebook_start + codebook_size * np.dtype(self.codebook_dtype).itemsize
    codebook = np.frombuffer(buffer, dtype=self.codebook_dtype, count=codebook_size, offset=codebook_start)
    codes = np.frombuffer(buffer, dtype=self.indices_dtype, offset=codes_start)
    values = torch.from_numpy(codebook.copy()).to(getattr(torch, serialized_tensor.dtype))
    indices = torch.from_numpy(codes.astype(np.int64)).reshape(tuple(serialized_tensor.size))
    return values[indices].requires_grad_(serialized_tensor.requires_grad)


def install() -> None:
    """Decode hivemind's 8-bit parts with :func:`extract_quantized`, in this process and those it forks."""
    Quantization.extract = extract_quantized
