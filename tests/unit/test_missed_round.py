"""A sync-mode trainer that missed the swarm's gradient round loads the swarm's state (geotrain.hive.optim.optimizer).

Two real trainers' optimizers (geotrain's build, sync mode, loopback) on a DHT of two nodes; the donor
moved on to epoch 1 (its state and its progress record say so). hivemind alone tolerates one epoch behind:
a peer there begins a round at once, which joins the swarm's next round, ends it one epoch behind again,
and stays so; a peer still looking for a group the swarm no longer forms waits the whole averaging timeout
(both seen in tests/lab/test_lab_state_transfer.py). geotrain loads the state instead, and gives such a
round up (geotrain.hive.averaging.missed_round). (Both trainers live in one process, so they share hivemind's
progress-record key: the tests set each situation up rather than train into it.)
"""

from __future__ import annotations

import logging
import threading
import time
from functools import partial

import hivemind
import pytest
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import SchemaValidator
from hivemind.optim.progress_tracker import LocalTrainingProgress, TrainingProgressSchema
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.utils import get_dht_time
from hivemind.utils.mpfuture import MPFuture

from geotrain.config import load_config
from geotrain.hive.dht.keys import progress_key, read_progress, swarm_epoch_and_trainers
from geotrain.hive.optim.leave import withdraw_from_rounds
from geotrain.hive.averaging.missed_round import READ_TIMEOUT_S, dht_is_running, reason_to_give_up, watch_round
from optimizer_pair import optimizer_pair
from waiting import wait_for

RUN_ID = "missed-round"


def sync_config():
    return load_config(set_args=["optimizer.network_profile=loopback", "optimizer.batch_size_per_step=4",
                                 "optimizer.target_batch_size=64", "optimizer.optimizer=sgd",
                                 "optimizer.average_state_every=1000", f"swarm.run_id={RUN_ID}"])


@pytest.fixture
def trainers():
    with optimizer_pair(sync_config()) as made:
        yield made


def donor_moves_to_epoch_one(optimizer) -> None:
    """What a trainer is after the swarm's round of epoch 0 (its state and its progress record)."""
    optimizer.state_averager.local_epoch = 1
    optimizer.state_averager.state_sharing_priority = 1
    optimizer.grad_averager.state_sharing_priority = 1
    with optimizer.tracker.pause_updates():
        optimizer.tracker.update_epoch(1)
    optimizer.tracker.report_local_progress(1, 4)  # (hivemind publishes a record once it has samples)


def backward(model) -> None:
    model.zero_grad()
    model(torch.ones(4, 4)).sum().backward()


def step(model, optimizer) -> None:
    backward(model)
    optimizer.step()


def test_a_trainer_one_epoch_behind_loads_the_state_instead_of_starting_a_round(trainers):
    (donor_model, donor), (model, optimizer) = trainers
    wait_for(lambda: optimizer.tracker.fetched_global_progress_this_epoch.is_set(), 30,
             "a look at the swarm", interval_s=0.05)
    optimizer._should_check_synchronization_on_update = False  # hivemind's check of this epoch has run
    donor_moves_to_epoch_one(donor)
    wait_for(lambda: optimizer.tracker.global_epoch == 1, 30,
             "the donor's epoch 1 in the progress records", interval_s=0.05)
    assert optimizer.tracker.ready_to_update_epoch, "hivemind would begin this epoch's round now"

    backward(model)
    optimizer.step()

    assert optimizer.local_epoch == 1
    assert optimizer.scheduled_grads is None, "a gradient round was started"
    for parameter, donor_parameter in zip(model.parameters(), donor_model.parameters()):
        assert torch.equal(parameter, donor_parameter), "the donor's state was not loaded"


