"""State downloads in stripes from several donors at once (geotrain.hive.state.stripes).

The plan and the donor rule on their own; the download on real hivemind averagers in processes of their own
(one DHT node each, on loopback): donors that hold different values show which stripe came from whom.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import msgpack
import pytest
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer

from geotrain.events import read_events
from geotrain.hive.state import donors
from geotrain.hive.state.donors import Donor
from geotrain.hive.averaging.handle_names import hivemind_handle_name
from geotrain.hive.guard.report import GuardReport
from geotrain.hive.state.stripes import PART_KEY, PartRequest, PartRequestError, plan_stripes, stripe_donors
from donor_swarm import CHUNK, Downloader, GoodDonor, Swarm, UncheckedDonor

TENSORS = 6


# --- the plan -----------------------------------------------------------------------------------------------
def test_stripes_cover_every_tensor_once_in_runs_of_about_equal_bytes():
    assert plan_stripes([10] * 6, 3) == [(0, 2), (2, 4), (4, 6)]
    assert plan_stripes([10] * 6, 4) == [(0, 2), (2, 3), (3, 5), (5, 6)]
    assert plan_stripes([10] * 2, 5) == [(0, 1), (1, 2)]  # never more stripes than tensors
    assert plan_stripes([100, 1, 1, 1], 3) == [(0, 1), (1, 2), (2, 4)]  # a big tensor is a stripe of its own
    for sizes, count in (([5, 1, 9, 2, 2, 7, 1], 4), ([1], 3), ([0, 0, 4], 2)):
        stripes = plan_stripes(sizes, count)
        assert [i for first, stop in stripes for i in range(first, stop)] == list(range(len(sizes)))
        assert all(first < stop for first, stop in stripes) and len(stripes) <= count


def test_stripes_come_from_donors_of_the_first_ones_epoch_one_per_region_and_only_when_it_is_far():
    far, far2, far3 = Donor("eu", 8, "eu"), Donor("us", 8.5, "us"), Donor("asia", 8, "asia")
    older = Donor("older", 7, "aus")
    assert stripe_donors([far, far2, older, far3], "aus", 3) == [far, far2, far3]
    assert stripe_donors([far, far2, far3], "aus", 2) == [far, far2]
    assert stripe_donors([far, older], "aus", 3) == [], "one current donor: nothing to stripe over"
    assert stripe_donors([Donor("near", 8, "aus"), far, far2], "aus", 3) == [], "the near donor's link is the fast one"
    assert stripe_donors([far, far2], "aus", 1) == [], "striping turned off"
    assert stripe_donors([far, far2], None, 3) == [far, far2]  # this peer's region unknown: every donor is far
    also_eu, unknown = Donor("eu-coordinator", 8.5, "eu"), Donor("unknown", 8)
    assert stripe_donors([far, also_eu, unknown, far2], "aus", 3) == [far, unknown, far2], \
        "two donors in one region share its link"


def test_stripes_take_the_epoch_most_regions_hold_and_leave_out_donors_that_did_not_answer():
    # right after the swarm's step: the nearest donor still declares the epoch before, two farther ones the new
    near_behind = Donor("us-not-yet", 6, "us", 0.020)
    stepped = [Donor("asia", 7, "asia", 0.060), Donor("aus", 7, "aus", 0.090)]
    assert stripe_donors([near_behind, *stepped], "eu", 3) == stepped
    assert stripe_donors([near_behind, stepped[0]], "eu", 3) == [], "parts of two epochs are no state"
    also_behind = Donor("aus-not-yet", 6, "aus", 0.090)
    assert stripe_donors([near_behind, also_behind, *stepped], "eu", 3) == stepped, "a tie: the newer epoch"
    older = Donor("older", 5, "asia", 0.010)
    assert stripe_donors([near_behind, older, Donor("aus-6", 6, "aus", 0.09)], "eu", 3) == \
        [near_behind, Donor("aus-6", 6, "aus", 0.09)], "never an epoch older than the first donor's"
    # a SIGKILLed peer's record lingers: its address does not answer, and it is no stripe donor
    dead = Donor("eu-killed", 7, "eu", None)
    assert stripe_donors([*stepped, dead], "eu", 3) == stepped
    assert stripe_donors([dead, *stepped], "eu", 3) == stepped, "a silent same-region donor is no fast link"


def test_a_part_request_that_names_no_download_or_range_is_refused_with_the_reason():
    serializer = MSGPackSerializer
    good = PartRequest("d1", 2, 5)
    assert PartRequest.from_message(good.to_message(serializer), serializer) == good
    for metadata, says in ((b"\xc1 not msgpack", "not a part request"),
                           (serializer.dumps({"other": 1}), "not a part request"),
                           (serializer.dumps({PART_KEY: {"download": "", "first": 0, "stop": 1}}), "short string"),
                           (serializer.dumps({PART_KEY: {"download": "d", "first": 4, "stop": 2}}), "not a range"),
                           (serializer.dumps({PART_KEY: {"download": "d", "first": -1, "stop": 2}}), "not a range"),
                           (serializer.dumps({PART_KEY: {"download": "d", "first": "0", "stop": 2}}), "not a range")):
        with pytest.raises(PartRequestError, match=says):
            PartRequest.from_message(averaging_pb2.DownloadData(metadata=metadata), serializer)


# --- the download, on real averagers ------------------------------------------------------------------------
class StripingDownloader(Downloader):
    donor_stripe_min_bytes = 0  # these states are small


class StallingPartDonor(GoodDonor):
    """Offers its state, and sends nothing for a stripe."""

    async def rpc_download_state_part(self, request: averaging_pb2.DownloadData,
                                      context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        await asyncio.sleep(3600)
        yield averaging_pb2.DownloadData()


class HivemindDonor(DecentralizedAverager):
    """A donor that serves whole states only (hivemind's own, or an older geotrain)."""

    _get_handle_name = classmethod(hivemind_handle_name)


@pytest.fixture
def swarm(monkeypatch):
    # these tests choose the donors' order by their priorities: loopback round trips tie within the 5 ms that
    # make donors one data centre, but on a loaded CI machine one probe can take longer, and a fresh-clone run
    # once put the donor that serves no stripes first (no stripes at all). The downloader, forked later, inherits
    monkeypatch.setattr(donors, "RTT_RESOLUTION_S", 1.0)
    swarm = Swarm()
    yield swarm
    swarm.shutdown()


def _values(tensors) -> list[float]:
    """Each tensor's value; each must be one value throughout (a whole tensor from one donor)."""
    assert len(tensors) == TENSORS and all(t.shape == (4 * CHUNK,) for t in tensors)
    assert all(torch.equal(t, torch.full_like(t, float(t[0]))) for t in tensors), "a tensor mixes donors' values"
    return [float(t[0]) for t in tensors]


def _stripes_event(events_path) -> dict:
    (event,) = [e for e in read_events(events_path) if e["event"] == "state_download" and e["result"] == "ok"]
    return event


def test_a_state_comes_in_stripes_from_two_donors_at_once(swarm, tmp_path):
    events_path = tmp_path / "events.jsonl"
    (first, second), downloader, report = swarm.downloader((GoodDonor, 3.0, 8.4), (GoodDonor, 4.0, 8.0),
                                                           events_path=events_path,
                                                           downloader_class=StripingDownloader, tensors=TENSORS)
    metadata, tensors = downloader.load_state_from_peers(timeout=60)

    values = _values(tensors)
    assert set(values) == {3.0, 4.0}, f"not striped over both donors: {values}; {read_events(events_path)}"
    stripes = _stripes_event(events_path)["stripes"]
    tensor_bytes = 4 * 4 * CHUNK
    assert stripes == {first.peer_id.to_base58(): values.count(3.0) * tensor_bytes,
                       second.peer_id.to_base58(): values.count(4.0) * tensor_bytes}
    assert metadata["geotrain_state_bytes"] == TENSORS * tensor_bytes and "geotrain_tensor_bytes" not in metadata
    assert _stripes_event(events_path)["state_bytes"] == TENSORS * tensor_bytes  # what a soak bounds the time by
    assert report.downloads.snapshot()["attempts"]["ok"] == 1


@pytest.mark.parametrize("bad_donor", [StallingPartDonor, HivemindDonor])
def test_a_donor_that_stalls_or_serves_no_stripes_is_dropped_and_the_others_send_its_stripes(swarm, tmp_path,
                                                                                            bad_donor):
    events_path = tmp_path / "events.jsonl"
    (good, _), downloader, report = swarm.downloader((GoodDonor, 3.0, 8.4), (bad_donor, 4.0, 8.0),
                                                     events_path=events_path, downloader_class=StripingDownloader,
                                                     tensors=TENSORS)
    _, tensors = downloader.load_state_from_peers(timeout=60)

    assert _values(tensors) == [3.0] * TENSORS
    assert list(_stripes_event(events_path)["stripes"]) == [good.peer_id.to_base58()]


def test_a_stripe_that_is_not_finite_is_refused_its_donor_banned_and_the_stripe_sent_by_another(swarm, tmp_path):
    events_path = tmp_path / "events.jsonl"
    (good, poisoned), downloader, report = swarm.downloader((GoodDonor, 3.0, 8.4), (UncheckedDonor, float("nan"), 8.0),
                                                            events_path=events_path,
                                                            downloader_class=StripingDownloader, tensors=TENSORS)
    _, tensors = downloader.load_state_from_peers(timeout=60)

    assert _values(tensors) == [3.0] * TENSORS
    assert report.bans.active() == {poisoned.peer_id.to_base58()}
    assert report.counts()[("download_state", "non-finite state")] == 1
    refused = [e for e in read_events(events_path) if e["event"] == "state_refused"]
    assert [e["from_peer"] for e in refused] == [poisoned.peer_id.to_base58()]


def test_a_first_donor_that_serves_no_stripes_sends_the_whole_state(swarm, tmp_path):
    events_path = tmp_path / "events.jsonl"
    (old, _), downloader, report = swarm.downloader((HivemindDonor, 3.0, 8.4), (GoodDonor, 4.0, 8.0),
                                                    events_path=events_path, downloader_class=StripingDownloader,
                                                    tensors=TENSORS)
    _, tensors = downloader.load_state_from_peers(timeout=60)

    assert _values(tensors) == [3.0] * TENSORS, "not the first donor's whole state"
    event = _stripes_event(events_path)
    assert event["donor"] == old.peer_id.to_base58() and "stripes" not in event


def test_a_malformed_part_request_gets_no_state_and_is_counted(swarm):
    donor_report = GuardReport(None)
    donor_class = type("ReportingDonor", (GoodDonor,), {"guard_report": donor_report})
    donor = swarm.averager(donor_class, 3.0, priority=8.0, tensors=TENSORS)

    async def ask(metadata: bytes) -> list:
        p2p = await swarm.first.replicate_p2p()
        stub = donor_class.get_stub(p2p, donor.peer_id, namespace="donors")
        stream = await stub.rpc_download_state_part(averaging_pb2.DownloadData(metadata=metadata))
        return [message async for message in stream]

    garbage = msgpack.packb({PART_KEY: {"download": "x", "first": 3, "stop": 1}})
    assert asyncio.run(ask(garbage)) == [], "a state was sent for a request that names no range"
    assert donor_report.counts()[("download_state", "malformed part request")] == 1
    header = asyncio.run(ask(PartRequest("x", 0, 0).to_message(MSGPackSerializer).metadata))
    assert len(header) == 1 and header[0].metadata, "a well-formed request gets the header"
