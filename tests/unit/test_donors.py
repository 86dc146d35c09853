"""Donor choice for state downloads (geotrain.hive.state.donors): the order, the probes, and the watch.

The watch runs on real hivemind averagers in processes of their own (one DHT node on loopback): a donor
that sends nothing, one that trickles, and one whose state is not finite, are dropped for the next, and the state
comes from that one.
"""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace
from typing import AsyncIterator

import pytest
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2

from geotrain.config import load_config
from geotrain.events import read_events
from geotrain.hive.state.donors import Donor, donor_labels, probe_rtt_s, rank_donors
from geotrain.hive.state.stream import StateAssembler
from geotrain.hive.averaging.handle_names import hivemind_handle_name
from geotrain.hive.optim.leave import stop_offering_state
from geotrain.hive.dht.metric_records import MetricRecord, PeerRecord
from donor_swarm import CHUNK, GoodDonor, Swarm, UncheckedDonor
from waiting import wait_for


# --- the stream --------------------------------------------------------------------------------------------
def test_a_stream_gives_its_metadata_and_each_tensor_whole_whether_metadata_comes_alone_or_with_a_part():
    from hivemind.compression import serialize_torch_tensor
    from hivemind.utils.serializer import MSGPackSerializer
    from hivemind.utils.streaming import split_for_streaming

    tensors = [torch.arange(40000, dtype=torch.float32), torch.ones(3, 5), torch.zeros(0)]
    parts = [part for tensor in tensors for part in split_for_streaming(serialize_torch_tensor(tensor), 2**16)]
    assert len(parts) > len(tensors), "the first tensor should come in several parts"
    metadata = MSGPackSerializer.dumps({"epoch": 3})
    alone = [averaging_pb2.DownloadData(metadata=metadata)] + [averaging_pb2.DownloadData(tensor_part=p) for p in parts]
    together = [averaging_pb2.DownloadData(tensor_part=parts[0], metadata=metadata)] + \
        [averaging_pb2.DownloadData(tensor_part=p) for p in parts[1:]]
    for messages in (alone, together):
        state = StateAssembler(MSGPackSerializer)
        received = sum(state.add(message) for message in messages)
        assert received == sum(len(p.buffer) for p in parts)
        assert state.metadata == {"epoch": 3}
        assert [t.tolist() for t in state.finish()] == [t.tolist() for t in tensors]
    # a donor that leaves inside a tensor: the error says so (it said "shape '[65536]' is invalid for input of
    # size 49152" in a run whose finalizer left while a follower downloaded)
    state = StateAssembler(MSGPackSerializer)
    for message in alone[:2]:
        state.add(message)
    with pytest.raises(RuntimeError, match="the stream ended inside tensor 0"):
        state.finish()


# --- the order ---------------------------------------------------------------------------------------------
def _ids(donors):
    return [d.peer_id for d in donors]


def test_same_region_first_then_round_trip_then_priority():
    donors = [Donor("far-fast", 7, "eu", 0.080), Donor("far-slow", 7, "us", 0.300), Donor("near", 7, "aus", 0.002),
              Donor("unknown", 7)]
    assert _ids(rank_donors(donors, "aus")) == ["near", "far-fast", "far-slow", "unknown"]


def test_a_donor_whose_address_does_not_answer_comes_after_those_that_do():
    # a SIGKILLed trainer's donor and metric records outlive it: same region, but nothing answers there
    donors = [Donor("near-killed", 7, "aus", None), Donor("far", 7, "us", 0.300)]
    assert _ids(rank_donors(donors, "aus")) == ["far", "near-killed"]
    # no probe answered at all (no addresses known): region and priority decide, as before
    unprobed = [Donor("far", 7, "us"), Donor("near", 7, "aus")]
    assert _ids(rank_donors(unprobed, "aus")) == ["near", "far"]


