"""Size and rate limits on this run's DHT records, so that a flood grows no memory on any peer.

The signature and schema validators (:mod:`geotrain.hive.dht.metric_records`) make sure nobody writes
another peer's record or a malformed one, but a peer may still write as many well-formed records of
its own as it likes: huge values, one subkey rewritten thousands of times a second, or thousands of
subkeys (one signing key can sign any subkey that contains it, and fresh keys cost milliseconds).
hivemind keeps every accepted subkey until it expires. :class:`RecordLimits` runs in every peer's
DHT node next to the other validators and refuses, under this run's keys
(:func:`limited_keys`: progress, trainers, metrics, final agreement, state donors):

- a value larger than ``max_value_bytes`` (4 KiB; the largest honest record is about 2.3 KB);
- more than ``max_versions_per_s`` versions per second of one (key, subkey), with bursts of
  ``version_burst`` (a token bucket). Every version this node is asked to store takes a token, an old or
  a repeated one too: hivemind keeps the records that readers cache on a node apart from its storage, so
  a version older than the newest one this node has seen can still be stored;
- more than ``max_subkeys_per_key`` subkeys alive under one key, or more than ``max_key_bytes`` in them,
  so that a reader still gets a flooded key's whole dictionary in one DHT response (hivemind's p2p daemon
  caps one at 2 MiB). A subkey's bytes are counted as its value plus twice the subkey (the RSA signature
  that hivemind appends is as long as the public key in the subkey); new subkeys get 7/8 of the bytes, so
  the records already there can still grow when a flood has filled the rest;
- a record that would live longer than ``max_lifetime_s``, so the subkeys of a flood expire and make
  room again.

The bounds sit far above what honest peers write (docs/security.md, "DHT records", gives the measured sizes
and rates).

What this validator remembers is bounded as well: at most ``max_subkeys_per_key`` small entries for
each of the few keys it knows, expired ones dropped when room is needed.

hivemind also validates the records that other nodes return to a read, and a refusal there drops
that node's whole dictionary, honest records included. The counting limits differ from node to node
(each counts what it was sent), so they apply only when this node is asked to store a record; the
node that returns a record applied them when it stored it. The size limit is the same everywhere and
applies to reads too.

Refusals are logged at most once a minute for each key, with the key, the counts and the reasons.

Use: ``hivemind.DHT(record_validators=[..., RecordLimits(run_id)])``; every peer's DHT does so
through :func:`geotrain.hive.dht.node.record_validators`.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import time
from collections import Counter
from dataclasses import dataclass

from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time

from geotrain.hive.dht.admission import members_key
from geotrain.hive.dht.keys import donors_key, final_key, metrics_key, progress_key, trainers_key

logger = logging.getLogger(__name__)

LOG_INTERVAL_S = 60.0
PURGE_INTERVAL_S = 1.0  # a full key looks for expired subkeys at most this often (a scan of up to 4096)
NEW_SUBKEY_SHARE = 7 / 8  # of max_key_bytes; the rest is room for the records already there to grow
_READ_CODE = DHTProtocol.call_find.__code__  # hivemind validates what other nodes return here


def limited_keys(run_id: str) -> list[str]:
    """The DHT keys of run ``run_id`` whose records :class:`RecordLimits` limits."""
    return [progress_key(run_id), trainers_key(run_id), metrics_key(run_id), final_key(run_id), donors_key(run_id),
            members_key(run_id)]


@dataclass(frozen=True)
class Limits:
    """The bounds of :class:`RecordLimits`; the defaults and the honest rates they allow for are in the
    module docstring."""

    max_value_bytes: int = 4096
    max_versions_per_s: float = 100.0
    version_burst: int = 300
    max_subkeys_per_key: int = 4096
    max_key_bytes: int = 1024 * 1024
    max_lifetime_s: float = 3600.0


class _Subkey:
    """What this node remembers of one subkey: when its newest record expires, and its token bucket."""

    __slots__ = ("expiration_time", "size_bytes", "tokens", "refilled_at")

    def __init__(self, expiration_time: float, size_bytes: int, tokens: float, refilled_at: float):
        self.expiration_time = expiration_time
        self.size_bytes = size_bytes
        self.tokens = tokens
        self.refilled_at = refilled_at


class _Key:
    """The live subkeys of one key (by a 16-byte digest, not the subkey itself: public keys are long)."""

    __slots__ = ("name", "subkeys", "total_bytes", "purged_at", "refused", "logged_at")

    def __init__(self, name: str):
        self.name = name
        self.subkeys: dict[bytes, _Subkey] = {}
        self.total_bytes = 0
        self.purged_at = float("-inf")
        self.refused: Counter[str] = Counter()  # reason -> refusals not logged yet
        self.logged_at = float("-inf")


class RecordLimits(RecordValidatorBase):
    """Refuses records of run ``run_id``'s keys that are too large, too frequent, too many or too
    long-lived (see the module docstring); passes every other record untouched."""

    def __init__(self, run_id: str, limits: Limits = Limits()):
        self.limits = limits
        self._keys = {DHTID.generate(source=name).to_bytes(): _Key(name) for name in limited_keys(run_id)}

    @property
    def priority(self) -> int:
        # validated last (hivemind validates by decreasing priority and stops at the first refusal): only
        # records that the signature (10) and schema (0) validators accepted count against a subkey's limits,
        # so a forged record can not spend another peer's budget
        return -10

    def merge_with(self, other: RecordValidatorBase) -> bool:
        """Merges the keys of another :class:`RecordLimits` with the same bounds (one set of counters for
        them, as if one validator knew them all); with other bounds both apply, each to its own keys."""
        if not isinstance(other, RecordLimits) or other.limits != self.limits:
            return False
        for key_id, key in other._keys.items():
            self._keys.setdefault(key_id, _Key(key.name))
        return True

    def validate(self, record: DHTRecord) -> bool:
        key = self._keys.get(record.key)
        if key is None:
            return True
        limits = self.limits
        if len(record.value) > limits.max_value_bytes:
            return self._refuse(key, f"values over {limits.max_value_bytes} bytes")
        if _validating_a_read():
            return True
        now = get_dht_time()
        if record.expiration_time > now + limits.max_lifetime_s:
            return self._refuse(key, f"records living over {limits.max_lifetime_s:.0f} s")

        digest = hashlib.blake2b(record.subkey, digest_size=16).digest()
        size_bytes = len(record.value) + 2 * len(record.subkey)
        subkey = key.subkeys.get(digest)
        if subkey is None:
            if not self._has_room(key, size_bytes, now):
                return self._refuse(key, "records that do not fit in the key")
            key.subkeys[digest] = _Subkey(record.expiration_time, size_bytes, limits.version_burst - 1,
                                          time.monotonic())
            key.total_bytes += size_bytes
            return True
        newer = record.expiration_time > subkey.expiration_time
        if newer and key.total_bytes - subkey.size_bytes + size_bytes > limits.max_key_bytes:
            return self._refuse(key, "records that do not fit in the key")
        if not self._take_token(subkey):
            return self._refuse(key, f"versions over {limits.max_versions_per_s:g}/s of one subkey")
        if not newer:
            return True  # a version it has seen or an older one: the subkey's newest bytes stay what they were
        key.total_bytes += size_bytes - subkey.size_bytes
        subkey.size_bytes = size_bytes
        subkey.expiration_time = record.expiration_time
        return True

    def _has_room(self, key: _Key, size_bytes: int, now: float) -> bool:
        limits = self.limits

        def room() -> bool:
            return (len(key.subkeys) < limits.max_subkeys_per_key
                    and key.total_bytes + size_bytes <= limits.max_key_bytes * NEW_SUBKEY_SHARE)

        if room():
            return True
        if time.monotonic() - key.purged_at < PURGE_INTERVAL_S:
            return False
        key.purged_at = time.monotonic()
        for digest, subkey in list(key.subkeys.items()):
            if subkey.expiration_time <= now:
                key.total_bytes -= subkey.size_bytes
                del key.subkeys[digest]
        return room()

    def _take_token(self, subkey: _Subkey) -> bool:
        now = time.monotonic()
        subkey.tokens = min(float(self.limits.version_burst),
                            subkey.tokens + (now - subkey.refilled_at) * self.limits.max_versions_per_s)
        subkey.refilled_at = now
        if subkey.tokens < 1.0:
            return False
        subkey.tokens -= 1.0
        return True

    @staticmethod
    def _refuse(key: _Key, reason: str) -> bool:
        # reasons are a few fixed strings, so the counter stays small however many records are refused
        key.refused[reason] += 1
        now = time.monotonic()
        if now - key.logged_at >= LOG_INTERVAL_S:
            reasons = ", ".join(f"{count} {why}" for why, count in key.refused.most_common())
            logger.warning("refused under DHT key %s since the last report: %s (it holds %d subkeys, %d bytes)",
                           key.name, reasons, len(key.subkeys), key.total_bytes)
            key.refused.clear()
            key.logged_at = now
        return False


def _validating_a_read() -> bool:
    """Whether hivemind is validating a record that another node returned to a read (``call_find``), not one
    it was asked to store. validate() is not told which, so look for that frame a few calls up."""
    frame = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            return False
        if frame.f_code is _READ_CODE:
            return True
        frame = frame.f_back
    return False
