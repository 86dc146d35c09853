"""Leaving the swarm: a goodbye the others see at once, then hivemind's shutdown within the stop's deadline."""

from __future__ import annotations

import logging
import threading
import time

from hivemind.averaging.control import AveragingStage
from hivemind.utils import get_dht_time

from geotrain.hive.dht.keys import progress_key
from geotrain.stopping.stopper import Stopper

logger = logging.getLogger(__name__)

SHUTDOWN_RESERVE_S = 4.0  # what a stop keeps for the DHT's own shutdown after the optimizer's
UNHURRIED_SHUTDOWN_S = 30.0  # the optimizer's share when no deadline is set (end of a run)
GOODBYE_TIMEOUT_S = 2.0


def leave_swarm(dht, optimizer, run_id: str, stopper: Stopper, reporter=None) -> None:
    """Say goodbye, shut the optimizer down within the stop's deadline, then the DHT node.

    The goodbye (an empty progress record) goes first, right after hivemind's progress reports are
    stopped: the tracker publishes an empty record on shutdown without waiting for it, and once the
    averagers are gone the DHT node can spend seconds on their dangling requests, so a record stored after
    them can come too late. With it, the others stop counting on this peer's samples at once. The metric
    record is withdrawn at the same time, so the swarm view drops this peer at once too. The optimizer's
    shutdown gets what is left of the deadline: in a round that already started it tags along with zero
    weight, so the round completes for the others. (hivemind offers no way to hand in a partial
    accumulation outside a round; those samples are lost, and the swarm's epoch is filled by the others.)
    """
    # hivemind's tracker reports progress in the background, and once more when it is shut down: stop it
    # first, or that last report (stored after the goodbye, so with a later expiration) revives this peer
    # for the others until it expires, and they wait for it in matchmaking
    optimizer.tracker.shutdown(timeout=GOODBYE_TIMEOUT_S)
    goodbyes = [dht.store(progress_key(run_id), subkey=optimizer.tracker._local_public_key, value=None,
                          expiration_time=get_dht_time() + optimizer.tracker.metadata_expiration,
                          return_future=True)]
    if reporter is not None:
        goodbyes.append(reporter.withdraw())
    deadline = time.monotonic() + GOODBYE_TIMEOUT_S
    for goodbye in goodbyes:
        try:
            goodbye.result(timeout=max(0.1, deadline - time.monotonic()))
        except Exception as error:  # leaving anyway; the record then expires on its own
            logger.debug("goodbye record not stored: %s", error)
    budget_s = max(1.0, stopper.seconds_left(UNHURRIED_SHUTDOWN_S) - SHUTDOWN_RESERVE_S)
    shutdown = threading.Thread(target=optimizer.shutdown, name="optimizer-shutdown", daemon=True)
    shutdown.start()
    shutdown.join(budget_s)
    if shutdown.is_alive():
        logger.warning("hivemind's optimizer did not shut down within %.0f s; leaving without it", budget_s)
    dht.shutdown()


def withdraw_from_rounds(optimizer) -> list[str]:
    """When a stop is requested: leave the averaging rounds that have not begun, at once.

    A round of this peer that is still looking for a group is cancelled: otherwise the others may form
    their next group with it, and a peer that is then gone (its stop deadline passed, or its process ended)
    makes that group wait the whole averaging timeout for its part. A round whose group has formed but is
    waiting for this peer's trigger goes on at weight 0, so its group completes without this peer's
    gradients (what hivemind's shutdown does, but at once rather than when the training loop gets there); a
    running all-reduce is left to finish. A training loop
    blocked on a cancelled round gets its failure and steps with its own gradients, then sees the stop. The
    state round hivemind runs in the background is left the same way, and so is any that a step begins after
    the request (:meth:`~geotrain.hive.optim.optimizer.RecordingStateAverager.leave_rounds`): hivemind's shutdown waits
    for it. Returns what it did to each round, for the log.
    """
    done = []
    for name in ("scheduled_grads", "scheduled_state"):
        control = getattr(optimizer, name, None)
        if control is None or control.done():
            continue
        stage = control.stage
        if stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP):
            control.cancel()
            done.append(f"{name}: cancelled while {stage.name.lower().replace('_', ' ')}")
        elif stage == AveragingStage.AWAITING_TRIGGER and not control.triggered:
            control.weight = 0
            control.allow_allreduce()
            done.append(f"{name}: goes on at weight 0")
    leave_state_rounds = getattr(getattr(optimizer, "state_averager", None), "leave_rounds", None)
    if leave_state_rounds is not None:
        outcome = leave_state_rounds()  # the round hivemind began in the background, and any later one
        if outcome is not None:
            done.append(outcome)
    if done:
        logger.info("left the averaging rounds that had not begun (%s)", "; ".join(done))
    return done


def stop_offering_state(optimizer) -> None:
    """When a stop is requested: offer this peer's state to no new downloader (its donor record is withdrawn,
    and a download asked of it gets an empty answer, so the downloader asks the next donor at once); a
    download under way goes on while the peer is still there: a download begun from a leaving peer is cut
    when it leaves, and starts over from another donor."""
    averager = getattr(optimizer, "state_averager", None)
    if averager is not None and averager.allow_state_sharing:
        averager.allow_state_sharing = False
        logger.info("this peer no longer offers its state to new downloaders")