def test_the_coordinator_wins_a_tie_only():
    coordinator, trainer = Donor("coordinator", 7.5, "us", 0.0104), Donor("trainer", 7, "us", 0.0101)
    assert _ids(rank_donors([trainer, coordinator], "us")) == ["coordinator", "trainer"]  # 0.3 ms is noise
    near_trainer = Donor("near-trainer", 7, "aus", 0.001)
    assert _ids(rank_donors([coordinator, near_trainer], "aus")) == ["near-trainer", "coordinator"]


def test_a_stale_donor_comes_after_every_current_one_however_near():
    donors = [Donor("near-stale", 5, "aus", 0.001), Donor("far-current", 8, "us", 0.300),
              Donor("near-one-behind", 7, "aus", 0.001), Donor("older", 3, "aus", 0.001)]
    # sync mode: one epoch behind is current (hivemind moves such a peer up to the swarm's epoch)
    assert _ids(rank_donors(donors, "aus", epoch_tolerance=1)) == ["near-one-behind", "far-current", "near-stale",
                                                                   "older"]
    # DiLoCo: one round behind is another model
    assert _ids(rank_donors(donors, "aus", epoch_tolerance=0))[0] == "far-current"


def test_a_donor_with_nothing_new_for_this_peer_is_behind_when_another_has_something():
    # a trainer at epoch 7 that missed the swarm's step to 8: the coordinator's
    # checkpoint (7 + 0.5) and a trainer yet to declare its step hold the epoch before, however near
    donors = [Donor("near-coordinator", 7.5, "aus", 0.001), Donor("near-not-yet", 7, "aus", 0.001),
              Donor("far-stepped", 8, "us", 0.300)]
    assert _ids(rank_donors(donors, "aus", epoch_tolerance=1))[0] == "near-coordinator"
    assert _ids(rank_donors(donors, "aus", epoch_tolerance=1, min_epoch=8)) == ["far-stepped", "near-coordinator",
                                                                                "near-not-yet"]
    # no donor has anything newer (a DiLoCo peer off its round's majority loads its own epoch): the order stays
    same_epoch = donors[:2] + [Donor("far-same", 7, "us", 0.300)]
    assert rank_donors(same_epoch, "aus", 1, min_epoch=8) == rank_donors(same_epoch, "aus", 1)


def _record(peer_id: str, region: str, address: str) -> PeerRecord:
    record = MetricRecord(peer_id=peer_id, role="trainer", region=region, cloud="lab", instance_type="vm",
                          time=1.0, epoch=1, samples_total=0, samples_per_second=0.0, granularity=None,
                          compute_seconds_total=0.0, communication_seconds_total=0.0, sent_bytes_by_region={},
                          received_bytes_total=0, addresses=[address])
    return PeerRecord(owner=f"owner-{peer_id}-{region}", record=record, expiration_time=0.0)


def test_records_that_disagree_on_a_peer_leave_it_unlabelled():
    records = {"1": _record("honest", "aus", "10.77.4.2:4000"), "2": _record("victim", "us", "10.77.1.2:4000"),
               "3": _record("victim", "aus", "127.0.0.1:5000")}  # a spoofer claims the victim is near
    labels = donor_labels({key: value for key, value in records.items()})
    assert labels == {"honest": ("aus", ["10.77.4.2:4000"])}


def test_a_round_trip_is_one_tcp_handshake_and_nothing_else_is_dialled():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    free_port = free.getsockname()[1]
    free.close()  # a free loopback port: nothing listens there
    try:
        rtt = asyncio.run(probe_rtt_s([f"127.0.0.1:{listener.getsockname()[1]}"]))
        assert rtt is not None and 0 <= rtt < 1.0
        assert asyncio.run(probe_rtt_s([f"127.0.0.1:{free_port}"])) is None
        assert asyncio.run(probe_rtt_s(["localhost:80", "not an address", "127.0.0.1:0"])) is None  # no names resolved
    finally:
        listener.close()


