"""A gradient round no group will form for: give it up rather than wait out the averaging timeout.

Two cases, both read from the swarm's progress records while the round looks for a group:

- **Missed**: the others have stepped past the round's epoch. hivemind's matchmaking retries until the averaging
  timeout (180 s in the ``continent`` network profile, 600 s ``intercontinental``), or it joins the swarm's next
  round and ends it an epoch behind. The optimizer loads the swarm's state instead
  (:meth:`geotrain.hive.optim.optimizer.MeasuredOptimizer._should_load_state_from_peers`).
- **Alone**: this peer's own record is there and no other trainer's is (the others left, said goodbye or
  expired). hivemind starts a round when its tracker counted others at the step, but its view is paused during
  a round and seconds old before it, so it would wait out the averaging timeout in each round after the
  others left. The peer steps with its own gradients, as hivemind does when it sees no other peer.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from hivemind.averaging.control import AveragingStage

from geotrain.hive.dht.keys import read_progress

logger = logging.getLogger(__name__)

MISSED = "missed"
ALONE = "alone"
READ_TIMEOUT_S = 30.0  # a look-up of the progress records that takes longer is no reason; look again
LEAVING = "leaving"  # (state rounds: this peer's stop was requested; optim.optimizer.RecordingStateAverager)


def reason_to_give_up(dht, run_id: str, own_peer_id: str, past_epoch: int) -> str | None:
    """:data:`MISSED` when a trainer's progress record is at ``past_epoch`` or beyond, :data:`ALONE` when this
    peer's own record is the only one, else None. A failed read shows no record at all, this peer's included:
    no reason; one that takes longer than :data:`READ_TIMEOUT_S` raises TimeoutError."""
    progress = read_progress(dht, run_id, timeout_s=READ_TIMEOUT_S)
    if any(record.epoch >= past_epoch for record in progress.values()):
        return MISSED
    if set(progress) == {own_peer_id}:
        return ALONE
    return None


def dht_is_running(dht) -> bool:
    """Whether ``dht``'s process is up, as the process that started it sees it (any other process: assumed up)."""
    try:
        return dht.is_alive()
    except AssertionError:  # multiprocessing answers only the process that started it
        return True


def watch_round(control, reason_to_give_up: Callable[[], str | None], period_s: float,
                on_given_up: Callable[[str], None], first_look_after_s: float = 0.0,
                dht_alive: Callable[[], bool] = lambda: True) -> threading.Thread:
    """Cancel ``control`` while it looks for a group, once ``reason_to_give_up()`` gives a reason; a daemon thread.

    Looks every ``period_s`` (the first time after ``first_look_after_s``) until the round has a group or ended,
    or ``dht_alive()`` says the DHT it reads is shut down (a round scheduled but never begun stays IDLE for good:
    a watch that outlived its optimizer kept its control's shared memory, which then went with every process
    forked from this one, and a fork freeing it aborted). ``on_given_up(reason)`` runs after the cancel. A round
    that has its group is left alone: the others are in it with this peer.
    """
    def watch() -> None:
        time.sleep(first_look_after_s)
        while (not control.done() and control.stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP)
               and dht_alive()):
            try:
                reason = reason_to_give_up()
            except Exception as error:  # a failed look-up is no reason to give a round up; look again
                logger.debug("could not read the swarm's progress: %s", error)
                reason = None
            if reason is not None and not control.done() and control.stage == AveragingStage.LOOKING_FOR_GROUP:
                control.cancel()
                on_given_up(reason)
                return
            time.sleep(period_s)

    thread = threading.Thread(target=watch, name="missed-round-watch", daemon=True)
    thread.start()
    return thread
