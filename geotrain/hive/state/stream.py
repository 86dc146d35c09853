"""Reading one donor's state stream: hivemind's ``DownloadData`` messages, each waited for at most a stall bound,
put together into the state's metadata and whole tensors.

Both downloads read this way: the whole state from one donor (:func:`geotrain.hive.state.donors.fetch_from`,
hivemind's ``rpc_download_state``) and a stripe of it from one of several (:func:`geotrain.hive.state.stripes.fetch_part`,
geotrain's ``rpc_download_state_part``). A tensor comes as parts; a part that names a dtype begins a new tensor.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Awaitable, Callable

import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.streaming import combine_from_streaming


async def state_messages(averager, donor_peer_id: str, open_stream: Callable[[object], Awaitable],
                         stall_s: float) -> AsyncIterator[averaging_pb2.DownloadData]:
    """The messages of one download from ``donor_peer_id``; ``open_stream(stub)`` makes the call. Raises
    ``asyncio.TimeoutError`` when the stream does not open, or its next message does not come, within ``stall_s``.
    Use it with ``contextlib.aclosing``: the stream is then closed as soon as the reader stops, not left to the
    garbage collector (a dropped donor would go on sending)."""
    stub = averager.get_stub(averager._p2p, PeerID.from_base58(donor_peer_id), namespace=averager.prefix)
    stream = await asyncio.wait_for(open_stream(stub), stall_s)
    messages = stream.__aiter__()
    try:
        while True:
            try:
                message = await asyncio.wait_for(messages.__anext__(), stall_s)
            except StopAsyncIteration:
                return
            yield message
    finally:
        close = getattr(messages, "aclose", None)
        if close is not None:
            with contextlib.suppress(Exception):
                await close()


class StateAssembler:
    """The metadata and tensors of one stream, message by message."""

    def __init__(self, serializer):
        self.serializer = serializer
        self.metadata = None  # the last metadata a message carried, deserialized
        self.tensors: list[torch.Tensor] = []
        self._parts: list = []

    def add(self, message: averaging_pb2.DownloadData) -> int:
        """Take one message; the bytes of tensor data it carried."""
        if message.metadata:
            self.metadata = self.serializer.loads(message.metadata)
        part = message.tensor_part
        if not part.dtype and not part.buffer:  # a message of metadata alone
            return 0
        if part.dtype and self._parts:  # a new tensor begins: the one before is whole
            self._finish_tensor()
        self._parts.append(part)
        return len(part.buffer)

    def finish(self) -> list[torch.Tensor]:
        """The tensors, the last one included, once the stream has ended."""
        if self._parts:
            try:
                self._finish_tensor()
            except RuntimeError as error:  # a donor that left mid-stream: its last tensor is cut short
                raise RuntimeError(f"the stream ended inside tensor {len(self.tensors)} (the donor left or was cut "
                                   f"off): {error}") from error
        return self.tensors

    def _finish_tensor(self) -> None:
        self.tensors.append(deserialize_torch_tensor(combine_from_streaming(self._parts)))
        self._parts = []
