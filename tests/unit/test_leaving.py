"""A stop request leaves the averaging rounds that have not begun at once (geotrain.hive.optim.leave,
geotrain.stopping.stopper).

The rounds are hivemind's own StepControl objects, in the stages an averager puts them through; the optimizer
that holds them is a plain namespace (what withdraw_from_rounds reads of hivemind's Optimizer: its two
scheduled rounds).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.utils import get_dht_time
from hivemind.utils.mpfuture import MPFuture

from geotrain.hive.optim.leave import withdraw_from_rounds
from geotrain.stopping.stopper import Stopper

NO_WATCHDOG_S = 3600.0  # the stop's deadline: far beyond the test, so its watchdog never fires


def scheduled_round(stage: AveragingStage) -> StepControl:
    # plain futures first: hivemind sets its futures' backend up on the class of the first future a process
    # makes, and only MPFuture's own serves them all (in a peer the DHT's futures come first)
    trigger, cancel = MPFuture(), MPFuture()
    control = StepControl(scheduled_time=get_dht_time() + 5, deadline=get_dht_time() + 60, allow_retries=True,
                          weight=32.0, data_for_gather=b"")
    control.attach(trigger, cancel)
    control.stage = stage
    return control


@pytest.mark.parametrize("stage", [AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP])
def test_a_round_without_a_group_is_cancelled(stage):
    control = scheduled_round(stage)
    withdraw_from_rounds(SimpleNamespace(scheduled_grads=control, scheduled_state=None))
    assert control.cancelled()


def test_a_round_whose_group_waits_for_this_peer_goes_on_without_its_gradients():
    control = scheduled_round(AveragingStage.AWAITING_TRIGGER)
    withdraw_from_rounds(SimpleNamespace(scheduled_grads=None, scheduled_state=control))
    assert control.triggered and control.weight == 0 and not control.cancelled()


def test_a_running_all_reduce_is_left_to_finish():
    control = scheduled_round(AveragingStage.RUNNING_ALLREDUCE)
    control.allow_allreduce()
    assert withdraw_from_rounds(SimpleNamespace(scheduled_grads=control, scheduled_state=None)) == []
    assert not control.cancelled() and control.weight == 32.0


def test_each_round_of_the_optimizer_is_left():
    grads, state = scheduled_round(AveragingStage.LOOKING_FOR_GROUP), scheduled_round(AveragingStage.AWAITING_TRIGGER)
    done = withdraw_from_rounds(SimpleNamespace(scheduled_grads=grads, scheduled_state=state))
    assert len(done) == 2 and grads.cancelled() and state.weight == 0


def test_a_stop_request_runs_what_was_registered_once():
    stopper, called = Stopper(NO_WATCHDOG_S), []
    ran = threading.Event()
    stopper.on_stop(lambda: (called.append("first"), ran.set()))
    stopper.request_stop("preemption notice", NO_WATCHDOG_S)
    stopper.request_stop("SIGTERM received", NO_WATCHDOG_S)
    assert ran.wait(5)
    assert called == ["first"] and stopper.reason == "preemption notice"


def test_what_is_registered_after_the_stop_request_runs_at_once():
    stopper = Stopper(NO_WATCHDOG_S)
    stopper.request_stop("SIGTERM received", NO_WATCHDOG_S)
    ran = threading.Event()
    stopper.on_stop(ran.set)
    assert ran.wait(5)


def test_a_failing_callback_does_not_keep_the_next_from_running():
    stopper = Stopper(NO_WATCHDOG_S)
    ran = threading.Event()
    stopper.on_stop(lambda: 1 / 0)
    stopper.on_stop(ran.set)
    stopper.request_stop("SIGTERM received", NO_WATCHDOG_S)
    assert ran.wait(5)