def test_a_trainer_at_the_swarms_epoch_steps_on_without_a_download(trainers):
    (_, donor), (model, optimizer) = trainers
    wait_for(lambda: optimizer.tracker.fetched_global_progress_this_epoch.is_set(), 30,
             "a look at the swarm", interval_s=0.05)
    optimizer._should_check_synchronization_on_update = False
    before = [parameter.detach().clone() for parameter in model.parameters()]

    backward(model)
    optimizer.step()

    assert optimizer.local_epoch == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)), "the state was replaced"
    assert optimizer.tracker.local_progress.samples_accumulated == 4, "this micro-batch was not accumulated"


def looking_for_a_group() -> StepControl:
    # plain futures first: hivemind sets its futures' backend up on the class of the first future a process
    # makes, and only MPFuture's own serves them all (in a peer the DHT's futures come first)
    trigger, cancel = MPFuture(), MPFuture()
    control = StepControl(scheduled_time=get_dht_time(), deadline=get_dht_time() + 60, allow_retries=True,
                          weight=32.0, data_for_gather=b"")
    control.attach(trigger, cancel)
    control.stage = AveragingStage.LOOKING_FOR_GROUP
    return control


def test_a_round_looking_for_a_group_the_swarm_has_stepped_past_is_given_up(trainers):
    (_, donor), (_, optimizer) = trainers
    control, given_up = looking_for_a_group(), []
    optimizer._watch_for_a_missed_round(control, given_up)  # this peer's round of epoch 0
    time.sleep(2 * optimizer.missed_round_check_s)
    assert not control.done(), "given up while the swarm was still at the round's epoch"

    donor_moves_to_epoch_one(donor)  # the swarm had its round of epoch 0 without this peer

    wait_for(control.cancelled, 30, "the round to be given up", interval_s=0.05)
    assert given_up == [(0, "missed")] and optimizer._missed_round_of_epoch == 0


def test_a_round_that_has_its_group_is_left_alone():
    control, moved_on = looking_for_a_group(), threading.Event()
    watch_round(control, lambda: "missed" if moved_on.is_set() else None, period_s=0.1, on_given_up=lambda _: None)
    control.stage = AveragingStage.AWAITING_TRIGGER  # the others are in it with this peer
    moved_on.set()
    time.sleep(0.5)
    assert not control.cancelled()


def test_a_watch_ends_once_its_dht_is_shut_down_though_its_round_never_ended():
    """A round scheduled but never begun stays as it is for good. Its watch outlived the optimizer, holding the
    round's shared memory, which every process forked later inherited: one freed it and aborted (a DHT of
    test_missed_round, in CI)."""
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    control = looking_for_a_group()
    try:
        watch = watch_round(control, partial(reason_to_give_up, dht, RUN_ID, str(dht.peer_id), 1), period_s=0.1,
                            on_given_up=lambda _: None, dht_alive=partial(dht_is_running, dht))
        time.sleep(0.5)
        assert watch.is_alive() and dht_is_running(dht)
    finally:
        dht.shutdown()
    assert not dht_is_running(dht)
    watch.join(timeout=READ_TIMEOUT_S + 5)  # a look-up in flight at the shutdown ends at its timeout
    assert not watch.is_alive(), "the watch outlived the DHT it reads"
    assert not control.done(), "the round was given up though nothing said so"


def test_after_a_round_given_up_the_next_step_loads_the_swarms_state(trainers):
    (donor_model, donor), (model, optimizer) = trainers
    donor_moves_to_epoch_one(donor)
    wait_for(lambda: optimizer.tracker.global_epoch == 1, 30,
             "the donor's epoch 1 in the progress records", interval_s=0.05)
    # where a given-up round leaves a peer: stepped with its own gradients into the swarm's epoch
    optimizer.state_averager.local_epoch = 1
    with optimizer.tracker.pause_updates():
        optimizer.tracker.update_epoch(1)
    optimizer._should_check_synchronization_on_update = False
    optimizer._missed_round_of_epoch = 0

    step(model, optimizer)

    for parameter, donor_parameter in zip(model.parameters(), donor_model.parameters()):
        assert torch.equal(parameter, donor_parameter), "the donor's state was not loaded"
    assert optimizer._missed_round_of_epoch is None


