"""Where a peer downloads the swarm's state from, and how it watches the download.

hivemind asks state donors in the order of the priority they announce (their epoch), wherever they are:
a trainer that rejoins in Australia may pull the whole state from Europe over a thin link while another
Australian trainer holds the same epoch. geotrain's state averagers (:meth:`StateDownloadMixin._load_state_from_peers`
in :mod:`geotrain.hive.state.downloader`) download with :func:`download_state` instead:

1. **Order** (:func:`rank_donors`): donors that hold the newest epoch (within ``epoch_tolerance``: a peer
   that loaded a state one epoch old catches up with the swarm's epoch; never one at this peer's own epoch
   when another holds a newer one), then those in this peer's region (the ``region`` label of their signed
   metric record), then by measured round trip (one TCP handshake with the address in that record, all donors
   probed at once; round trips within 5 ms tie; a donor that does not answer the probe comes after those that
   do), then by announced priority (the coordinator's is half an
   epoch above the trainers', so it wins a tie, and only a tie: a durable VM that does not train has the spare
   CPU to serve). Region and address are what each peer says of itself: a peer that lies about them can reorder donors (bounded by
   the rules below), never change what is downloaded (that is checked: non-finite, epoch, DiLoCo bounds).
   A peer id claimed by records that disagree is ranked as unknown.
2. **Watch**: a donor that sends nothing for ``stall_s`` is dropped for the next one; one that is still
   below ``min_rate_bytes_s`` after ``probation_s`` is dropped when another donor remains, and the last one
   gets ``state bytes / min rate`` (the donor says the state's size in its first message) before it is
   dropped. So the time a download may take follows from the state's bytes and the expected rate, not from a
   fixed timeout.
3. **Report**: progress (MB, MB/s, ETA) in the log every ``LOG_EVERY_S``; the shared
   :class:`DownloadProgress` feeds the peer's metrics (``geotrain_state_download_*``); each attempt is an
   event ``state_download`` (donor, its region and round trip, result, bytes, seconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import math
import multiprocessing
import time
from dataclasses import dataclass

from hivemind.proto import averaging_pb2

from geotrain.hive.state.stream import StateAssembler, state_messages

logger = logging.getLogger(__name__)

LOG_EVERY_S = 10.0
PROBE_TIMEOUT_S = 2.0
PROBATION_S = 10.0
RTT_RESOLUTION_S = 0.005
STATE_BYTES_KEY = "geotrain_state_bytes"  # added to the metadata a donor sends (geotrain.hive.guard.contributions)
RESULTS = ("ok", "stalled", "slow", "empty", "failed", "refused")


@dataclass(frozen=True)
class Donor:
    peer_id: str
    priority: float  # as announced in hivemind's donor record: the epoch (+ 0.5 for the coordinator)
    region: str | None = None
    rtt_s: float | None = None

    @property
    def epoch(self) -> int:
        return int(math.floor(self.priority))


def rank_donors(donors: list[Donor], own_region: str | None, epoch_tolerance: int = 1,
                min_epoch: int | None = None) -> list[Donor]:
    """Donors in the order to ask them: newest state, same region, shortest round trip, highest priority.

    ``min_epoch``: the first epoch of use to this peer, its own plus one (a donor at its own epoch has nothing
    new for it). When a donor holds it, donors below it are behind whatever the tolerance.
    """
    if not donors:
        return []
    newest = max(donor.epoch for donor in donors)
    anyone_answered = any(donor.rtt_s is not None for donor in donors)
    current_from = newest - epoch_tolerance
    if min_epoch is not None and newest >= min_epoch:
        current_from = max(current_from, min_epoch)

    def key(donor: Donor):
        far = own_region is None or donor.region != own_region
        # round trips within RTT_RESOLUTION_S of each other tie (one data centre): the priority decides
        rtt = math.ceil(donor.rtt_s / RTT_RESOLUTION_S) if donor.rtt_s is not None else math.inf
        if donor.epoch >= current_from:
            # a donor whose address did not answer the probe (a SIGKILLed peer's record lingers until it
            # expires) comes after every one that did, however near it says it is
            return (0, donor.rtt_s is None and anyone_answered, far, rtt, -donor.priority, donor.peer_id)
        return (1, -donor.priority, far, rtt, donor.peer_id)  # behind: the newest of them first

    return sorted(donors, key=key)


def donor_labels(records) -> dict[str, tuple[str, list[str]]]:
    """peer id -> (region, addresses) from metric records (geotrain.hive.dht.metric_records.read_records);
    a peer id that records disagree on is left out."""
    labels: dict[str, tuple[str, list[str]]] = {}
    conflicting: set[str] = set()
    for entry in records.values():
        record = entry.record
        label = (record.region, sorted(record.addresses))
        if record.peer_id in labels and labels[record.peer_id] != label:
            conflicting.add(record.peer_id)
        labels[record.peer_id] = label
    return {peer_id: label for peer_id, label in labels.items() if peer_id not in conflicting}


def _host_port(address: str) -> tuple[str, int] | None:
    """("ip", port) of an "ip:port" or "[ip6]:port" label; None for anything else (no name is resolved)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        ipaddress.ip_address(host)
        number = int(port)
    except ValueError:
        return None
    return (host, number) if 0 < number < 65536 else None


