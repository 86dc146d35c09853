"""RecordLimits: what a flooding peer can make a DHT node store, and what honest peers never run into."""

from __future__ import annotations

import asyncio
import functools
import logging
import pickle

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.proto import dht_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time

from geotrain.hive.dht import record_limits
from geotrain.hive.dht.keys import metrics_key, progress_key, trainers_key
from geotrain.hive.dht.metric_records import MetricsSchema
from geotrain.hive.dht.record_limits import Limits, RecordLimits

RUN_ID = "limits-test"
NOW = 1_000_000.0  # the validator's clocks in these tests (see the clock fixture)


class Clock:
    """Stands in for both clocks the validator reads: DHT time (expirations) and monotonic time (rates)."""

    def __init__(self):
        self.now = NOW

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(record_limits, "get_dht_time", lambda: clock.now)
    monkeypatch.setattr(record_limits, "time", clock)
    return clock


@functools.lru_cache
def key_id(key: str) -> bytes:
    return DHTID.generate(source=key).to_bytes()


def record(key: str, subkey, value: bytes = b"v" * 100, ttl_s: float = 30.0, now: float = NOW) -> DHTRecord:
    return DHTRecord(key_id(key), MSGPackSerializer.dumps(subkey), value, now + ttl_s)


def table(limits: RecordLimits, key: str):
    return limits._keys[key_id(key)]


def test_records_of_other_keys_and_runs_pass_untouched(clock):
    limits = RecordLimits(RUN_ID, Limits(max_value_bytes=10, version_burst=1, max_subkeys_per_key=1))
    for number in range(100):
        assert limits.validate(record(metrics_key("another-run"), f"peer-{number}", b"x" * 10_000))
        assert limits.validate(record(f"{RUN_ID}_grad_averager.0b", f"peer-{number}", b"x" * 10_000))


def test_values_over_the_bound_are_refused(clock):
    limits = RecordLimits(RUN_ID)
    bound = limits.limits.max_value_bytes
    assert limits.validate(record(metrics_key(RUN_ID), b"peer-a", b"x" * bound))
    assert not limits.validate(record(metrics_key(RUN_ID), b"peer-b", b"x" * (bound + 1)))
    assert not limits.validate(record(progress_key(RUN_ID), b"peer-b", b"x" * 100_000))


def test_one_subkey_rewritten_faster_than_the_rate_is_refused(clock):
    limits = RecordLimits(RUN_ID, Limits(max_versions_per_s=10.0, version_burst=20))
    versions = [record(metrics_key(RUN_ID), b"peer", ttl_s=30.0 + 0.001 * n) for n in range(100)]
    accepted = [limits.validate(version) for version in versions]  # all at the same instant
    assert accepted == [True] * 20 + [False] * 80
    assert not limits.validate(versions[19]), "a repeated version takes a token like any other"
    clock.now += 1.0  # ten more tokens
    newer = [record(metrics_key(RUN_ID), b"peer", ttl_s=40.0 + 0.001 * n, now=clock.now) for n in range(11)]
    assert [limits.validate(version) for version in newer] == [True] * 10 + [False]
    assert limits.validate(record(metrics_key(RUN_ID), b"another-peer")), "the limit is per subkey"


def test_versions_older_than_a_cached_one_take_tokens_too(clock):
    """In CI a reader cached a flood's 300th rewrite on a node before the flood reached it; hivemind keeps that
    cache apart from the node's storage, so the 500 rewrites that followed were all stored. None may pass free."""
    limits = RecordLimits(RUN_ID, Limits(max_versions_per_s=10.0, version_burst=20))
    versions = [record(metrics_key(RUN_ID), b"flood", ttl_s=30.0 + 0.001 * n) for n in range(100)]
    assert limits.validate(versions[50]), "a reader's cached copy, the first this node hears of the subkey"
    clock.now += 10.0  # the bucket is full again
    accepted = [limits.validate(version) for version in versions]
    assert sum(accepted) == 20, "no more versions than the bucket holds, older ones included"


