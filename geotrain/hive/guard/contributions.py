"""What every peer checks so that one bad peer cannot break the swarm (docs/security.md).

hivemind's all-reduce splits the gradient vector into parts; each peer of a group *reduces* one span of
them: it receives every group member's tensor for each of its parts, takes the weighted mean (weights are
what each sender says it accumulated) and sends the mean back. hivemind trusts both the values and the
weights. Here, a peer's averagers (:class:`GuardedAveragerMixin`) check every part a remote sender
streams to them before hivemind's reducer sees it (:func:`contribution_refusal`):

- non-finite values (an fp16 overflow, a failing GPU, malice),
- an L2 norm over ``guard.contribution_norm_factor`` times this peer's own gradient for the same part,
- a weight over ``guard.max_claimed_batches`` target batches (more samples than any peer processes in
  one round).

A refused sender is dropped from the round by hivemind's own mechanism (an exception while its stream is
read: hivemind bans it and averages the others), named in the events (``contribution_refused``) and the
log, and left out of this peer's groups for ``guard.ban_s``: its join requests are refused, and this peer
does not join a group it leads. Callers that the private swarm does not admit
(:mod:`geotrain.hive.dht.admission`) are refused the same way (``request_refused``), as are state downloads
beyond ``guard.max_concurrent_downloads``.

Cost: every received part is decompressed once more for the check (one pass over the bytes this peer
reduces, next to the all-reduce's own), and the refused sender's round is lost for it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import multiprocessing
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2

from geotrain.hive.state.donors import (PROBATION_S, PROBE_TIMEOUT_S, STATE_BYTES_KEY, DownloadProgress, OwnEpoch,
                                        donor_labels, download_state, measure_donors, rank_donors)
from geotrain.hive.dht.metric_records import read_records
from geotrain.hive.guard.step import all_finite
from geotrain.hive.state.stripes import PartRequest, PartRequestError, StateSnapshots, download_striped, part_messages, \
    stripe_donors

logger = logging.getLogger(__name__)

# what the guard counts (Prometheus: geotrain_guard_refusals_total{what,reason}); index into a shared array
COUNTED = (
    ("contribution", "non-finite"), ("contribution", "norm"), ("contribution", "weight"),
    ("join_group", "not admitted"), ("join_group", "banned"), ("aggregate", "not admitted"), ("aggregate", "banned"),
    ("download_state", "not admitted"), ("download_state", "busy"), ("download_state", "non-finite state"),
    ("download_state", "malformed part request"), ("download_state", "own state non-finite"),
    ("step", "non-finite"), ("step", "norm"), ("microstep", "non-finite"),
    ("parameters", "non-finite after step"), ("parameters", "non-finite in loaded state"),
    ("parameters", "non-finite state average"),
    ("pseudo_gradient", "non-finite"), ("pseudo_gradient", "norm"),
)

# the payload of the all-reduce that this peer reduces (Prometheus: geotrain_averaging_payload_bytes_total{direction}):
# summed over the swarm, every byte of every averaging round that crossed between peers, counted once (by its
# reducer); what the compression changes, without the DHT's and the state downloads' traffic
AVERAGING_DIRECTIONS = ("received", "sent")

WITHHELD_LOG_EVERY_S = 10.0  # a peer whose state is not finite says so at most this often while downloads come


class ContributionRefused(Exception):
    """A remote sender's gradient part failed a check; raised inside hivemind's reading of its stream."""


class SharedBans:
    """Peers this peer has banned, and until when: one list for all of the peer's processes.

    A fixed table in shared memory (made before hivemind's averagers fork): a ban by the gradient averager
    keeps the banned peer out of state downloads and the end-of-run agreement as well.
    """

    SLOTS = 256
    SLOT_BYTES = 64  # base58 peer ids are 46-52 characters

    def __init__(self):
        self._names = multiprocessing.Array("c", self.SLOTS * self.SLOT_BYTES, lock=True)
        self._until = multiprocessing.Array("d", self.SLOTS, lock=False)  # time.time(), guarded by _names' lock

    def _name(self, slot: int) -> str:
        raw = self._names.get_obj()[slot * self.SLOT_BYTES:(slot + 1) * self.SLOT_BYTES]
        return raw.split(b"\0", 1)[0].decode()

    def ban(self, peer_id: str, seconds: float) -> None:
        encoded = peer_id.encode()[:self.SLOT_BYTES]
        with self._names.get_lock():
            now = time.time()
            slots = range(self.SLOTS)
            slot = next((i for i in slots if self._name(i) == peer_id), None)
            if slot is None:  # a free or expired slot, else the one that expires first
                slot = min(slots, key=lambda i: self._until[i] if self._until[i] > now else float("-inf"))
            self._names.get_obj()[slot * self.SLOT_BYTES:(slot + 1) * self.SLOT_BYTES] = \
                encoded.ljust(self.SLOT_BYTES, b"\0")
            self._until[slot] = now + seconds

    def active(self) -> set[str]:
        with self._names.get_lock():
            now = time.time()
            return {self._name(i) for i in range(self.SLOTS) if self._until[i] > now}

    def is_banned(self, peer_id: str) -> bool:
        return peer_id in self.active()


class GuardReport:
    """Where refusals go: the log, the peer's events file and counters shared with the peer's main process;
    and what the peer's processes share: its bans, and the one donor a state download must come from.

    hivemind's averagers run in processes of their own (forked from the peer), so all of it lives in
    shared memory made before they start, and each process appends its own lines to the events file.
    """

    def __init__(self, events_path: Path | None):
        self.events_path = None if events_path is None else Path(events_path)
        self._counts = multiprocessing.Array("q", len(COUNTED), lock=True)
        self.bans = SharedBans()
        self._allowed_donors = multiprocessing.Array("c", self.ALLOWED_DONORS * SharedBans.SLOT_BYTES, lock=True)
        self._last_donor = multiprocessing.Array("c", 2 * SharedBans.SLOT_BYTES + 1, lock=True)
        self.downloads = DownloadProgress()
        self.own_epoch = OwnEpoch()
        self._averaging_bytes = multiprocessing.Array("q", len(AVERAGING_DIRECTIONS), lock=True)

    ALLOWED_DONORS = 64

    def set_allowed_donors(self, peer_ids) -> None:
        """Restrict this peer's state downloads to ``peer_ids`` (None or empty: any donor that is not banned);
        the nearest of them is asked first (geotrain.hive.state.donors)."""
        names = sorted(peer_ids or ())[:self.ALLOWED_DONORS]
        self._allowed_donors.value = " ".join(names).encode()

    def set_only_donor(self, peer_id: str | None) -> None:
        """Restrict this peer's state downloads to ``peer_id`` (None: any donor that is not banned)."""
        self.set_allowed_donors([peer_id] if peer_id else None)

    def allowed_donors(self) -> set[str] | None:
        names = self._allowed_donors.value.decode().split()
        return set(names) if names else None

    def note_donor(self, peer_id: str, region: str | None) -> None:
        self._last_donor.value = f"{peer_id} {region or '-'}".encode()[:len(self._last_donor) - 1]

    def last_donor(self) -> tuple[str | None, str | None]:
        """(peer id, region) of the donor of this peer's last state download; (None, None) before one."""
        peer_id, _, region = self._last_donor.value.decode().partition(" ")
        return (peer_id or None, None if region in ("", "-") else region)

    def count(self, what: str, reason: str) -> None:
        index = COUNTED.index((what, reason))
        with self._counts.get_lock():
            self._counts[index] += 1

    def counts(self) -> dict[tuple[str, str], int]:
        with self._counts.get_lock():
            return {key: int(value) for key, value in zip(COUNTED, self._counts[:])}

    def count_averaging_bytes(self, direction: str, size_bytes: int) -> None:
        """Averaging messages this peer handled as a reducer of an all-reduce: the parts that other peers sent
        it (``received``) and the averages it returned (``sent``)."""
        index = AVERAGING_DIRECTIONS.index(direction)
        with self._averaging_bytes.get_lock():
            self._averaging_bytes[index] += size_bytes

    def averaging_bytes(self) -> dict[str, int]:
        """Bytes of averaging messages by direction, as :meth:`count_averaging_bytes` counted them."""
        with self._averaging_bytes.get_lock():
            return dict(zip(AVERAGING_DIRECTIONS, (int(value) for value in self._averaging_bytes[:])))

    def event(self, event: str, **fields) -> None:
        if self.events_path is None:
            return
        try:
            with open(self.events_path, "a") as handle:  # one write per line: lines of processes never interleave
                handle.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")
        except OSError as error:
            logger.debug("event %s not written: %s", event, error)


def contribution_refusal(part: torch.Tensor, weight: float, own_part: torch.Tensor | None, own_weight: float,
                         norm_factor: float, max_weight: float) -> tuple[str, str] | None:
    """(reason, detail) when a remote gradient part must not enter the average, else None.

    ``own_part``: this peer's own mean gradient for the same part over ``own_weight`` samples, the scale an
    honest part has; None when this peer contributes nothing to the round (then only finiteness and the
    weight are checked). A mean over fewer samples is noisier, so a sender that claims fewer samples than
    this peer may be up to sqrt(own_weight / weight) times further off; its pull on the average
    (weight x norm) stays within ``norm_factor`` times this peer's own.
    """
    if not (weight == weight) or weight < 0 or weight > max_weight:  # NaN weights included
        return "weight", f"claimed weight {weight:.4g} (at most {max_weight:.4g} samples per round)"
    if not bool(torch.isfinite(part).all()):  # even at weight 0: hivemind's mean would be NaN (0 x NaN)
        return "non-finite", "non-finite values in its gradient"
    if own_part is not None and own_weight > 0 and weight > 0:
        own_norm = float(own_part.float().norm())
        if own_norm > 0:
            norm = float(part.float().norm())
            allowed = norm_factor * own_norm * math.sqrt(max(1.0, own_weight / weight))
            if norm > allowed:
                return "norm", (f"gradient part norm {norm:.4g} over {weight:.4g} samples, {norm / own_norm:.3g}x "
                                f"this peer's own {own_norm:.4g} over {own_weight:.4g} (at most {allowed:.4g})")
    return None


def hivemind_handle_name(cls, namespace, method_name: str) -> str:
    """hivemind names a peer's handlers after its averager class; geotrain's classes answer under the name of
    the hivemind class they extend, so that they speak hivemind's protocol whatever they add (and tests'
    hostile peers, built on hivemind's classes, reach them as a real attacker's would)."""
    hivemind_class = next(c for c in cls.__mro__ if c.__module__.startswith("hivemind."))
    handle_name = f"{hivemind_class.__name__}.{method_name}"
    return handle_name if namespace is None else f"{namespace}::{handle_name}"


@dataclass(frozen=True)
class GuardSettings:
    """What a :class:`GuardedAveragerMixin` checks against and where its state downloads come from (its
    ``guard`` argument; the defaults are the mixin's class attributes)."""

    admission: object  # geotrain.hive.dht.admission.Admission
    report: GuardReport
    config: object  # geotrain.config.GuardConfig
    max_weight: float  # the most samples a contribution may claim
    region: str | None  # this peer's region and run, for the donors' records
    run_id: str | None
    min_rate_bytes_s: float  # a donor below this rate is dropped
    stall_s: float  # ... and one that sends nothing this long
    epoch_tolerance: int  # how many epochs a donor may be behind the newest and still count as current
    max_stripes: int  # a state of at least stripe_min_bytes comes in stripes from up to this many donors
    stripe_min_bytes: float


class GuardedAveragerMixin:
    """Checks for a hivemind DecentralizedAverager subclass (put first in the bases), configured by the
    ``guard`` argument (a :class:`GuardSettings`): set before hivemind's constructor forks the averager's
    process, which checks with them too.
    """

    guard_admission = None
    guard_report: GuardReport | None = None
    guard_config = None
    guard_max_weight = float("inf")
    # where state downloads come from (geotrain.hive.state.donors): this peer's region and run (for the donors'
    # records), the rate below which a donor is dropped, how long one may send nothing, and how many epochs
    # a donor may be behind the newest and still count as current
    donor_region: str | None = None
    donor_run_id: str | None = None
    donor_min_rate_bytes_s = 125_000.0
    donor_stall_s = 15.0
    donor_probation_s = PROBATION_S
    donor_epoch_tolerance = 1
    # a state of at least donor_stripe_min_bytes whose nearest current donor is in another region comes in
    # stripes from up to donor_max_stripes donors of that epoch at once (geotrain.hive.state.stripes)
    donor_max_stripes = 3
    donor_stripe_min_bytes = 8_000_000

    _get_handle_name = classmethod(lambda cls, namespace, method_name: hivemind_handle_name(cls, namespace,
                                                                                           method_name))

    def __init__(self, *args, guard: GuardSettings | None = None, **kwargs):
        if guard is not None:
            self.guard_admission, self.guard_report = guard.admission, guard.report
            self.guard_config, self.guard_max_weight = guard.config, float(guard.max_weight)
            self.donor_region, self.donor_run_id = guard.region, guard.run_id
            self.donor_min_rate_bytes_s, self.donor_stall_s = guard.min_rate_bytes_s, guard.stall_s
            self.donor_epoch_tolerance = guard.epoch_tolerance
            self.donor_max_stripes, self.donor_stripe_min_bytes = guard.max_stripes, guard.stripe_min_bytes
        super().__init__(*args, **kwargs)

    # --- whom to serve --------------------------------------------------------------------------------
    def guard_is_banned(self, peer_id) -> bool:
        return self.guard_report is not None and self.guard_report.bans.is_banned(peer_id.to_base58())

    def _guard_ban(self, peer_id) -> None:
        if self.guard_report is not None:
            self.guard_report.bans.ban(peer_id.to_base58(), self.guard_config.ban_s)

    async def _guard_refusal(self, peer_id, request: str) -> str | None:
        if self.guard_is_banned(peer_id):
            return "banned"
        admission = self.guard_admission
        if admission is not None and not admission.is_open and not await admission.admits(peer_id, self.dht):
            return "not admitted"
        return None

    def _guard_refuse_request(self, peer_id, request: str, reason: str) -> None:
        report = self.guard_report
        if report is not None:
            report.count(request, reason)
            if reason != "banned":  # a banned peer was named when it was banned
                report.event("request_refused", peer_id=self.peer_id.to_base58(), from_peer=peer_id.to_base58(),
                             request=request, reason=reason)
        logger.warning("refused %s from %s: %s", request.replace("_", " "), peer_id, reason)

    # --- hivemind's handlers, checked -----------------------------------------------------------------
    async def rpc_join_group(self, request: averaging_pb2.JoinRequest,
                             context: P2PContext) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        reason = await self._guard_refusal(context.remote_id, "join_group")
        if reason is not None:
            self._guard_refuse_request(context.remote_id, "join_group", reason)
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_join_group(request, context):
            yield response

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest,
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        if not await self._guard_download_admitted(context.remote_id):
            return  # an empty answer: hivemind's client goes on to the next donor
        self.__dict__["_guard_downloads"] += 1
        try:
            async for response in super().rpc_download_state(request, context):
                yield response
        finally:
            self.__dict__["_guard_downloads"] -= 1

    async def rpc_download_state_part(self, request: averaging_pb2.DownloadData,
                                      context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        """Some of the state's tensors, for a download in stripes from several donors (geotrain.hive.state.stripes):
        the request's metadata names the download and the tensors; every part of one download comes from one
        snapshot of the state. Checked as a whole download is."""
        if not self.allow_state_sharing or not await self._guard_download_admitted(context.remote_id):
            return
        try:
            part = PartRequest.from_message(request, self.serializer)
        except PartRequestError as error:
            self._guard_refuse_request(context.remote_id, "download_state", "malformed part request")
            logger.warning("the malformed part request from %s: %s", context.remote_id, error)
            return
        self.__dict__["_guard_downloads"] += 1
        try:
            snapshots = self.__dict__.setdefault("_guard_snapshots", StateSnapshots(
                self.guard_config.max_concurrent_downloads if self.guard_config is not None else 4))
            snapshot = await snapshots.get(context.remote_id.to_base58(), part.download,
                                           self._get_current_state_from_host_process)
            for message in part_messages(snapshot, part, self.state_compression, self.serializer):
                yield message
        finally:
            self.__dict__["_guard_downloads"] -= 1

    async def _guard_download_admitted(self, peer_id) -> bool:
        """Whether to serve a state download now (a whole state or a part): the caller is admitted and fewer
        than ``guard.max_concurrent_downloads`` are under way; refused and counted otherwise."""
        reason = await self._guard_refusal(peer_id, "download_state")
        if reason == "banned":
            reason = None  # a peer whose gradients were refused may still catch up from us
        limit = self.guard_config.max_concurrent_downloads if self.guard_config is not None else None
        active = self.__dict__.setdefault("_guard_downloads", 0)
        if reason is None and limit is not None and active >= limit:
            reason = "busy"
        if reason is not None:
            self._guard_refuse_request(peer_id, "download_state", reason)
        return reason is None

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.AveragingData]:
        reason = await self._guard_refusal(context.remote_id, "aggregate")
        if reason is not None:
            self._guard_refuse_request(context.remote_id, "aggregate", reason)
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        report = self.guard_report
        async for response in super().rpc_aggregate_part(self._guard_checked(stream, context.remote_id), context):
            if report is not None:
                report.count_averaging_bytes("sent", response.ByteSize())
            yield response

    async def _guard_checked(self, stream, sender):
        """The sender's stream of parts, each checked before hivemind's reducer reads it."""
        runner = None
        part_index = 0
        report = self.guard_report
        async for message in stream:
            if report is not None:
                report.count_averaging_bytes("received", message.ByteSize())
            if runner is None and message.group_id:
                if message.group_id not in self._running_groups:
                    await self._pending_groups_registered.wait()
                future = self._running_groups.get(message.group_id)
                runner = await future if future is not None else None
            if message.code == averaging_pb2.PART_FOR_AVERAGING or message.tensor_part.buffer:
                own_parts = getattr(runner, "parts_for_local_averaging", None)
                own_weight = float(getattr(runner, "weight", 0.0) or 0.0)
                own = own_parts[part_index] if own_parts is not None and part_index < len(own_parts) else None
                part = deserialize_torch_tensor(message.tensor_part)
                # an averager may widen the norm check, or skip it for a round (DiLoCo's pseudo-gradients grow
                # with each peer's inner steps: geotrain.hive.optim.diloco)
                norm_factor = self.guard_config.contribution_norm_factor * getattr(self, "contribution_norm_slack", 1)
                norm_applies = getattr(self, "contribution_norm_applies", None)
                if norm_applies is not None and not norm_applies():
                    norm_factor = math.inf
                refusal = contribution_refusal(part, message.weight, own, own_weight, norm_factor,
                                               self.guard_max_weight)
                if refusal is not None:
                    self._guard_refuse_contribution(sender, *refusal)
                    raise ContributionRefused(f"{sender}: {refusal[1]}")
                part_index += 1
            yield message

    def _guard_refuse_contribution(self, sender, reason: str, detail: str) -> None:
        self._guard_ban(sender)
        report = self.guard_report
        if report is not None:
            report.count("contribution", reason)
            report.event("contribution_refused", peer_id=self.peer_id.to_base58(), from_peer=sender.to_base58(),
                         reason=reason, detail=detail, banned_s=self.guard_config.ban_s)
        logger.warning("refused the gradients of %s (%s); it is left out of this peer's averaging for %.0f s",
                       sender, detail, self.guard_config.ban_s)

    # --- state downloads: the nearest donor first, never a banned one or a non-finite state -------------
    def get_current_state(self):
        """hivemind's state to serve, with its size in the metadata: the downloader's progress and bound; nothing
        while it is not finite (:meth:`_state_is_servable`): the downloader goes on to the next donor."""
        metadata, tensors, *rest = super().get_current_state()
        if not self._state_is_servable(tensors):
            return (None, (), *(() for _ in rest))
        if isinstance(metadata, dict):
            metadata = {**metadata, STATE_BYTES_KEY: int(sum(t.numel() * t.element_size() for t in tensors))}
        return (metadata, tensors, *rest)

    _withheld_logged_at = -float("inf")

    def _state_is_servable(self, tensors) -> bool:
        """Whether this peer's state is finite, and so may be served. A state averaging round with a bad peer
        writes the span that peer reduced straight into the served parameters (with the offloaded optimizer
        hivemind averages in place), and they stay so until this peer's next step puts the last good ones back.
        A downloader that took them then refused them and banned this honest peer for ``guard.ban_s``; seen at
        the end of a run next to a NaN peer: the finalizer, having banned the other honest trainer, left without
        waiting for it, and the run ended with two models."""
        if all_finite(t for t in tensors if t.is_floating_point()):
            return True
        if self.guard_report is not None:
            self.guard_report.count("download_state", "own state non-finite")
        now = time.monotonic()
        if now - self._withheld_logged_at >= WITHHELD_LOG_EVERY_S:
            self._withheld_logged_at = now
            logger.warning("not serving this peer's state to downloaders: it holds non-finite values (a bad peer's "
                           "part of a state averaging round) until its next step restores the last good ones")
        return False

    def load_state_from_peers(self, *args, **kwargs):
        """hivemind's download, waited for as long as the state's bytes take at the expected rate (the
        averager's process drops stalled and slow donors: geotrain.hive.state.donors), not a fixed timeout."""
        if kwargs.get("timeout") is not None:
            kwargs["timeout"] = max(kwargs["timeout"], self.state_download_bound_s())
        return super().load_state_from_peers(*args, **kwargs)

    def state_download_bound_s(self, donors: int = 3) -> float:
        """How long a download may take: this peer's state bytes at the minimum rate, plus, for each of a
        few donors, a stall and a probation (the size is this peer's own state, an estimate of the donor's)."""
        return self._state_bytes_estimate() / self.donor_min_rate_bytes_s + \
            donors * (self.donor_stall_s + self.donor_probation_s) + PROBE_TIMEOUT_S

    def _state_bytes_estimate(self) -> int:
        """This peer's state's bytes, as an estimate of a donor's: parameters, two optimizer statistics (Adam's),
        and DiLoCo's outer state: four times what it averages."""
        averaged = list(getattr(self, "_averaged_tensors", ()))
        return 4 * sum(t.numel() * t.element_size() for t in averaged)

    async def _load_state_from_peers(self, future, timeout=None):
        try:
            attempt = await self._download_from_nearest_donor()
            if attempt is not None:
                future.set_result(attempt.state)
        except Exception as error:
            logger.exception("state download failed: %r", error)
        finally:
            if not future.done():
                future.set_result(None)

    async def _download_from_nearest_donor(self):
        """One download from the donors in their order (:func:`rank_donors`; those at this peer's own epoch or
        below are behind when another has something newer)."""
        report = self.guard_report
        allowed = report.allowed_donors() if report is not None else None
        banned = report.bans.active() if report is not None else set()
        loop = asyncio.get_running_loop()
        donors_key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
        # both DHT reads at once: across oceans each takes a few round trips
        reading_records = loop.run_in_executor(None, read_records, self.dht, self.donor_run_id) \
            if self.donor_run_id is not None else None
        announced = await loop.run_in_executor(None, _announced_donors, self.dht, donors_key)
        labels = donor_labels(await reading_records) if reading_records is not None else {}
        candidates = announced if allowed is None else {name: announced.get(name, 0.0) for name in allowed}
        own = self.peer_id.to_base58()
        candidates = {name: priority for name, priority in candidates.items() if name not in banned and name != own}
        if not candidates:
            logger.info("no peer offers its state%s", "" if allowed is None else f" among {sorted(allowed)}")
            return None
        min_epoch = None if report is None else report.own_epoch.first_new_epoch()
        newer_only = report is not None and report.own_epoch.newer_only() and min_epoch is not None
        if newer_only:
            candidates = {name: priority for name, priority in candidates.items() if priority >= min_epoch}
            if not candidates:
                logger.info("no peer offers a state newer than epoch %d, the one this peer holds", min_epoch - 1)
                return None
        donors = rank_donors(await measure_donors(candidates, labels), self.donor_region, self.donor_epoch_tolerance,
                             min_epoch=min_epoch)
        stripe = stripe_donors(donors, self.donor_region, self.donor_max_stripes) \
            if self._state_bytes_estimate() >= self.donor_stripe_min_bytes else []
        if stripe:
            attempt = await download_striped(self, stripe, stall_s=self.donor_stall_s,
                                             progress=None if report is None else report.downloads,
                                             refusal=self._refuse_state)
            if attempt is not None:
                self._report_download_attempt(attempt)
                return attempt
            logger.info("downloading the whole state from one donor instead")
        return await download_state(self, donors, stall_s=self.donor_stall_s,
                                    min_rate_bytes_s=self.donor_min_rate_bytes_s, probation_s=self.donor_probation_s,
                                    progress=None if report is None else report.downloads,
                                    on_attempt=self._report_download_attempt, refusal=self._refuse_state)

    def _refuse_state(self, attempt) -> str | None:
        """Why a whole downloaded state is refused, or None: not newer than this peer's own when it takes only newer
        ones (a donor's announced epoch is read before its state, which a step may have moved on or not yet);
        non-finite values."""
        report = self.guard_report
        if report is not None and report.own_epoch.newer_only():
            metadata, _ = attempt.state
            epoch = metadata.get("epoch") if isinstance(metadata, dict) else None
            min_epoch = report.own_epoch.first_new_epoch()
            if min_epoch is not None and (not isinstance(epoch, int) or epoch < min_epoch):
                return f"its state is of epoch {epoch}, not newer than this peer's {min_epoch - 1}"
        return self._refuse_non_finite_state(attempt)

    def _refuse_non_finite_state(self, attempt) -> str | None:
        """A state with non-finite values is refused, and its donor left out for ``ban_s`` (the download goes on
        to the next donor)."""
        _, tensors = attempt.state
        if all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point()):
            return None
        donor = attempt.donor.peer_id
        logger.warning("refused the state downloaded from %s: it holds non-finite values; that peer is left out for "
                       "%.0f s", donor, self.guard_config.ban_s)
        self._guard_ban(PeerID.from_base58(donor))
        if self.guard_report is not None:
            self.guard_report.count("download_state", "non-finite state")
            self.guard_report.event("state_refused", peer_id=self.peer_id.to_base58(), from_peer=donor,
                                    reason="non-finite")
        return "non-finite values"

    def _report_download_attempt(self, attempt) -> None:
        report = self.guard_report
        if report is None:
            return
        donor = attempt.donor
        if attempt.result == "ok":
            report.note_donor(donor.peer_id, donor.region)
        report.event("state_download", peer_id=self.peer_id.to_base58(), donor=donor.peer_id,
                     donor_region=donor.region, donor_epoch=donor.epoch,
                     rtt_ms=None if donor.rtt_s is None else round(1000 * donor.rtt_s, 1), result=attempt.result,
                     bytes=attempt.received_bytes, seconds=round(attempt.seconds, 3),
                     **({} if attempt.stripes is None else {"stripes": attempt.stripes}),
                     **({} if attempt.state_bytes is None else {"state_bytes": attempt.state_bytes}))

    # --- not joining a group that a banned peer leads ---------------------------------------------------
    @property
    def _matchmaking(self):
        try:
            return self.__dict__["_guarded_matchmaking"]
        except KeyError:
            raise AttributeError("_matchmaking") from None

    @_matchmaking.setter
    def _matchmaking(self, matchmaking):
        request_join_group = matchmaking._request_join_group
        averager = self

        async def _request_join_group_unless_banned(leader):
            if averager.guard_is_banned(leader):
                return None  # hivemind goes on to the next potential leader
            return await request_join_group(leader)

        matchmaking._request_join_group = _request_join_group_unless_banned
        self.__dict__["_guarded_matchmaking"] = matchmaking


def _announced_donors(dht, donors_key: str) -> dict[str, float]:
    """peer id -> priority from hivemind's donor record (its subkeys are peer ids, its values numbers)."""
    found = dht.get(donors_key, latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    donors = {}
    for subkey, entry in found.value.items():
        try:
            name = PeerID(subkey).to_base58()
        except Exception:
            continue
        value = getattr(entry, "value", None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            donors[name] = float(value)
    return donors
