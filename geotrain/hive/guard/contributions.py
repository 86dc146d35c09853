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
beyond ``guard.max_concurrent_downloads``. A peer serves no state while its own holds non-finite values.

Cost: every received part is decompressed once more for the check (one pass over the bytes this peer
reduces, next to the all-reduce's own), and the refused sender's round is lost for it.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import AsyncIterator

import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2

from geotrain.hive.averaging.handle_names import hivemind_handle_name
from geotrain.hive.guard.report import GuardReport
from geotrain.hive.guard.step import all_finite
from geotrain.hive.state.donors import STATE_BYTES_KEY
from geotrain.hive.state.stripes import PartRequest, PartRequestError, StateSnapshots, part_messages

logger = logging.getLogger(__name__)

WITHHELD_LOG_EVERY_S = 10.0  # a peer whose state is not finite says so at most this often while downloads come


class ContributionRefused(Exception):
    """A remote sender's gradient part failed a check; raised inside hivemind's reading of its stream."""


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


@dataclass(frozen=True)
class GuardSettings:
    """What a :class:`GuardedAveragerMixin` checks against and where its state downloads come from (its
    ``guard`` argument; the defaults are the class attributes of the mixin and of
    :class:`~geotrain.hive.state.downloader.StateDownloadMixin`)."""

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
    process, which checks with them too. The settings' donor fields are for a
    :class:`~geotrain.hive.state.downloader.StateDownloadMixin` in the same bases.
    """

    guard_admission = None
    guard_report: GuardReport | None = None
    guard_config = None
    guard_max_weight = float("inf")

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

    # --- serving this peer's state: never a non-finite one ----------------------------------------------
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