def test_an_epoch_whose_round_was_given_up_starts_no_state_round(trainers, monkeypatch):
    # the state round would end only when the others average state again (about an epoch later), and the
    # next step's load would wait for it first
    (_, donor), (model, optimizer) = trainers
    control = looking_for_a_group()
    control.allow_allreduce()  # as hivemind's optimizer does when it begins the round
    backward(model)
    rounds = threading.Thread(target=optimizer._average_gradients_and_load_into_optimizer, args=(control,))
    rounds.start()
    time.sleep(2 * optimizer.missed_round_check_s)
    donor_moves_to_epoch_one(donor)
    rounds.join(timeout=60)
    assert not rounds.is_alive() and control.cancelled(), "the round was not given up"
    state_averager = optimizer.state_averager
    assert state_averager.skip_averaging_round

    started = []
    monkeypatch.setattr(DecentralizedAverager, "step", lambda self, *args, **kwargs: started.append(kwargs))
    # what hivemind's Optimizer._update_global_epoch then asks of the state averager
    state_averager.step(increment_epoch=True, optimizer_step=True, averaging_round=True, delay_averaging=True,
                        averaging_opts=dict(timeout=30))
    state_averager.step(wait_for_delayed_updates=True)
    assert started == [], "a state averaging round was started in an epoch whose gradient round was given up"
    assert state_averager.local_epoch == 1


def test_a_state_round_the_swarm_has_stepped_past_is_given_up_and_the_next_step_does_not_wait_for_it(
        trainers, caplog):
    # hivemind runs each step's update and state round one after the other in one thread: a state round that
    # finds no group held the next step for the whole averaging timeout (seen in test_preemption)
    (_, donor), (model, optimizer) = trainers
    state_averager = optimizer.state_averager
    backward(model)
    with caplog.at_level(logging.INFO, logger="geotrain.hive.optim.optimizer"):
        # what hivemind's Optimizer._update_global_epoch asks of the state averager: a round in the background
        state_averager.step(increment_epoch=True, optimizer_step=True, averaging_round=True, delay_averaging=True,
                            averaging_opts=dict(timeout=120))
        time.sleep(2 * state_averager.missed_round_check_s)
        assert state_averager.pending_updates, "the state round ended before the swarm moved on"

        donor_moves_to_epoch_one(donor)  # the others' progress records at epoch 1: the round's own epoch
        time.sleep(2 * state_averager.missed_round_check_s)
        assert "gave up the state averaging round" not in caplog.text, "given up while the swarm was at its epoch"
        donor.tracker.report_local_progress(2, 4)  # a trainer at epoch 2 has ended its round of epoch 1

        wait_for(lambda: "gave up the state averaging round of epoch 1: the swarm had stepped past it"
                   in caplog.text, 30, "the state round to be given up", interval_s=0.05)
    finish_delayed_updates(state_averager)
    assert state_averager.local_epoch == 1


def test_a_leaving_peer_gives_up_its_state_round_and_begins_no_later_one_so_its_shutdown_does_not_wait(
        trainers, monkeypatch):
    # hivemind's shutdown waits for the state round in the background: a trainer took 10 s to leave after a
    # Ctrl-C while its round (begun by the step after the request) looked for a group no one else joined
    _, (model, optimizer) = trainers
    state_averager = optimizer.state_averager
    backward(model)
    state_averager.step(increment_epoch=True, optimizer_step=True, averaging_round=True, delay_averaging=True,
                        averaging_opts=dict(timeout=120))
    time.sleep(2 * state_averager.missed_round_check_s)
    assert state_averager.pending_updates, "the state round ended before the stop request"

    assert "state round: cancelled while looking for group" in withdraw_from_rounds(optimizer)
    finish_delayed_updates(state_averager)

    rounds_begun = []
    begin_round = DecentralizedAverager.step
    monkeypatch.setattr(DecentralizedAverager, "step",
                        lambda self, *args, **kwargs: rounds_begun.append(kwargs) or begin_round(self, *args, **kwargs))
    # a step after the request (the trainer finishing its batch) steps the optimizer without a round
    state_averager.step(increment_epoch=True, optimizer_step=True, averaging_round=True, delay_averaging=True,
                        averaging_opts=dict(timeout=120))
    finish_delayed_updates(state_averager)
    assert rounds_begun == [], "a state round was begun after the stop request"
    assert state_averager.local_epoch == 2


