"""A peer counts the swarm's progress without the peers it has banned.

A banned peer is refused, not stopped: it trains on and keeps publishing progress records. Seen in a fresh-clone
run of tests/integration/test_hostile_peers.py: two honest trainers banned the hostile majority, hivemind's
tracker still took the hostile peers' epoch as the swarm's, and the honest trainers reloaded the state some 300
times to reach an epoch that only banned donors held, stuck at epoch 3 for the rest of the run.

Two real trainers' optimizers (geotrain's build) on a DHT of two loopback nodes: the first publishes a progress
record of an epoch far ahead; the second reads the swarm's records from the DHT as its tracker does.
"""

from __future__ import annotations

import time

from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.utils import ValueWithExpiration

from geotrain.config import load_config
from optimizer_pair import optimizer_pair


def sync_config(*extra: str):
    return load_config(set_args=["optimizer.network_profile=loopback", "optimizer.batch_size_per_step=4",
                                 "optimizer.target_batch_size=64", "optimizer.optimizer=sgd",
                                 "swarm.run_id=progress-bans", *extra])


def swarm_records(tracker: ProgressTracker, *optimizers, timeout_s: float = 30.0) -> dict:
    """The progress records in the DHT, once each of ``optimizers``' peers has published one."""
    wanted = {optimizer.dht.peer_id.to_bytes() for optimizer in optimizers}
    deadline = time.monotonic() + timeout_s
    while True:
        found = tracker.dht.get(tracker.training_progress_key, latest=True)
        records = found.value if found is not None else {}
        if wanted <= {r.value["peer_id"] for r in records.values() if r.value is not None}:
            return records
        assert time.monotonic() < deadline, f"the progress records were not published within {timeout_s} s"
        time.sleep(0.2)


def test_a_banned_peers_epoch_and_samples_do_not_count_towards_the_swarms():
    with optimizer_pair(sync_config()) as ((_, ahead), (_, honest)):
        ahead.tracker.report_local_progress(local_epoch=40, samples_accumulated=48)
        records = swarm_records(honest.tracker, ahead)
        # two trackers in one process sign with one key and share a record; the honest one has published none
        others = sum(r.value is not None and r.value["peer_id"] != ahead.dht.peer_id.to_bytes()
                     for r in records.values())

        counted = honest.tracker._parse_swarm_progress_data(records)
        assert (counted.epoch, counted.num_peers) == (40, 1 + others)  # before the ban: the swarm is at its epoch

        honest.state_averager.guard_report.bans.ban(str(ahead.dht.peer_id), seconds=60)
        counted = honest.tracker._parse_swarm_progress_data(records)
        assert (counted.epoch, counted.num_peers) == (0, others)
        assert counted.samples_accumulated < 48
        # and the peer that banned no one still counts it
        assert ahead.tracker._parse_swarm_progress_data(records).epoch == 40


def test_a_diloco_round_is_sized_by_the_trainers_that_are_not_banned():
    config = sync_config("optimizer.mode=diloco", "optimizer.diloco.inner_steps=4")
    with optimizer_pair(config) as ((_, banned), (_, honest)):
        banned.tracker.report_local_progress(local_epoch=0, samples_accumulated=4)
        records = swarm_records(honest.tracker, banned)
        # two trackers in one process sign with one key, so they share a record: the honest trainer's is the
        # banned one's, under another subkey, with its own peer id
        (subkey, record), = [(k, r) for k, r in records.items() if r.value is not None]
        honest_value = dict(record.value, peer_id=honest.dht.peer_id.to_bytes())
        records = {subkey: record, subkey + b"-honest": ValueWithExpiration(honest_value, record.expiration_time)}
        per_trainer = honest.tracker.samples_per_trainer

        assert honest.tracker._parse_swarm_progress_data(records).target_batch_size == 2 * per_trainer
        honest.state_averager.guard_report.bans.ban(str(banned.dht.peer_id), seconds=60)
        counted = honest.tracker._parse_swarm_progress_data(records)
        assert (counted.target_batch_size, counted.num_peers) == (per_trainer, 1)