def test_download_rate_and_stall_come_from_the_network_profile():
    far = load_config(set_args=["optimizer.network_profile=intercontinental"]).optimizer
    near = load_config(set_args=["optimizer.network_profile=lan"]).optimizer
    assert far.state_download_min_mbit_s < near.state_download_min_mbit_s
    assert far.state_download_stall_s > near.state_download_stall_s
    tuned = load_config(set_args=["optimizer.network_profile=intercontinental",
                                  "optimizer.state_download_min_mbit_s=3"]).optimizer
    assert tuned.state_download_min_mbit_s == 3


# --- the watch, on real averagers ---------------------------------------------------------------------------
class StallingDonor(DecentralizedAverager):
    """Announces its state and then sends nothing."""

    _get_handle_name = classmethod(hivemind_handle_name)

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest,
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        await asyncio.sleep(3600)
        yield averaging_pb2.DownloadData()


class TricklingDonor(DecentralizedAverager):
    """Sends its state in small pieces, slowly: well under any useful rate."""

    _get_handle_name = classmethod(hivemind_handle_name)

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest,
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        async for message in super().rpc_download_state(request, context):
            await asyncio.sleep(0.5)
            yield message


@pytest.fixture
def swarm():
    swarm = Swarm()
    yield swarm
    swarm.shutdown()


@pytest.mark.parametrize("bad_donor, dropped_as", [(StallingDonor, "stalled"), (TricklingDonor, "slow")])
def test_a_stalled_or_slow_donor_is_dropped_for_the_next(swarm, bad_donor, dropped_as):
    # the bad donor announces the higher priority: hivemind's order would ask it first, and so does ours
    (_, good), downloader, report = swarm.downloader((bad_donor, 2.0, 9.0), (GoodDonor, 3.0, 8.0))
    metadata, tensors = downloader.load_state_from_peers(timeout=60)
    assert torch.equal(tensors[0], torch.full((4 * CHUNK,), 3.0)), "the state did not come from the good donor"
    attempts = report.downloads.snapshot()["attempts"]
    assert attempts[dropped_as] == 1 and attempts["ok"] == 1, attempts
    assert report.last_donor()[0] == good.peer_id.to_base58()
    assert metadata["geotrain_state_bytes"] == 4 * 4 * CHUNK  # a geotrain donor says its state's size


def test_only_the_allowed_donors_are_asked(swarm):
    (_, allowed), downloader, report = swarm.downloader((GoodDonor, 5.0, 9.0), (GoodDonor, 6.0, 1.0))
    report.set_allowed_donors({allowed.peer_id.to_base58()})
    _, tensors = downloader.load_state_from_peers(timeout=60)
    assert torch.equal(tensors[0], torch.full((4 * CHUNK,), 6.0))
    report.bans.ban(allowed.peer_id.to_base58(), 600)  # a banned donor is never asked, even when allowed
    assert downloader.load_state_from_peers(timeout=60) is None


def test_a_donor_whose_state_is_not_finite_is_refused_banned_and_the_next_one_asked(swarm, tmp_path):
    # the poisoned donor announces the higher priority: it is asked first
    events_path = tmp_path / "events.jsonl"
    (poisoned, good), downloader, report = swarm.downloader((UncheckedDonor, float("nan"), 9.0),
                                                            (GoodDonor, 3.0, 8.0), events_path=events_path)
    _, tensors = downloader.load_state_from_peers(timeout=60)
    assert torch.equal(tensors[0], torch.full((4 * CHUNK,), 3.0)), "the state did not come from the finite donor"
    attempts = report.downloads.snapshot()["attempts"]
    assert attempts["refused"] == 1 and attempts["ok"] == 1, attempts
    assert report.counts()[("download_state", "non-finite state")] == 1
    assert report.bans.active() == {poisoned.peer_id.to_base58()}
    refused = [e for e in read_events(events_path) if e["event"] == "state_refused"]
    assert [(e["from_peer"], e["reason"]) for e in refused] == [(poisoned.peer_id.to_base58(), "non-finite")]
    # with the finite donor gone too, nothing is loaded: the peer keeps what it has
    report.bans.ban(good.peer_id.to_base58(), 600)
    assert downloader.load_state_from_peers(timeout=60) is None


