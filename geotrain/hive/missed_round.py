"""A gradient round the swarm has already had without this peer: give it up rather than wait it out.

A peer that is still looking for a group when the others' progress records show they have stepped past the
round's epoch will find no group for it: hivemind's matchmaking retries until the averaging timeout (180 s
in the ``continent`` network profile, 600 s ``intercontinental``), or it joins the swarm's next round and
ends it an epoch behind. Seen in the lab at the end of a run: a trainer one epoch behind waited the whole
timeout in a round no one else was left to join. :func:`watch_round` cancels such a round; the optimizer
then loads the swarm's state (:meth:`geotrain.hive.optimizer.MeasuredOptimizer._should_load_state_from_peers`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from hivemind.averaging.control import AveragingStage

logger = logging.getLogger(__name__)


def watch_round(control, swarm_has_moved_on: Callable[[], bool], period_s: float,
                on_given_up: Callable[[], None]) -> threading.Thread:
    """Cancel ``control`` while it looks for a group, once ``swarm_has_moved_on()``; a daemon thread.

    Looks every ``period_s`` until the round has a group or ended. ``on_given_up`` runs after the cancel.
    A round that has its group is left alone: the others are in it with this peer.
    """
    def watch() -> None:
        while not control.done() and control.stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP):
            try:
                moved_on = swarm_has_moved_on()
            except Exception as error:  # a failed look-up is no reason to give a round up; look again
                logger.debug("could not read the swarm's progress: %s", error)
                moved_on = False
            if moved_on and not control.done() and control.stage == AveragingStage.LOOKING_FOR_GROUP:
                control.cancel()
                on_given_up()
                return
            time.sleep(period_s)

    thread = threading.Thread(target=watch, name="missed-round-watch", daemon=True)
    thread.start()
    return thread
