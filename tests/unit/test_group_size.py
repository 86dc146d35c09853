"""A swarm of a known size (optimizer.group_size; geotrain local sets it) ends a round's matchmaking as soon
as its group is full, instead of waiting out the matchmaking time (hivemind's leader waits the whole
``matchmaking_time`` unless it knows the group's size)."""

from __future__ import annotations

import threading
import time

from geotrain.config import load_config
from geotrain.local import LocalSwarm
from optimizer_pair import optimizer_pair

MATCHMAKING_TIME_S = 30.0  # long, so that a round that waited it out cannot pass for one that did not


def config(*settings: str):
    return load_config(set_args=["optimizer.network_profile=loopback", "optimizer.batch_size_per_step=4",
                                 "optimizer.target_batch_size=64", "optimizer.optimizer=sgd",
                                 f"optimizer.matchmaking_time_s={MATCHMAKING_TIME_S}",
                                 "optimizer.averaging_timeout_s=60", "swarm.run_id=group-size", *settings])


def test_a_full_group_averages_without_waiting_out_the_matchmaking_time():
    with optimizer_pair(config("optimizer.group_size=2")) as pair:
        started = time.monotonic()
        results = [None, None]

        def average(index: int, averager) -> None:
            results[index] = averager.step(timeout=60)  # the gradient averager's round, as a step starts it

        threads = [threading.Thread(target=average, args=(i, optimizer.grad_averager))
                   for i, (_, optimizer) in enumerate(pair)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=70)
        took_s = time.monotonic() - started
    assert all(result is not None for result in results), "the round failed"
    assert took_s < MATCHMAKING_TIME_S / 2, f"the round took {took_s:.1f} s: it waited out the matchmaking time"


def test_local_sets_the_group_size_to_its_trainer_count_unless_the_config_does(tmp_path):
    assert LocalSwarm(load_config(), peers=3, epochs=1, run_dir=tmp_path / "a").config.optimizer.group_size == 3
    given = load_config(set_args=["optimizer.group_size=2"])
    assert LocalSwarm(given, peers=3, epochs=1, run_dir=tmp_path / "b").config.optimizer.group_size == 2