def test_a_geotrain_donor_whose_own_state_is_not_finite_serves_nothing_and_is_not_banned(swarm):
    """An honest peer's served parameters hold a bad peer's NaN span from a state averaging round until its next
    step restores them: it withholds them, and the downloader asks the next donor without banning it."""
    (withholding, _), downloader, report = swarm.downloader((GoodDonor, float("nan"), 9.0), (GoodDonor, 3.0, 8.0))
    _, tensors = downloader.load_state_from_peers(timeout=60)
    assert torch.equal(tensors[0], torch.full((4 * CHUNK,), 3.0)), "the state did not come from the finite donor"
    attempts = report.downloads.snapshot()["attempts"]
    assert attempts["empty"] == 1 and attempts["refused"] == 0 and attempts["ok"] == 1, attempts
    assert report.bans.active() == set(), "an honest donor that withheld its state was banned"


class EpochDonor(GoodDonor):
    """Serves its state under the epoch ``served_epoch`` (a trainer's state carries its epoch)."""

    served_epoch = 0

    def get_current_state(self):
        metadata, tensors, infos = super().get_current_state()
        return {**metadata, "epoch": self.served_epoch}, tensors, infos


def _serving(epoch: int) -> type:
    return type(f"DonorOfEpoch{epoch}", (EpochDonor,), {"served_epoch": epoch})


def test_a_peer_that_takes_only_newer_states_asks_no_donor_at_its_epoch_and_refuses_an_old_state(swarm):
    # the coordinator at epoch 9: a trainer at 9 has nothing for it; one that announces 10 but serves 9 (caught
    # mid-step) is asked first (the higher priority) and refused; the state comes from the one that serves 10
    (same, stale, newer), downloader, report = swarm.downloader(
        (_serving(9), 1.0, 9.0), (_serving(9), 2.0, 10.6), (_serving(10), 3.0, 10.2))
    report.own_epoch.note(9, newer_only=True)
    metadata, tensors = downloader.load_state_from_peers(timeout=60)
    assert torch.equal(tensors[0], torch.full((4 * CHUNK,), 3.0)), "the state did not come from the newer donor"
    assert metadata["epoch"] == 10
    attempts = report.downloads.snapshot()["attempts"]
    assert attempts["refused"] == 1 and attempts["ok"] == 1, attempts
    assert report.bans.active() == set(), "an old state is no offence"
    # with no newer donor left, nothing is loaded; a peer that falls back on its own epoch takes the trainer at 9
    report.bans.ban(newer.peer_id.to_base58(), 600)
    report.bans.ban(stale.peer_id.to_base58(), 600)
    assert downloader.load_state_from_peers(timeout=60) is None
    report.own_epoch.note(9)
    _, tensors = downloader.load_state_from_peers(timeout=60)
    assert torch.equal(tensors[0], torch.full((4 * CHUNK,), 1.0))


def test_a_leaving_peer_offers_its_state_to_no_new_downloader(swarm):
    # the leaving donor announces the higher priority: it would be asked first
    (leaving, staying), downloader, report = swarm.downloader((GoodDonor, 2.0, 9.0), (GoodDonor, 3.0, 8.0))
    stop_offering_state(SimpleNamespace(state_averager=leaving))  # what a stop request does (geotrain.trainer)
    wait_for(lambda: leaving.peer_id.to_bytes() not in _announced(swarm.first), 30,
             "the withdrawn donor record", interval_s=0.05)
    _, tensors = downloader.load_state_from_peers(timeout=60)
    assert torch.equal(tensors[0], torch.full((4 * CHUNK,), 3.0)), "the state came from the leaving peer"
    assert report.downloads.snapshot()["attempts"]["ok"] == 1


def _announced(dht) -> set[bytes]:
    found = dht.get("donors.all_averagers", latest=True)
    if found is None:
        return set()
    return {subkey for subkey, entry in found.value.items() if entry.value is not None}
