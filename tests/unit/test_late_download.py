"""A state download that would land after the swarm's next step is held until the swarm has stepped
(geotrain.hive.late_download); the averager's side of the hold is in test_donors.py."""

from __future__ import annotations

import math
import threading
import time

from hivemind.optim.progress_tracker import GlobalTrainingProgress
from hivemind.utils import get_dht_time

from geotrain.hive.donors import DownloadHold, DownloadProgress
from geotrain.hive.late_download import MIN_RATE_WINDOW_S, LateDownloadWatch, SwarmClock, lands_late
from waiting import wait_until

MB = 1e6


def test_the_clock_reads_the_round_from_the_swarms_eta():
    now = 1000.0
    # half the batch of 4096 is missing and due in 10 s: the swarm collects a whole batch in 20 s
    progress = GlobalTrainingProgress(epoch=7, samples_accumulated=2048, target_batch_size=4096, num_peers=4,
                                      num_clients=0, eta_next_epoch=now + 10, next_fetch_time=now + 1)
    clock = SwarmClock.from_progress(progress, matchmaking_time_s=2.0, now=now)
    assert (clock.epoch, clock.group_forms_at, clock.round_s) == (7, now + 8, 20.0)
    # no step in view (no peer collects samples): nothing to be late for
    idle = GlobalTrainingProgress(7, 0, 4096, 0, 0, math.inf, now + 1)
    assert SwarmClock.from_progress(idle, 2.0, now).group_forms_at == math.inf
    # this peer and one other: no group forms without this peer, so there is no step to come too late for
    pair = GlobalTrainingProgress(7, 2048, 4096, 2, 0, now + 10, now + 1)
    assert SwarmClock.from_progress(pair, 2.0, now).group_forms_at == math.inf


def test_only_a_download_that_ends_after_the_group_forms_and_fits_in_a_round_is_held():
    clock = SwarmClock(epoch=3, group_forms_at=1010.0, round_s=20.0)
    # 29.7 MB at 2.5 MB/s, 11.9 s in all: with 6 MB in at 1000.2 it ends at 1009.7, before the group forms
    assert not lands_late(clock, 1000.2, 6 * MB, 29.7 * MB, 2.5 * MB, matchmaking_time_s=2.0)
    # with 12 MB in at 1007 it ends at 1014.1, after the group forms at 1010, even if the rate were 15% higher;
    # a new download after the step (11.9 s) fits before the next group forms (20 - 2 s after the step)
    assert lands_late(clock, 1007.0, 12 * MB, 29.7 * MB, 2.5 * MB, matchmaking_time_s=2.0)
    # with 12 MB in at 1003.5 it ends at 1010.6 at this rate, but before the group forms at a rate 15% higher:
    # a connection's first seconds run slower than the rest, and holding it needlessly costs a round
    assert not lands_late(clock, 1003.5, 12 * MB, 29.7 * MB, 2.5 * MB, matchmaking_time_s=2.0)
    # a state that takes longer than a round arrives late whenever it starts: holding it would not help
    assert not lands_late(clock, 1007.0, 12 * MB, 60 * MB, 2.5 * MB, matchmaking_time_s=2.0)
    # a donor that did not say the state's size, or no rate yet: no judgement
    assert not lands_late(clock, 1007.0, 12 * MB, 0, 2.5 * MB, matchmaking_time_s=2.0)
    assert not lands_late(clock, 1007.0, 12 * MB, 29.7 * MB, 0, matchmaking_time_s=2.0)


class Download:
    """A download in progress as the averager's process reports it: ``rate`` bytes per second of ``expected``."""

    def __init__(self, progress: DownloadProgress, expected: float, rate: float):
        self.progress, self.expected, self.rate = progress, expected, rate
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopped.set()
        self.thread.join()

    def _run(self):
        started = time.monotonic()
        while not self.stopped.wait(0.1):
            received = min(self.expected, self.rate * (time.monotonic() - started))
            self.progress.update(received, self.expected, received / (time.monotonic() - started))


class Averager:
    """The averager's side of the hold, as geotrain.hive.guard runs it: wait for the release, in a thread."""

    def __init__(self, hold: DownloadHold):
        self.hold, self.released, self.swarm_epoch = hold, None, None
        self.thread = threading.Thread(target=self._wait, daemon=True)

    def _wait(self):
        self.released = self.hold.wait_for_release()
        self.swarm_epoch = self.hold.swarm_epoch()  # the epoch its next download asks donors for


def watch(clock: SwarmClock, epoch: list[int], hold_limit_s: float = 30.0):
    hold, progress = DownloadHold(), DownloadProgress()
    return hold, progress, LateDownloadWatch(hold, progress, clock, matchmaking_time_s=1.0,
                                             hold_limit_s=hold_limit_s, swarm_epoch=lambda: epoch[0])


def test_a_late_download_is_held_until_the_swarm_has_stepped():
    epoch = [3]
    clock = SwarmClock(epoch=3, group_forms_at=get_dht_time() + 3.0, round_s=60.0)
    hold, progress, late = watch(clock, epoch)
    with late, Download(progress, 20 * MB, 1 * MB):  # 20 s in all, the group forms in 3 s: late
        wait_until(hold.requested, "the hold")
        averager = Averager(hold)
        averager.thread.start()
        time.sleep(1.5)
        assert averager.thread.is_alive(), "released before the swarm stepped"
        epoch[0] = 4  # a trainer's progress record holds the new epoch: the swarm has stepped
        averager.thread.join(5.0)
        assert averager.released is True and not hold.requested()
        assert averager.swarm_epoch == 4, "the averager was not told the epoch the swarm stepped to"
    assert late.held_s is not None and late.held_s >= 1.5


def test_a_download_that_ends_in_time_is_not_held_and_a_hold_ends_at_its_limit():
    epoch = [3]
    clock = SwarmClock(epoch=3, group_forms_at=get_dht_time() + 30.0, round_s=60.0)
    hold, progress, late = watch(clock, epoch)
    with late, Download(progress, 20 * MB, 1 * MB):  # ends in 20 s, the group forms in 30 s
        time.sleep(MIN_RATE_WINDOW_S + 1.0)
        assert not hold.requested()
    # the swarm never steps: the hold ends after its limit, and the averager downloads anyway
    clock = SwarmClock(epoch=3, group_forms_at=get_dht_time(), round_s=60.0)
    hold, progress, late = watch(clock, epoch, hold_limit_s=2.0)
    with late, Download(progress, 20 * MB, 1 * MB):
        wait_until(hold.requested, "the hold")
        averager = Averager(hold)
        averager.thread.start()
        wait_until(lambda: late.held_s is not None, "the end of the hold")
    averager.thread.join(5.0)
    assert averager.released is True and 1.5 <= late.held_s < 5.0
    assert averager.swarm_epoch is None  # no step seen: the donors are ranked as before the hold
