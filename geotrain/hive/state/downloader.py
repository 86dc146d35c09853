"""Where a peer's state downloads come from, and what it refuses of them (:class:`StateDownloadMixin`).

hivemind asks the donors in the order of their announced priority, one at a time, each for up to the whole
timeout. Here a download asks the nearest current donor first (:func:`~geotrain.hive.state.donors.rank_donors`),
drops one that stalls or sends too slowly for the next, takes a large state in stripes from several donors at
once when the nearest is in another region (:mod:`geotrain.hive.state.stripes`), never asks a banned peer, and
refuses a state with non-finite values (its donor is banned for ``guard.ban_s``) or, for a peer that takes only
newer states, one not newer than its own.
"""

from __future__ import annotations

import asyncio
import logging
import math

import torch
from hivemind.p2p import PeerID

from geotrain.hive.dht.metric_records import read_records
from geotrain.hive.guard.report import GuardReport
from geotrain.hive.state.donors import (PROBATION_S, PROBE_TIMEOUT_S, donor_labels, download_state, measure_donors,
                                        rank_donors)
from geotrain.hive.state.stripes import download_striped, stripe_donors

logger = logging.getLogger(__name__)


class StateDownloadMixin:
    """State downloads for a hivemind DecentralizedAverager subclass (before it in the bases), configured by the
    ``guard`` argument of :class:`~geotrain.hive.guard.contributions.GuardedAveragerMixin` (its donor fields)."""

    guard_report: GuardReport | None = None  # bans, allowed donors, the download's progress, this peer's epoch
    guard_config = None  # geotrain.config.GuardConfig: how long a donor of a non-finite state is banned
    # this peer's region and run (for the donors' records), the rate below which a donor is dropped, how long one
    # may send nothing, and how many epochs a donor may be behind the newest and still count as current
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
        if self.guard_report is not None:
            self.guard_report.bans.ban(donor, self.guard_config.ban_s)
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