async def probe_rtt_s(addresses: list[str], timeout_s: float = PROBE_TIMEOUT_S) -> float | None:
    """The shortest TCP handshake with any of ``addresses``: one round trip; None when none answers."""
    best = None
    for address in addresses:
        target = _host_port(address)
        if target is None:
            continue
        started = time.monotonic()
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(*target), timeout_s)
        except (OSError, asyncio.TimeoutError):
            continue
        elapsed = time.monotonic() - started
        writer.close()
        best = elapsed if best is None else min(best, elapsed)
    return best


async def measure_donors(candidates: dict[str, float], labels: dict[str, tuple[str, list[str]]]) -> list[Donor]:
    """Donors with their regions and round trips (probed concurrently)."""
    names = list(candidates)
    rtts = await asyncio.gather(*(probe_rtt_s(labels[name][1]) if name in labels else _none() for name in names))
    return [Donor(name, candidates[name], labels[name][0] if name in labels else None, rtt)
            for name, rtt in zip(names, rtts)]


async def _none():
    return None


class DownloadProgress:
    """The state download in progress and the totals, in shared memory (the averager's process writes,
    the peer's metrics read)."""

    FIELDS = ("received_bytes", "expected_bytes", "bytes_per_second", "bytes_total")

    def __init__(self):
        self._values = multiprocessing.Array("d", len(self.FIELDS) + len(RESULTS), lock=True)

    def _set(self, **values) -> None:
        with self._values.get_lock():
            for name, value in values.items():
                self._values[self.FIELDS.index(name)] = value

    def update(self, received_bytes: float, expected_bytes: float, bytes_per_second: float) -> None:
        self._set(received_bytes=received_bytes, expected_bytes=expected_bytes, bytes_per_second=bytes_per_second)

    def finish(self, result: str, received_bytes: float) -> None:
        with self._values.get_lock():
            self._values[self.FIELDS.index("bytes_total")] += received_bytes
            self._values[len(self.FIELDS) + RESULTS.index(result)] += 1
            for name in ("received_bytes", "expected_bytes", "bytes_per_second"):
                self._values[self.FIELDS.index(name)] = 0.0

    def snapshot(self) -> dict:
        with self._values.get_lock():
            values = list(self._values[:])
        snapshot = dict(zip(self.FIELDS, values[:len(self.FIELDS)]))
        snapshot["attempts"] = dict(zip(RESULTS, (int(v) for v in values[len(self.FIELDS):])))
        return snapshot


class OwnEpoch:
    """The epoch of the state a peer holds, said by its main process before a load and read by its averager's
    process, which ranks donors (shared memory, made before the averagers fork)."""

    def __init__(self):
        self._epoch = multiprocessing.Value("q", -1, lock=True)
        self._newer_only = multiprocessing.Value("b", 0, lock=True)

    def note(self, epoch: int, newer_only: bool = False) -> None:
        """(the main process, before a load) The peer holds the state of ``epoch``: donors at it have nothing new.
        ``newer_only``: take no state but a newer one (a peer at ``epoch`` or behind is not asked, and a state of
        ``epoch`` or before is refused) rather than fall back on one as new as its own."""
        self._epoch.value = epoch
        self._newer_only.value = int(newer_only)

    def newer_only(self) -> bool:
        return bool(self._newer_only.value)

    def first_new_epoch(self) -> int | None:
        """The first epoch whose state is new to the peer; None when it did not say."""
        value = self._epoch.value
        return None if value < 0 else value + 1


@dataclass
class Attempt:
    donor: Donor
    result: str  # one of RESULTS
    received_bytes: int
    seconds: float
    state: tuple | None = None  # (metadata, tensors) when result is "ok"
    stripes: dict[str, int] | None = None  # a striped download's bytes from each donor (geotrain.hive.state.stripes)
    state_bytes: int | None = None  # the state's size, when it differs from the bytes received (stripes that two
    # donors sent at once count twice in received_bytes)

    @property
    def bytes_per_second(self) -> float:
        return self.received_bytes / self.seconds if self.seconds > 0 else 0.0


