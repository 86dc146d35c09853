"""A state download that would land after the swarm's next step is held, and started again once it has stepped.

A sync-mode peer that loads the state must be back before the swarm forms the group of its next round: a
state that arrives later is one step old when that round ends, and the peer, which was not in the round,
loads the state again. Seen in the churn soak (docs/state-transfer.md): a rejoined trainer in Europe began a
12 s download 7 s before the swarm's step, got a state one epoch old, and downloaded it again (12 s more).
Before a download the peer waits while the swarm is stepping (``MeasuredOptimizer._wait_while_the_swarm_steps``);
how long the download itself will take is known only once it runs. So, while it runs, :class:`LateDownloadWatch`
(in the peer's main process, which sees the swarm's progress) compares its rate over the last seconds with the
swarm's clock and holds it (:class:`geotrain.hive.donors.DownloadHold`) when it would end after the group forms
and a fresh download started after the step fits before the group after. The averager's process stops that
download, waits for the release, and downloads again, from the donors that hold the new epoch by then.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

from hivemind.utils import get_dht_time

from geotrain.hive.donors import DownloadHold, DownloadProgress

logger = logging.getLogger(__name__)

MIN_RATE_WINDOW_S = 2.0  # a download's rate measured over less than this is not trusted
RATE_WINDOW_S = 4.0  # the rate is the last seconds' (a connection's first ones run slower: 1.95 of 2.56 MB/s)
RATE_MARGIN = 0.15  # late only when it would end after the group forms even at a rate this much higher
POLL_S = 0.25
MIN_GROUP_SIZE = 2  # hivemind's averagers' default: the fewest peers an averaging group forms with
EPOCH_POLL_S = 1.0  # how often a held download looks for the swarm's new epoch (one DHT read each)


def late_download_hold_limit_s(matchmaking_time_s: float, averaging_timeout_s: float) -> float:
    """The longest a held download waits for the swarm's step once its group forms: the round's own bound."""
    return matchmaking_time_s + averaging_timeout_s


@dataclass(frozen=True)
class SwarmClock:
    """The swarm's next step as a peer saw it before its download (times in hivemind's DHT time)."""

    epoch: int
    group_forms_at: float  # when its peers begin matchmaking for the step: the ETA less the matchmaking time
    round_s: float  # seconds to collect a whole batch at the swarm's rate (inf: unknown)

    @classmethod
    def from_progress(cls, progress, matchmaking_time_s: float, now: float) -> "SwarmClock":
        """From hivemind's GlobalTrainingProgress: its ETA is the batch still missing at the swarm's rate. No step
        in view when the other trainers are too few to form a group without this peer."""
        eta = progress.eta_next_epoch
        remaining = progress.target_batch_size - progress.samples_accumulated
        # (num_peers counts this peer's record too: with one other trainer no group forms without this peer)
        others_can_step = progress.num_peers - 1 >= MIN_GROUP_SIZE
        if not math.isfinite(eta) or eta <= now or remaining <= 0 or not others_can_step:
            return cls(progress.epoch, math.inf, math.inf)
        return cls(progress.epoch, eta - matchmaking_time_s, progress.target_batch_size * (eta - now) / remaining)


def lands_late(clock: SwarmClock, now: float, received_bytes: float, expected_bytes: float,
               bytes_per_second: float, matchmaking_time_s: float) -> bool:
    """Whether a download in progress should be held: at its recent rate (give or take ``RATE_MARGIN``) it ends
    after the swarm's group forms, and a whole download started after the step ends before the next group forms."""
    if expected_bytes <= 0 or bytes_per_second <= 0:
        return False
    remaining_s = max(0.0, expected_bytes - received_bytes) / bytes_per_second
    if now + remaining_s * (1 - RATE_MARGIN) <= clock.group_forms_at:
        return False
    return expected_bytes / bytes_per_second < clock.round_s - matchmaking_time_s


class LateDownloadWatch:
    """While a load runs (``with``): holds its download once if it :func:`lands_late`, and releases it when
    ``swarm_epoch()`` shows the swarm past ``clock.epoch``, or after the hold's limit."""

    def __init__(self, hold: DownloadHold, progress: DownloadProgress, clock: SwarmClock, matchmaking_time_s: float,
                 hold_limit_s: float, swarm_epoch: Callable[[], int]):
        self.hold, self.progress, self.clock = hold, progress, clock
        self.matchmaking_time_s, self.hold_limit_s, self.swarm_epoch = matchmaking_time_s, hold_limit_s, swarm_epoch
        self.held_s: float | None = None  # how long the download was held, once released
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="late-download-watch", daemon=True)

    def __enter__(self) -> "LateDownloadWatch":
        self.hold.reset()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.hold.reset()

    def _watch(self) -> None:
        if not math.isfinite(self.clock.group_forms_at):
            return  # the swarm has no step in view: nothing to be late for
        samples: collections.deque = collections.deque()  # (monotonic s, bytes received) of this attempt
        while not self._done.wait(POLL_S):
            snapshot = self.progress.snapshot()
            received, now_s = snapshot["received_bytes"], time.monotonic()
            if received <= 0 or (samples and received < samples[-1][1]):
                samples.clear()  # between attempts, or before the first bytes
                continue
            samples.append((now_s, received))
            while len(samples) > 2 and now_s - samples[1][0] >= RATE_WINDOW_S:
                samples.popleft()
            window_s = now_s - samples[0][0]
            if window_s < MIN_RATE_WINDOW_S:
                continue
            rate = (received - samples[0][1]) / window_s
            now = get_dht_time()
            if lands_late(self.clock, now, received, snapshot["expected_bytes"], rate, self.matchmaking_time_s):
                self._hold_until_the_swarm_steps(now, received, snapshot["expected_bytes"], rate)
                return

    def _hold_until_the_swarm_steps(self, now: float, received: float, expected: float, rate: float) -> None:
        remaining_s = (expected - received) / rate
        limit_s = max(0.0, self.clock.group_forms_at - now) + self.hold_limit_s
        logger.info("the state download would end in %.1f s (%.2f MB/s), after the swarm forms the group of its step "
                    "(in %.1f s): holding it until the swarm has stepped, then downloading the new state (%.1f s)",
                    remaining_s, rate / 1e6, max(0.0, self.clock.group_forms_at - now), expected / rate)
        started = time.monotonic()
        self.hold.request(limit_s)
        deadline = started + limit_s
        stepped_to = None
        while not self._done.is_set() and time.monotonic() < deadline:
            try:
                epoch = self.swarm_epoch()
                if epoch > self.clock.epoch:
                    stepped_to = epoch
                    break
            except Exception as error:  # a DHT read that failed: try again until the limit
                logger.debug("could not read the swarm's epoch: %r", error)
            self._done.wait(EPOCH_POLL_S)
        self.held_s = time.monotonic() - started
        self.hold.release(stepped_to)
