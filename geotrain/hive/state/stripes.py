"""A state download from several donors at once, each sending stripes of the state's tensors.

Between continents one donor's link limits a download: in the churn soak the state crossed one emulated link
at its full rate (1.02-1.03x the bound, docs/state-transfer.md), and the others that held the same state sat
idle ([EMJ24] Table 3 measures a single TCP stream per region pair: a stream from each of several regions adds
up). When the nearest current donor is in another region and the state is large, :func:`download_striped`
asks up to ``max_donors`` donors that hold the same epoch, in as many regions, for stripes of it at once
(:func:`stripe_donors`):

1. **Header**: the first donor's metadata and the bytes of each of its tensors (a part request for no tensors).
2. **Stripes**: contiguous runs of tensors of about equal bytes (:func:`plan_stripes`), ``STRIPES_PER_DONOR``
   per donor. Each donor takes the next stripe as soon as it has sent the last one, so a faster link sends
   more of them; once none is left, an idle donor also asks for a stripe still under way elsewhere, and the
   first copy to arrive is kept (a slow link does not hold up the end).
3. **Checks**: every stripe must come from a state of the header's epoch and hold tensors of the header's
   sizes, and ``refusal`` (non-finite values) must find nothing wrong with it. A donor that stalls, fails, sends
   another epoch or is refused is dropped, and its stripe goes back to the others. When no donor is left for a
   stripe, the download returns None and the caller downloads the whole state from one donor.

A donor serves stripes with ``rpc_download_state_part`` (geotrain.hive.guard.contributions): the request is a
``DownloadData`` whose metadata names the download and the tensors wanted (:class:`PartRequest`). All stripes of
one download come from one snapshot of that donor's state (:class:`StateSnapshots`), as a whole download from
one donor does, so a donor that steps during the download still sends the epoch it began with.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from dataclasses import dataclass, field

from hivemind.compression import CompressionInfo
from hivemind.proto import averaging_pb2
from hivemind.utils.streaming import split_for_streaming

from geotrain.hive.state.donors import LOG_EVERY_S, STATE_BYTES_KEY, Attempt, Donor, DownloadProgress, _eta, _megabytes
from geotrain.hive.state.stream import StateAssembler, state_messages

logger = logging.getLogger(__name__)

PART_KEY = "geotrain_part"  # in a part request's metadata: {"download": str, "first": int, "stop": int}
TENSOR_BYTES_KEY = "geotrain_tensor_bytes"  # in a part answer's metadata: the bytes of each tensor of the state
STRIPES_PER_DONOR = 2
SNAPSHOT_KEEP_S = 60.0  # a donor keeps the snapshot a download's stripes come from this long after its last use
MAX_DOWNLOAD_ID_CHARS = 64
IDLE_POLL_S = 0.05


class PartRequestError(ValueError):
    """A part request that does not say which download and which tensors it wants."""


@dataclass(frozen=True)
class PartRequest:
    download: str  # the downloader's name for one download: all its parts come from one snapshot
    first: int  # the first tensor index wanted
    stop: int  # one past the last (first == stop: the header only)

    def to_message(self, serializer) -> averaging_pb2.DownloadData:
        return averaging_pb2.DownloadData(metadata=serializer.dumps(
            {PART_KEY: {"download": self.download, "first": self.first, "stop": self.stop}}))

    @classmethod
    def from_message(cls, message: averaging_pb2.DownloadData, serializer) -> "PartRequest":
        try:
            fields = serializer.loads(message.metadata)[PART_KEY]
            download, first, stop = fields["download"], fields["first"], fields["stop"]
        except Exception as error:
            raise PartRequestError(f"not a part request ({type(error).__name__})") from None
        if not isinstance(download, str) or not 0 < len(download) <= MAX_DOWNLOAD_ID_CHARS:
            raise PartRequestError("the download's name is not a short string")
        if not (isinstance(first, int) and isinstance(stop, int) and 0 <= first <= stop):
            raise PartRequestError(f"tensors [{first!r}, {stop!r}) are not a range")
        return cls(download, first, stop)


class StateSnapshots:
    """(donor side, in the averager's process) The snapshot each download's parts come from, per downloader
    and download; at most ``limit`` kept, each until ``SNAPSHOT_KEEP_S`` after its last use."""

    def __init__(self, limit: int):
        self.limit = limit
        self._kept: dict[tuple[str, str], list] = {}  # (peer, download) -> [last use, snapshot]

    async def get(self, peer: str, download: str, take_snapshot):
        now = time.monotonic()
        for key in [key for key, (used, _) in self._kept.items() if now - used > SNAPSHOT_KEEP_S]:
            del self._kept[key]
        key = (peer, download)
        if key not in self._kept:
            for oldest in sorted(self._kept, key=lambda k: self._kept[k][0])[:max(0, len(self._kept) - self.limit + 1)]:
                del self._kept[oldest]
            self._kept[key] = [now, await take_snapshot()]
        entry = self._kept[key]
        entry[0] = now
        return entry[1]


def part_messages(snapshot, part: PartRequest, compression, serializer):
    """(donor side) The messages of one part: the metadata (with each tensor's bytes) first, then the
    tensors ``[first, stop)`` of the snapshot in hivemind's streaming chunks."""
    metadata, tensors, infos = snapshot  # the metadata as hivemind's host process sends it: serialized
    if infos is None:
        infos = [CompressionInfo.from_tensor(tensor, key=i) for i, tensor in enumerate(tensors)]
    header = serializer.loads(metadata)
    if isinstance(header, dict):
        header = {**header, TENSOR_BYTES_KEY: [int(t.numel() * t.element_size()) for t in tensors]}
    yield averaging_pb2.DownloadData(metadata=serializer.dumps(header))
    for index in range(part.first, min(part.stop, len(tensors))):
        for chunk in split_for_streaming(compression.compress(tensors[index], infos[index], allow_inplace=False)):
            yield averaging_pb2.DownloadData(tensor_part=chunk)


def plan_stripes(tensor_bytes: list[int], count: int) -> list[tuple[int, int]]:
    """At most ``count`` contiguous runs ``(first, stop)`` of tensor indices that cover them all, each close to
    an equal share of the bytes (a tensor is never split)."""
    total = sum(tensor_bytes)
    count = max(1, min(count, len(tensor_bytes)))
    stripes, first, sent = [], 0, 0
    for index, size in enumerate(tensor_bytes):
        sent += size
        left = len(tensor_bytes) - index - 1
        if len(stripes) < count - 1 and left > 0 and sent >= total * (len(stripes) + 1) / count:
            stripes.append((first, index + 1))
            first = index + 1
    if first < len(tensor_bytes):
        stripes.append((first, len(tensor_bytes)))
    return stripes


def stripe_donors(donors: list[Donor], own_region: str | None, max_donors: int) -> list[Donor]:
    """The donors to stripe over, given donors in the order to ask them (geotrain.hive.state.donors.rank_donors):
    donors of one epoch, one per region (donors in one region share its link to this peer; a donor of unknown
    region counts as a region of its own), at most ``max_donors``, in their order. The epoch is the one, of the
    first donor's or a newer one, that the most regions hold (the newest of a tie): right after the swarm's
    step, the nearest donor may not have declared it yet while the others have. Donors that did not answer the
    probe are left out when others did. None at all (download from one) when fewer than two qualify, or when
    the first is in this peer's own region: its link is the fast one."""
    if any(donor.rtt_s is not None for donor in donors):
        donors = [donor for donor in donors if donor.rtt_s is not None]
    if max_donors < 2 or not donors or (own_region is not None and donors[0].region == own_region):
        return []
    best: list[Donor] = []
    for epoch in sorted({donor.epoch for donor in donors if donor.epoch >= donors[0].epoch}, reverse=True):
        chosen, regions = [], set()
        for donor in donors:
            if donor.epoch != epoch or (donor.region is not None and donor.region in regions):
                continue
            chosen.append(donor)
            regions.add(donor.region)
            if len(chosen) == max_donors:
                break
        if len(chosen) > len(best):
            best = chosen
    return best if len(best) >= 2 else []


class StripeFailed(Exception):
    def __init__(self, result: str, detail: str = ""):
        super().__init__(f"{result}{': ' + detail if detail else ''}")
        self.result = result  # one of geotrain.hive.state.donors.RESULTS


async def fetch_part(averager, donor: Donor, part: PartRequest, *, stall_s: float, on_bytes=None):
    """One part from one donor: (metadata, tensors); StripeFailed when it stalls, fails or sends nothing."""
    state = StateAssembler(averager.serializer)
    try:
        stream = state_messages(averager, donor.peer_id,
                                lambda stub: stub.rpc_download_state_part(part.to_message(averager.serializer)),
                                stall_s)
        async with contextlib.aclosing(stream) as messages:
            async for message in messages:
                received = state.add(message)
                if received and on_bytes is not None:
                    on_bytes(received)
        tensors = state.finish()
    except asyncio.TimeoutError:
        raise StripeFailed("stalled", f"nothing for {stall_s:.0f} s") from None
    except StripeFailed:
        raise
    except Exception as error:  # the donor left, refused, or does not serve parts (an older geotrain)
        raise StripeFailed("failed", repr(error)) from None
    if state.metadata is None:
        raise StripeFailed("empty", "the donor sent nothing (it refused, or offers no state)")
    return state.metadata, tensors


def _epoch(metadata) -> object:
    return metadata.get("epoch") if isinstance(metadata, dict) else None


@dataclass
class _Download:
    """The state of one striped download (one event loop: no locks)."""

    stripes: list[tuple[int, int]]
    pending: list[int]
    done: dict[int, list] = field(default_factory=dict)
    running: dict[int, dict[str, asyncio.Task]] = field(default_factory=dict)  # stripe -> donor -> its fetch
    sent_by: dict[str, int] = field(default_factory=dict)  # donor -> bytes of its stripes that were kept
    received: int = 0

    def next_stripe(self) -> int | None:
        """A stripe nobody has, else one still under way at a single donor (the end: ask a second donor)."""
        if self.pending:
            return self.pending.pop(0)
        alone = [index for index, tasks in self.running.items() if index not in self.done and len(tasks) == 1]
        return alone[0] if alone else None

    def forget(self, index: int, peer_id: str) -> None:
        """The fetch of stripe ``index`` by ``peer_id`` is over."""
        running = self.running.get(index, {})
        running.pop(peer_id, None)
        if not running:
            self.running.pop(index, None)

    def give_back(self, index: int) -> None:
        """A stripe whose fetch failed: to the next donor free, unless another has it or is fetching it."""
        if index not in self.done and not self.running.get(index) and index not in self.pending:
            self.pending.insert(0, index)


async def download_striped(averager, donors: list[Donor], *, stall_s: float,
                           progress: DownloadProgress | None = None, refusal=None) -> Attempt | None:
    """The state in stripes from ``donors`` at once (the first also sends the header); None when it could not
    be completed (the caller then downloads from one donor). ``refusal(attempt)`` checks each stripe's tensors
    (``attempt.state`` is (metadata, tensors of the stripe)) and returns a reason to refuse them, or None."""
    started = time.monotonic()
    download = secrets.token_hex(8)
    first = donors[0]
    try:
        header, _ = await fetch_part(averager, first, PartRequest(download, 0, 0), stall_s=stall_s)
        tensor_bytes = header.get(TENSOR_BYTES_KEY) if isinstance(header, dict) else None
        if not (isinstance(tensor_bytes, list) and tensor_bytes and all(isinstance(b, int) and b >= 0
                                                                       for b in tensor_bytes)):
            raise StripeFailed("failed", "its answer does not list the state's tensors")
    except StripeFailed as error:
        logger.info("no striped download: the first donor %s did not send the state's header (%s)", first.peer_id,
                    error)
        return None
    expected = int(header.get(STATE_BYTES_KEY) or sum(tensor_bytes))
    state = _Download(plan_stripes(tensor_bytes, STRIPES_PER_DONOR * len(donors)), [])
    state.pending = list(range(len(state.stripes)))
    logger.info("downloading the state (%.1f MB, epoch %s) in %d stripes from %d donors at once: %s",
                expected / 1e6, _epoch(header), len(state.stripes), len(donors),
                ", ".join(f"{d.peer_id} ({d.region or 'region unknown'})" for d in donors))
    last_log = [started]

    def count(size: int) -> None:
        state.received += size
        now = time.monotonic()
        rate = state.received / max(now - started, 1e-9)
        if progress is not None:
            progress.update(state.received, expected, rate)
        if now - last_log[0] >= LOG_EVERY_S:
            last_log[0] = now
            logger.info("striped state download: %s, %.2f MB/s from %d donors%s", _megabytes(state.received, expected),
                        rate / 1e6, len(donors), _eta(state.received, expected, rate))

    def problem(donor: Donor, index: int, metadata, tensors) -> str | None:
        stripe_first, stripe_stop = state.stripes[index]
        if _epoch(metadata) != _epoch(header):
            return f"a state of epoch {_epoch(metadata)}, not {_epoch(header)}"
        sizes = [int(t.numel() * t.element_size()) for t in tensors]
        if sizes != tensor_bytes[stripe_first:stripe_stop]:
            return "tensors of other sizes than the header's"
        if refusal is not None:
            return refusal(Attempt(donor, "ok", sum(sizes), time.monotonic() - started, (metadata, tensors)))
        return None

    async def serve(donor: Donor) -> None:
        while len(state.done) < len(state.stripes):
            index = state.next_stripe()
            if index is None:
                if not state.running:
                    return  # nothing is left that a failure could give back
                await asyncio.sleep(IDLE_POLL_S)  # every stripe is under way at two donors: one may fail yet
                continue
            stripe_first, stripe_stop = state.stripes[index]
            task = asyncio.ensure_future(fetch_part(averager, donor, PartRequest(download, stripe_first, stripe_stop),
                                                    stall_s=stall_s, on_bytes=count))
            state.running.setdefault(index, {})[donor.peer_id] = task
            failure = None
            try:
                metadata, tensors = await task
            except asyncio.CancelledError:
                state.forget(index, donor.peer_id)
                if asyncio.current_task().cancelling() == 0 and index in state.done:
                    continue  # another donor sent this stripe first
                raise
            except StripeFailed as error:
                failure = error
            state.forget(index, donor.peer_id)
            if failure is not None:
                logger.warning("dropped donor %s (%s) from the striped download: %s", donor.peer_id,
                               donor.region or "region unknown", failure)
                state.give_back(index)
                return
            if index in state.done:
                continue
            reason = problem(donor, index, metadata, tensors)
            if reason is not None:
                logger.warning("refused a stripe from donor %s and dropped it from the download: %s", donor.peer_id,
                               reason)
                state.give_back(index)
                return
            state.done[index] = tensors
            state.sent_by[donor.peer_id] = state.sent_by.get(donor.peer_id, 0) + \
                sum(int(t.numel() * t.element_size()) for t in tensors)
            for other in list(state.running.get(index, {}).values()):
                other.cancel()

    workers = [asyncio.ensure_future(serve(donor)) for donor in donors]
    try:
        await asyncio.gather(*workers)
    finally:
        for worker in workers:
            worker.cancel()
        for tasks in list(state.running.values()):
            for task in tasks.values():
                task.cancel()
    seconds = time.monotonic() - started
    if len(state.done) < len(state.stripes):
        logger.warning("striped state download incomplete after %.1f s: %d of %d stripes (no donor left for the "
                       "rest)", seconds, len(state.done), len(state.stripes))
        if progress is not None:
            progress.finish("failed", state.received)
        return None
    tensors = [tensor for index in range(len(state.stripes)) for tensor in state.done[index]]
    metadata = {key: value for key, value in header.items() if key != TENSOR_BYTES_KEY}
    logger.info("downloaded the state in stripes: %.1f MB in %.1f s (%.2f MB/s): %s", state.received / 1e6,
                seconds, state.received / max(seconds, 1e-9) / 1e6,
                ", ".join(f"{sent / 1e6:.1f} MB from {peer}" for peer, sent in state.sent_by.items()))
    if progress is not None:
        progress.finish("ok", state.received)
    return Attempt(first, "ok", state.received, seconds, (metadata, tensors), stripes=dict(state.sent_by),
                   state_bytes=expected)
