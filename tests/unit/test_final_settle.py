"""Who the end-of-run agreement waits for before it picks the finalizer (geotrain.hive.finalize.not_heard_from)."""

from __future__ import annotations

from geotrain.hive.finalize import not_heard_from

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