async def fetch_from(averager, donor: Donor, *, last: bool, stall_s: float, min_rate_bytes_s: float,
                     progress: DownloadProgress | None, probation_s: float = PROBATION_S) -> Attempt:
    """One donor's state, watched: stalled, slow (unless ``last``, then bounded by bytes / min rate), empty."""
    started = time.monotonic()
    received, expected = 0, None
    state = StateAssembler(averager.serializer)
    last_log = started
    try:
        stream = state_messages(averager, donor.peer_id,
                                lambda stub: stub.rpc_download_state(averaging_pb2.DownloadRequest()), stall_s)
        async with contextlib.aclosing(stream) as messages:
            async for message in messages:
                received += state.add(message)
                if expected is None and isinstance(state.metadata, dict) \
                        and isinstance(state.metadata.get(STATE_BYTES_KEY), int):
                    expected = state.metadata[STATE_BYTES_KEY]
                now = time.monotonic()
                elapsed = now - started
                rate = received / elapsed if elapsed > 0 else 0.0
                if progress is not None:
                    progress.update(received, expected or 0, rate)
                if now - last_log >= LOG_EVERY_S:
                    last_log = now
                    logger.info("state download from %s (%s): %s, %.2f MB/s%s", donor.peer_id,
                                donor.region or "region unknown", _megabytes(received, expected), rate / 1e6,
                                _eta(received, expected, rate))
                if elapsed > probation_s and rate < min_rate_bytes_s:
                    bound_s = (expected or 0) / min_rate_bytes_s + probation_s
                    if not last or elapsed > bound_s:
                        return Attempt(donor, "slow", received, elapsed)
        tensors = state.finish()
    except asyncio.TimeoutError:
        return Attempt(donor, "stalled", received, time.monotonic() - started)
    except Exception as error:  # the donor left, refused or sent garbage: ask the next one
        logger.info("state download from %s failed: %r", donor.peer_id, error)
        return Attempt(donor, "failed", received, time.monotonic() - started)
    if not state.metadata:
        return Attempt(donor, "empty", received, time.monotonic() - started)
    return Attempt(donor, "ok", received, time.monotonic() - started, (state.metadata, tensors))


async def download_state(averager, donors: list[Donor], *, stall_s: float, min_rate_bytes_s: float,
                         probation_s: float = PROBATION_S, progress: DownloadProgress | None = None,
                         on_attempt=None, refusal=None) -> Attempt | None:
    """Ask ``donors`` in order until one sends a whole state that ``refusal(attempt)`` (when given) finds
    nothing wrong with (it returns a reason, or None); the successful attempt, or None."""
    for index, donor in enumerate(donors):
        if donor.peer_id == averager.peer_id.to_base58():
            continue
        logger.info("downloading the state from %s (%s, %s)", donor.peer_id, donor.region or "region unknown",
                    "round trip unknown" if donor.rtt_s is None else f"round trip {1000 * donor.rtt_s:.0f} ms")
        attempt = await fetch_from(averager, donor, last=index == len(donors) - 1, stall_s=stall_s,
                                   min_rate_bytes_s=min_rate_bytes_s, progress=progress, probation_s=probation_s)
        reason = refusal(attempt) if refusal is not None and attempt.result == "ok" else None
        if reason is not None:
            attempt = Attempt(donor, "refused", attempt.received_bytes, attempt.seconds)
        if progress is not None:
            progress.finish(attempt.result, attempt.received_bytes)
        if on_attempt is not None:
            on_attempt(attempt)
        if attempt.result == "ok":
            logger.info("downloaded the state from %s (%s): %.1f MB in %.1f s (%.2f MB/s)", donor.peer_id,
                        donor.region or "region unknown", attempt.received_bytes / 1e6, attempt.seconds,
                        attempt.bytes_per_second / 1e6)
            return attempt
        if attempt.result != "empty":
            logger.warning("state download from %s %s after %.1f s (%s, %.2f MB/s)%s", donor.peer_id,
                           attempt.result if reason is None else f"refused ({reason})", attempt.seconds,
                           _megabytes(attempt.received_bytes, None), attempt.bytes_per_second / 1e6,
                           "; asking the next donor" if index < len(donors) - 1 else "; no donor left")
    return None


def _megabytes(received: float, expected: float | None) -> str:
    return f"{received / 1e6:.1f} MB" if not expected else f"{received / 1e6:.1f} of {expected / 1e6:.1f} MB"


def _eta(received: float, expected: float | None, rate: float) -> str:
    if not expected or rate <= 0:
        return ""
    return f", about {max(0.0, expected - received) / rate:.0f} s left"