def finish_delayed_updates(state_averager) -> None:
    """The background step with its state round ends well within the round's own timeout (120 s), and the wait for
    the delayed updates (what the next step and hivemind's shutdown do) then finds nothing pending. (One such wait
    is bounded by the all-reduce timeout, a few seconds, so it can return while the averager still unwinds the
    round it gave up: the test looks at the step's future itself.)"""
    wait_for(lambda: all(update.done() for update in state_averager.pending_updates), 30,
             "the background step with the state round to end", interval_s=0.05)
    state_averager.step(wait_for_delayed_updates=True)
    assert not state_averager.pending_updates, "still waiting for the state round"


def test_a_load_while_the_swarm_averages_waits_for_its_step_and_takes_the_new_state(trainers):
    # a state downloaded while the swarm's round is under way is one step old when that step lands, and a peer
    # cannot join a round whose group has formed: it would give the round up and download again
    (_, donor), (model, optimizer) = trainers
    donor.tracker.report_local_progress(0, 64)  # the swarm's whole batch: its round of epoch 0 has begun
    wait_for(lambda: optimizer.tracker.global_progress.samples_accumulated >= 64, 30,
             "the batch in this peer's view", interval_s=0.05)
    load_waits_for_the_swarms_step(donor, model, optimizer, "while the swarm's round was under way")


def load_waits_for_the_swarms_step(donor, model, optimizer, situation: str) -> None:
    """A load started now is still waiting 2 s later; once the donor steps, it takes the donor's new state."""
    loading = threading.Thread(target=optimizer.load_state_from_peers)
    loading.start()
    time.sleep(2.0)
    assert loading.is_alive(), f"the state was downloaded {situation}"

    with torch.no_grad():  # the swarm's step, in the parameters the donor serves
        for group in donor.state_averager.optimizer.param_groups:
            for parameter in group["params"]:
                parameter.fill_(2.0)
    donor_moves_to_epoch_one(donor)
    loading.join(timeout=60)

    assert not loading.is_alive()
    assert optimizer.local_epoch == 1
    for parameter in model.parameters():
        assert torch.equal(parameter, torch.full_like(parameter, 2.0)), "not the state after the swarm's step"


def test_a_load_while_the_swarm_forms_its_group_does_not_wait_for_its_step(trainers, caplog):
    # whether such a download comes too late is judged by its rate (geotrain.hive.late_download); waiting here
    # stalled a swarm of two in CI: no group forms without this peer, so the other's step never came
    (_, donor), (model, optimizer) = trainers
    donor.tracker.report_local_progress(0, 8)
    time.sleep(0.5)
    donor.tracker.report_local_progress(0, 60)  # 4 samples short of the batch, at about 100 samples/s
    wait_for(lambda: optimizer.tracker.global_progress.samples_accumulated >= 60, 30,
             "the samples in this view", interval_s=0.05)
    progress = optimizer.tracker.global_progress
    assert 0 < progress.samples_accumulated < 64
    assert progress.eta_next_epoch - get_dht_time() <= optimizer.matchmaking_time, "the step is not near: checks nothing"
    loads_at_once(optimizer, caplog)


def test_a_load_while_the_swarm_is_far_from_its_step_downloads_at_once(trainers, caplog):
    (_, donor), (_, optimizer) = trainers
    donor.tracker.report_local_progress(0, 4)
    time.sleep(2.0)
    donor.tracker.report_local_progress(0, 6)  # 58 samples short at about 1 sample/s: nearly a minute away
    wait_for(lambda: optimizer.tracker.global_progress.samples_accumulated >= 6, 30,
             "the samples in this view", interval_s=0.05)
    assert optimizer.tracker.global_progress.eta_next_epoch - get_dht_time() > optimizer.matchmaking_time
    loads_at_once(optimizer, caplog)


