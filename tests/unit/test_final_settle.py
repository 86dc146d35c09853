"""Who the end-of-run agreement waits for (geotrain.hive.state.finalize): before it picks the finalizer
(not_heard_from, still_in_the_last_round), and while the finalizer serves its state (followers_wanted)."""

from __future__ import annotations

from geotrain.hive.state.finalize import (enough_followers, followers_wanted, not_heard_from,
                                          still_in_the_last_round)

LAST_EPOCH = 10


def test_a_peer_that_already_took_the_final_state_is_not_waited_for():
    records = {"fast": {"role": "synced", "epoch": LAST_EPOCH}}
    assert not_heard_from({"fast": LAST_EPOCH}, records, {"me"}, set(), LAST_EPOCH) == set()


def test_a_peer_of_the_last_epoch_without_a_record_is_waited_for():
    assert not_heard_from({"me": LAST_EPOCH, "slow": LAST_EPOCH}, {}, {"me"}, set(), LAST_EPOCH) == {"slow"}


def test_candidates_banned_peers_and_peers_behind_are_not_waited_for():
    progress = {"me": LAST_EPOCH, "candidate": LAST_EPOCH, "banned": LAST_EPOCH, "behind": LAST_EPOCH - 1}
    records = {"candidate": {"role": "candidate", "epoch": LAST_EPOCH}}
    assert not_heard_from(progress, records, {"me", "candidate"}, {"banned"}, LAST_EPOCH) == set()


def test_a_peer_past_the_last_epoch_trains_on_and_is_not_waited_for():
    assert not_heard_from({"me": LAST_EPOCH, "on": LAST_EPOCH + 1}, {}, {"me"}, set(), LAST_EPOCH) == set()


def test_only_peers_one_epoch_behind_are_waited_for_as_still_in_the_last_round():
    # a trainer killed two epochs before the end leaves its record at its old epoch until it expires
    progress = {"me": LAST_EPOCH, "in the round": LAST_EPOCH - 1, "dead": LAST_EPOCH - 2, "banned": LAST_EPOCH - 1}
    assert still_in_the_last_round(progress, {"banned"}, LAST_EPOCH) == {"in the round"}


def at_the_last_epoch(*peers: str) -> dict[str, int]:
    return {peer: LAST_EPOCH for peer in peers}


def test_a_trainer_counted_in_the_last_epoch_whose_record_is_gone_is_not_waited_for():
    # the swarm counted three trainers; one died since: its record expired
    assert followers_wanted(3, at_the_last_epoch("me", "alive"), set(), "me", {"me"}, set(), LAST_EPOCH) == 1
    assert followers_wanted(3, at_the_last_epoch("me", "alive", "slow"), set(), "me", {"me"}, set(), LAST_EPOCH) == 2
    # one that took the state and left (its record withdrawn) still counts
    assert followers_wanted(3, at_the_last_epoch("me", "alive"), {"left after syncing"}, "me", {"me"}, set(),
                            LAST_EPOCH) == 2


def test_a_trainer_whose_record_shows_an_epoch_before_the_last_round_is_not_waited_for():
    # killed two epochs before the end: its record still shows the epoch it died in until it expires
    progress = {"me": LAST_EPOCH, "dead": LAST_EPOCH - 2}
    assert followers_wanted(2, progress, set(), "me", {"me"}, set(), LAST_EPOCH) == 0
    # one epoch behind: still in the last round, about to finish and take the state
    progress = {"me": LAST_EPOCH, "behind": LAST_EPOCH - 1}
    assert followers_wanted(2, progress, set(), "me", {"me"}, set(), LAST_EPOCH) == 1


def test_a_failed_read_of_the_progress_records_keeps_the_count_of_the_last_epoch():
    assert followers_wanted(3, {}, set(), "me", {"me"}, set(), LAST_EPOCH) == 2


def test_a_trainer_counted_in_the_last_epoch_is_waited_for_a_moment_though_its_record_lags():
    # the swarm counted two trainers; the other's progress record still shows an epoch before the last round
    # (it caught up by loading the state): followers_wanted says 0, the count says 1
    wanted = followers_wanted(2, {"me": LAST_EPOCH, "caught up": LAST_EPOCH - 2}, set(), "me", {"me"}, set(),
                              LAST_EPOCH)
    assert wanted == 0
    assert not enough_followers(0, wanted, 1, past_grace=False, past_settle=False)
    assert enough_followers(1, wanted, 1, past_grace=False, past_settle=False)  # it took the state
    assert enough_followers(0, wanted, 1, past_grace=True, past_settle=False)  # it died: a moment, not the settle
    # the followers the records show are waited for past the moment, up to the settle time
    assert not enough_followers(0, 1, 1, past_grace=True, past_settle=False)
    assert enough_followers(0, 1, 1, past_grace=True, past_settle=True)

