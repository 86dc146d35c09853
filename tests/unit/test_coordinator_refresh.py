"""When the coordinator downloads the swarm's state between checkpoints (geotrain.coordinator.refresh_due).

A coordinator one epoch behind wins a newcomer's donor ranking over current trainers farther away, so it
keeps the state it offers current while that costs a transfer inside its own region, and only then.
"""

from __future__ import annotations

from geotrain.config import load_config
from geotrain.coordinator import refresh_due, trainer_in_region
from geotrain.hive.dht.metric_records import MetricRecord, PeerRecord


def _record(peer_id: str, role: str, region: str) -> PeerRecord:
    record = MetricRecord(peer_id=peer_id, role=role, region=region, cloud="lab", instance_type="vm", time=1.0,
                          epoch=4, samples_total=0, samples_per_second=0.0, granularity=None,
                          compute_seconds_total=0.0, communication_seconds_total=0.0, sent_bytes_by_region={},
                          received_bytes_total=0, addresses=["10.77.1.2:4000"])
    return PeerRecord(owner=f"owner-{peer_id}", record=record, expiration_time=0.0)


def test_a_trainer_in_the_coordinators_region_is_found_and_the_coordinator_itself_does_not_count():
    records = {"a": _record("coordinator", "coordinator", "us"), "b": _record("trainer-eu", "trainer", "eu")}
    assert not trainer_in_region(records, "us")
    records["c"] = _record("trainer-us", "trainer", "us")
    assert trainer_in_region(records, "us")
    assert not trainer_in_region({}, "us")


def test_the_state_is_refreshed_every_epoch_only_from_a_trainer_in_its_own_region():
    settings = load_config().coordinator
    assert refresh_due(swarm_epoch=5, epoch=4, trainer_in_region=True, settings=settings)
    assert not refresh_due(swarm_epoch=5, epoch=4, trainer_in_region=False, settings=settings), \
        "a far trainer's uplink spent every epoch"
    assert not refresh_due(swarm_epoch=5, epoch=5, trainer_in_region=True, settings=settings), "already current"
    off = load_config(set_args=["coordinator.refresh_in_region=false"]).coordinator
    assert not refresh_due(swarm_epoch=5, epoch=4, trainer_in_region=True, settings=off)