def loads_at_once(optimizer, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="geotrain.hive.optim.optimizer"):
        optimizer.load_state_from_peers()
    assert "once it has stepped" not in caplog.text, "the load waited for the swarm's step"
    assert optimizer.local_epoch == 0


class OtherTrainer:
    """A DHT node in this process that signs progress records with a key of its own, as another trainer
    process would (this process's trainers share one signing key, so one progress subkey)."""

    def __init__(self, dht):
        signer = RSASignatureValidator(RSAPrivateKey())  # (the DHT's process forks with it)
        self.dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                initial_peers=[str(a) for a in dht.get_visible_maddrs()],
                                record_validators=[signer, SchemaValidator(TrainingProgressSchema, prefix=RUN_ID)])
        self.subkey = signer.local_public_key

    def reports(self, epoch: int, samples: int) -> None:
        progress = LocalTrainingProgress(peer_id=self.dht.peer_id.to_bytes(), epoch=epoch, samples_accumulated=samples,
                                         samples_per_second=100.0, time=get_dht_time(), client_mode=False)
        assert self.dht.store(progress_key(RUN_ID), subkey=self.subkey, value=progress.dict(),
                              expiration_time=get_dht_time() + 60)

    def says_goodbye(self) -> None:
        """The empty record a leaving trainer stores (geotrain.hive.optim.leave)."""
        assert self.dht.store(progress_key(RUN_ID), subkey=self.subkey, value=None, expiration_time=get_dht_time() + 61)

    def shutdown(self) -> None:
        self.dht.shutdown()


@pytest.fixture
def other_trainers(trainers):
    made = []
    yield lambda: made.append(OtherTrainer(trainers[1][1].dht)) or made[-1]
    for other in made:
        other.shutdown()


def the_swarm_steps_during_the_download(optimizer, swarm_steps) -> None:
    """The receiver's download, with the swarm's step right after it, while hivemind's tracker is still paused."""
    download = optimizer.state_averager.load_state_from_peers

    def download_then_step(**kwargs):
        result = download(**kwargs)
        swarm_steps()
        wait_for(lambda: swarm_epoch_and_trainers(optimizer.dht, RUN_ID)[0] == 1, 30,
                 "the step in the records", interval_s=0.05)
        return result

    optimizer.state_averager.load_state_from_peers = download_then_step


def test_a_load_that_ends_after_the_swarms_step_catches_up_with_it(trainers, other_trainers):
    # hivemind's own catching up compares with its tracker's view from before the load: the peer stayed at
    # epoch 0, and at its next step it would have missed the round and downloaded again
    (donor_model, _), (model, optimizer) = trainers
    other = other_trainers()
    the_swarm_steps_during_the_download(optimizer, lambda: other.reports(epoch=1, samples=0))

    optimizer.load_state_from_peers()

    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), donor_model.parameters())), "nothing was loaded"
    assert optimizer.state_averager.loaded_epoch in (None, 0) and optimizer.local_epoch == 1
    assert optimizer.tracker.local_progress.epoch == 1, "the swarm does not count this peer in its epoch"
    backward(model)
    assert not optimizer._should_load_state_from_peers(), "it would download the state again"


def test_a_load_that_ends_during_the_swarms_round_waits_for_its_step_then_catches_up(trainers, other_trainers,
                                                                                        caplog):
    # two other trainers reach the whole batch of epoch 0 during the download: their group forms without this
    # peer, which can no longer join it
    _, (_, optimizer) = trainers
    others = [other_trainers(), other_trainers()]
    stepped = threading.Timer(3.0, lambda: [other.reports(epoch=1, samples=0) for other in others])
    download = optimizer.state_averager.load_state_from_peers

    def download_then_the_swarms_round(**kwargs):
        result = download(**kwargs)
        for other in others:
            other.reports(epoch=0, samples=32)
        wait_for(lambda: sum(p.samples_accumulated for p in read_progress(optimizer.dht, RUN_ID).values()) >= 64, 30,
                 "the whole batch in the records", interval_s=0.05)
        stepped.start()
        return result

    optimizer.state_averager.load_state_from_peers = download_then_the_swarms_round
    with caplog.at_level(logging.INFO, logger="geotrain.hive.optim.optimizer"):
        optimizer.load_state_from_peers()
    stepped.join()
    assert "waiting for its step" in caplog.text
    assert optimizer.local_epoch == 1, "it did not catch up once the swarm had stepped"