def test_honest_peers_at_many_times_their_measured_rates_are_never_refused(clock):
    limits = RecordLimits(RUN_ID)
    # measured at most 23 records of one subkey within a second, 5.4/s on average; here 10x both, for 60 s
    for second in range(60):
        for n in range(230 if second == 0 else 54):
            clock.now = NOW + second + n / 1000
            assert limits.validate(record(progress_key(RUN_ID), b"trainer", b"p" * 134, ttl_s=10.0, now=clock.now))
        assert limits.validate(record(metrics_key(RUN_ID), b"trainer", b"m" * 385, now=clock.now))


def test_a_flood_of_fresh_subkeys_fills_the_key_and_no_more(clock):
    limits = RecordLimits(RUN_ID)
    honest = record(trainers_key(RUN_ID), "honest-peer", b"t" * 9, ttl_s=120.0)
    assert limits.validate(honest)
    key_bytes, expiration_time = key_id(trainers_key(RUN_ID)), NOW + 30.0
    accepted = sum(limits.validate(DHTRecord(key_bytes, b"flood-%d" % n, b"t" * 9, expiration_time))
                   for n in range(100_000))
    key = table(limits, trainers_key(RUN_ID))
    assert accepted == limits.limits.max_subkeys_per_key - 1
    assert len(key.subkeys) == limits.limits.max_subkeys_per_key, "the bookkeeping stays at its cap"
    assert limits.validate(record(trainers_key(RUN_ID), "honest-peer", b"t" * 9, ttl_s=121.0)), \
        "a peer that was there before the flood keeps refreshing its record"
    assert not limits.validate(record(trainers_key(RUN_ID), "newcomer", b"t" * 9))


def test_the_bytes_of_one_key_are_bounded_and_records_already_there_can_grow(clock):
    limits = RecordLimits(RUN_ID)
    subkey = RSASignatureValidator().local_public_key  # what a signed metric record's subkey is
    accepted = [limits.validate(record(metrics_key(RUN_ID), subkey + b"%d" % n, b"m" * 4000)) for n in range(1000)]
    key = table(limits, metrics_key(RUN_ID))
    assert 0 < sum(accepted) < 1000 and not accepted[-1]
    assert key.total_bytes <= limits.limits.max_key_bytes * record_limits.NEW_SUBKEY_SHARE
    # a whole dictionary must fit in one DHT response (hivemind's p2p daemon caps it at 2 MiB)
    signed_bytes = sum(4000 + 344 + len(MSGPackSerializer.dumps(subkey + b"%d" % n)) for n in range(sum(accepted)))
    assert signed_bytes < 2 * 1024 * 1024 * 0.9
    assert limits.validate(record(metrics_key(RUN_ID), subkey + b"0", b"m" * 4096, ttl_s=31.0)), \
        "records already there may grow into the room left for them"


def test_expired_subkeys_make_room(clock):
    limits = RecordLimits(RUN_ID, Limits(max_subkeys_per_key=100))
    for n in range(100):
        assert limits.validate(record(trainers_key(RUN_ID), f"flood-{n}", ttl_s=10.0))
    assert not limits.validate(record(trainers_key(RUN_ID), "newcomer"))
    clock.now += 11.0
    assert limits.validate(record(trainers_key(RUN_ID), "newcomer", now=clock.now))
    assert len(table(limits, trainers_key(RUN_ID)).subkeys) == 1


def test_records_living_too_long_are_refused(clock):
    limits = RecordLimits(RUN_ID)
    assert limits.validate(record(metrics_key(RUN_ID), b"peer", ttl_s=120.0))
    assert not limits.validate(record(metrics_key(RUN_ID), b"flood", ttl_s=limits.limits.max_lifetime_s + 1))


def test_forged_records_spend_no_budget_of_the_peer_they_imitate(clock):
    limits = RecordLimits(RUN_ID, Limits(version_burst=1))
    validator = CompositeValidator([limits, RSASignatureValidator(), SchemaValidator(MetricsSchema, prefix=RUN_ID)])
    assert [type(v) for v in validator._validators][0] is RecordLimits, "validated last: lowest priority"
    victim = RSASignatureValidator().local_public_key
    forged = record(metrics_key(RUN_ID), victim, MSGPackSerializer.dumps({}) + b"[signature:AAAA]")
    for _ in range(10):
        assert not validator.validate(forged)
    assert not table(limits, metrics_key(RUN_ID)).subkeys


