"""Spot preemption: each cloud's notice, served by a real HTTP server on loopback, makes a trainer leave
within its budget, and the trainers that stay finish their next epoch without waiting for it."""

from __future__ import annotations

import time

import pytest

from geotrain.config import PreemptionConfig
from geotrain.events import read_events
from geotrain.stopping.notices import EXIT_PREEMPTED, detect_cloud, start_watcher
from cloud_metadata import CLOUDS, metadata_flags
from swarm_helpers import IDLE_SWARM, last_epoch, wait_for

EXIT_BUDGET_S = 20.0
AVERAGING_TIMEOUT_S = 30.0  # long, so that a swarm that waited for a departed peer would show it


@pytest.fixture
def servers():
    started = {cloud: server_class() for cloud, server_class in CLOUDS.items()}
    yield started
    for server in started.values():
        server.close()


@pytest.mark.parametrize("cloud", sorted(CLOUDS))
def test_watcher_reports_the_notice_and_when_the_vm_goes(servers, cloud):
    server = servers[cloud]
    config = PreemptionConfig(source=cloud, poll_interval_s=0.2, **{f"{cloud}_metadata_url": server.url})
    notices = []
    watcher = start_watcher(config, notices.append)
    try:
        time.sleep(1.0)
        assert notices == [], "a notice before the cloud gave one"
        server.notify(seconds_ahead=30)
        wait_for(lambda: notices, 10, f"the {cloud} notice")
    finally:
        watcher.stop()
    notice = notices[0]
    assert notice.cloud == cloud
    assert 20 <= notice.seconds_left() <= 31
    if cloud == "azure":
        assert server.acknowledged == ["602d9444-d2cd-49c7-8624-8643e7171297"]


def test_auto_detects_the_cloud_from_its_metadata_service(servers):
    unreachable = "http://127.0.0.1:9"
    for cloud, server in servers.items():
        urls = {f"{other}_metadata_url": (server.url if other == cloud else unreachable) for other in CLOUDS}
        assert detect_cloud(PreemptionConfig(**urls)) == cloud
    started = time.monotonic()
    assert detect_cloud(PreemptionConfig(**{f"{c}_metadata_url": unreachable for c in CLOUDS})) == "signal"
    assert time.monotonic() - started < 5


def test_each_clouds_notice_makes_a_trainer_leave_and_the_swarm_goes_on(swarm, servers):
    swarm.start_coordinator()
    common = [*IDLE_SWARM, "--wait-for-peers", "4", "--averaging-timeout", str(AVERAGING_TIMEOUT_S)]
    trainers = {}
    for index, cloud in enumerate(sorted(CLOUDS)):
        trainers[cloud] = swarm.start_trainer(cloud, *common, "--data-seed", str(index + 1),
                                              *metadata_flags(cloud, servers[cloud]))
    stayer, stayer_events = swarm.start_trainer("stayer", *common, "--data-seed", "9")
    # the "signal" stayer replaces its `--preemption signal` default with nothing else: it only stays
    wait_for(lambda: all(last_epoch(events) >= 2 for _, events in trainers.values()), 240,
             "all four trainers training together")

    remaining = dict(trainers)
    for cloud in sorted(CLOUDS):
        process, events = remaining.pop(cloud)
        epoch_before = last_epoch(stayer_events)
        servers[cloud].notify(seconds_ahead=30)
        process.wait(timeout=EXIT_BUDGET_S + 15)
        assert process.returncode == EXIT_PREEMPTED, swarm.log(cloud)[-3000:]
        notice = next(e for e in read_events(events) if e["event"] == "preemption_notice")
        finished = next(e for e in read_events(events) if e["event"] == "finished")
        left_after_s = finished["time"] - notice["time"]
        assert left_after_s <= EXIT_BUDGET_S, f"{cloud}: left {left_after_s:.1f} s after the notice"
        assert "preemption notice" in finished["stop_reason"]

        # the swarm completes the epoch after this departure without waiting out the averaging timeout
        target_epoch = epoch_before + 2
        wait_for(lambda: last_epoch(stayer_events) >= target_epoch, AVERAGING_TIMEOUT_S + 60,
                 f"the stayer's epoch {target_epoch} after the {cloud} peer left")
        for epoch in (e for e in read_events(stayer_events) if e["event"] == "epoch"
                      and epoch_before < e["epoch"] <= target_epoch):
            assert epoch["comm_s"] < AVERAGING_TIMEOUT_S / 2, (
                f"after the {cloud} peer left, epoch {epoch['epoch']} spent {epoch['comm_s']:.1f} s communicating")
    assert stayer.poll() is None