def test_a_load_next_to_a_single_other_trainer_does_not_wait_for_a_step_that_needs_this_peer(trainers,
                                                                                             other_trainers, caplog):
    _, (_, optimizer) = trainers
    other = other_trainers()
    download = optimizer.state_averager.load_state_from_peers

    def download_then_the_others_batch(**kwargs):
        result = download(**kwargs)
        other.reports(epoch=0, samples=64)
        wait_for(lambda: any(p.samples_accumulated >= 64 for p in read_progress(optimizer.dht, RUN_ID).values()), 30,
                 "the whole batch in the records", interval_s=0.05)
        return result

    optimizer.state_averager.load_state_from_peers = download_then_the_others_batch
    with caplog.at_level(logging.INFO, logger="geotrain.hive.optim.optimizer"):
        optimizer.load_state_from_peers()
    assert "waiting for its step" not in caplog.text and optimizer.local_epoch == 0


def test_a_round_of_the_last_trainer_left_is_given_up_at_once_and_it_steps_with_its_own_gradients(
        trainers, other_trainers, caplog):
    # seen in tests/integration/test_preemption.py: the other trainer of two left while this one's round began
    # (hivemind's tracker still counted it); the round looked for a group for the whole averaging timeout
    _, (model, optimizer) = trainers
    other = other_trainers()
    other.reports(epoch=0, samples=32)
    optimizer.tracker.report_local_progress(0, 32)
    own = str(optimizer.dht.peer_id)
    wait_for(lambda: set(read_progress(optimizer.dht, RUN_ID)) == {own, str(other.dht.peer_id)}, 30,
             "both records", interval_s=0.05)
    rounds = []
    optimizer.on_averaging_round = lambda result, duration_s: rounds.append(result)
    control = looking_for_a_group()
    control.allow_allreduce()  # as hivemind's optimizer does when it begins the round
    backward(model)
    expected = [p.grad.clone() for p in model.parameters()]
    optimizer.grad_averager.accumulate_grads_(batch_size=32)
    averaging = threading.Thread(target=optimizer._average_gradients_and_load_into_optimizer, args=(control,))
    with caplog.at_level(logging.INFO, logger="geotrain.hive.optim.optimizer"):
        averaging.start()
        time.sleep(2 * optimizer.missed_round_check_s)
        assert averaging.is_alive(), "given up while another trainer was in the swarm"

        other.says_goodbye()
        averaging.join(timeout=4 * optimizer.missed_round_check_s + 5)
    assert not averaging.is_alive(), "the round still looks for a group"
    assert control.cancelled() and rounds == ["alone"]
    assert "no other trainer is left" in caplog.text
    assert optimizer._missed_round_of_epoch is None, "it would load a state no one is left to give"
    assert not optimizer.state_averager.skip_averaging_round
    applied = [p.grad for p in optimizer.state_averager.main_parameters]
    assert all(torch.allclose(a, e) for a, e in zip(applied, expected)), "not this peer's own gradients"


def test_a_failed_read_of_the_records_is_no_reason_to_give_a_round_up(trainers):
    _, (_, optimizer) = trainers  # no record yet: this peer's own is missing too, as when a read fails
    assert read_progress(optimizer.dht, RUN_ID) == {}
    assert reason_to_give_up(optimizer.dht, RUN_ID, str(optimizer.dht.peer_id), past_epoch=1) is None