def test_refusals_are_logged_once_a_minute_per_key(clock, caplog):
    limits = RecordLimits(RUN_ID, Limits(max_value_bytes=10))
    with caplog.at_level(logging.WARNING, logger=record_limits.__name__):
        for _ in range(1000):
            limits.validate(record(metrics_key(RUN_ID), b"flood", b"x" * 11))
            limits.validate(record(progress_key(RUN_ID), b"flood", b"x" * 11))
        assert len(caplog.records) == 2
        clock.now += 61.0
        limits.validate(record(metrics_key(RUN_ID), b"flood", b"x" * 11, now=clock.now))
    lines = [entry.getMessage() for entry in caplog.records]
    assert len(lines) == 3
    assert metrics_key(RUN_ID) in lines[0] and "values over 10 bytes" in lines[0]
    assert "1000 values over 10 bytes" in lines[2], "the refusals in between are counted, not lost"


def test_reads_are_not_refused_for_what_this_node_counted(clock):
    """A refusal while reading drops the responding node's whole dictionary: only the size limit applies."""
    limits = RecordLimits(RUN_ID, Limits(max_subkeys_per_key=1, version_burst=1, max_value_bytes=1000))
    assert limits.validate(record(metrics_key(RUN_ID), b"flood"))  # the key is full for stores now
    dictionary, expiration_time = DictionaryDHTValue(), get_dht_time() + 30  # hivemind drops expired subkeys
    for n in range(5):
        dictionary.store(b"peer-%d" % n, b"v" * 100, expiration_time)
    assert found_through_hivemind(limits, dictionary) == 5
    dictionary.store(b"huge", b"v" * 1001, expiration_time)
    assert found_through_hivemind(limits, dictionary) is None


def found_through_hivemind(limits: RecordLimits, dictionary: DictionaryDHTValue) -> int | None:
    """hivemind's own DHTProtocol.call_find, answered by a stub: how many subkeys the read returned."""

    class Stub:
        async def rpc_find(self, request, timeout=None):
            return dht_pb2.FindResponse(results=[dht_pb2.FindResult(
                type=dht_pb2.FOUND_DICTIONARY, value=MSGPackSerializer.dumps(dictionary),
                expiration_time=dictionary.latest_expiration_time)])

    protocol = DHTProtocol.__new__(DHTProtocol)  # no p2p daemon: the stub answers
    protocol.record_validator = CompositeValidator([limits])
    protocol.node_info = dht_pb2.NodeInfo()
    protocol.wait_timeout = 5.0
    protocol.get_stub = lambda peer: Stub()

    async def find():
        protocol.rpc_semaphore = asyncio.Semaphore(1)
        key_id = DHTID.generate(source=metrics_key(RUN_ID))
        value, _ = (await protocol.call_find(None, [key_id]))[key_id]
        return None if value is None else len(value.value)

    return asyncio.run(find())


def test_it_travels_to_the_dht_process_and_merges_only_with_equal_bounds(clock):
    limits = RecordLimits(RUN_ID)
    limits.validate(record(metrics_key(RUN_ID), b"peer"))
    copy = pickle.loads(pickle.dumps(limits))
    assert len(table(copy, metrics_key(RUN_ID)).subkeys) == 1 and copy.limits == limits.limits
    assert not copy.validate(record(metrics_key(RUN_ID), b"peer", b"x" * 5000))

    merged = CompositeValidator([RecordLimits(RUN_ID), RecordLimits("other-run"), RSASignatureValidator()])
    assert sum(isinstance(v, RecordLimits) for v in merged._validators) == 1
    assert not merged.validate(record(metrics_key("other-run"), b"peer", b"x" * 5000))
    separate = CompositeValidator([RecordLimits(RUN_ID), RecordLimits(RUN_ID, Limits(max_value_bytes=10))])
    assert len(separate._validators) == 2
    assert not separate.validate(record(metrics_key(RUN_ID), b"peer", b"x" * 11)), "the stricter bound applies"
