"""Signed, schema-validated metric records in the DHT: how the swarm learns what every trainer does.

Every trainer stores one record under the DHT key ``{run_id}_metrics``, with its RSA public key as
the subkey, every ``metrics.publish_interval_s`` seconds. Every peer's DHT node checks each record it
is asked to store:

- the signature (hivemind's ``RSASignatureValidator``): a record whose subkey names a public key must be
  signed by that key's owner, so no peer can write or overwrite another peer's record;
- the schema (hivemind's ``SchemaValidator`` with :class:`MetricsSchema`): strict types, no negative
  counts, bounded strings and lists; a malformed record is refused.

Records expire after a few publish periods, so a peer that vanished drops out of the swarm view on
its own; a peer that leaves cleanly stores an empty record at once.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import Dict, Optional

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey
from hivemind.utils import get_dht_time
from pydantic.v1 import BaseModel, confloat, conint, conlist, constr

from geotrain.hive.dht.keys import metrics_key, read_subkeys

MAX_COUNT = 2**62  # msgpack and strict ints: anything beyond is not a byte or sample count
MAX_RATE = 1e12
Label = constr(strict=True, min_length=1, max_length=64, regex=r"^[A-Za-z0-9_.:+/-]+$")
Count = conint(strict=True, ge=0, le=MAX_COUNT)
Seconds = confloat(strict=True, ge=0.0, le=MAX_RATE)


class MetricRecord(BaseModel):
    """What one peer reports about itself (cumulative counts since it started).

    Trainers and the coordinator publish records: the coordinator's tell where its address is and what
    its VM and traffic cost; it has no samples.
    """

    peer_id: constr(strict=True, min_length=1, max_length=128)
    role: constr(strict=True, regex=r"^(trainer|coordinator)$")
    region: Label
    cloud: Label
    instance_type: Label
    # how the VM is rented, which picks its price; none only in records of an older geotrain
    purchase: Optional[constr(strict=True, regex=r"^(spot|on-demand)$")] = None
    time: confloat(strict=True, ge=0.0)  # the DHT time at which the record was made
    epoch: Count
    samples_total: Count
    samples_per_second: Seconds  # over its last epoch
    granularity: Optional[Seconds]  # compute over communication time, last epoch; none before the first
    compute_seconds_total: Seconds
    communication_seconds_total: Seconds
    sent_bytes_by_region: Dict[Label, Count]  # destination region -> bytes sent there
    received_bytes_total: Count
    addresses: conlist(constr(strict=True, max_length=64), max_items=16)  # "ip:port" it listens on

    class Config:
        extra = "forbid"


class MetricsSchema(BaseModel):
    """Key ``{run_id}_metrics``: one record per trainer, under a subkey with the owner's public key."""

    metrics: Dict[BytesWithPublicKey, Optional[MetricRecord]]


def record_ttl_s(publish_interval_s: float) -> float:
    """How long a record lives: three missed publications, and never under 30 s."""
    return max(30.0, 3 * publish_interval_s)


def local_public_key() -> bytes:
    """This process's subkey (``[owner:...]``); hivemind signs records stored under it."""
    return RSASignatureValidator().local_public_key


def finite(value: float) -> float:
    return float(value) if math.isfinite(value) and value >= 0 else 0.0


def store_record(dht, run_id: str, record: MetricRecord | None, ttl_s: float):
    """Start storing this peer's record (``None``: it left); a future of whether a DHT node accepted it."""
    value = None if record is None else record.dict()
    return dht.store(metrics_key(run_id), subkey=local_public_key(), value=value,
                     expiration_time=get_dht_time() + ttl_s, return_future=True)


def publish(dht, run_id: str, record: MetricRecord | None, ttl_s: float, timeout_s: float = 10.0) -> bool:
    """Store this peer's record and wait; True when at least one DHT node accepted it."""
    return bool(store_record(dht, run_id, record, ttl_s).result(timeout=timeout_s))


@dataclass
class PeerRecord:
    owner: str  # fingerprint of the signing key: the record's identity (a record can claim any peer_id)
    record: MetricRecord
    expiration_time: float


OWNER_SUBKEY = re.compile(rb"\[owner:[^\]]+\]")  # exactly hivemind's "[owner:KEY]", nothing around it


def owner_fingerprint(subkey: bytes) -> str:
    return hashlib.sha256(subkey).hexdigest()[:16]


def read_records(dht, run_id: str) -> dict[str, PeerRecord]:
    """Owner fingerprint -> that owner's record, from the DHT (validated by the nodes that stored them).

    Records are told apart by the key that signed them, not by the peer id they claim, so a peer
    that claims another's id adds a row of its own and can not replace the other's.
    """
    records: dict[str, PeerRecord] = {}
    for subkey, (value, expiration_time) in read_subkeys(dht, metrics_key(run_id)).items():
        subkey = subkey if isinstance(subkey, bytes) else str(subkey).encode()
        if not OWNER_SUBKEY.fullmatch(subkey):
            continue  # hivemind accepts any subkey that *contains* the signer's key: one key, many rows
        try:
            record = MetricRecord.parse_obj(value)
        except Exception:  # nodes validate on store; a record from an older version is skipped, not fatal
            continue
        owner = owner_fingerprint(subkey)
        records[owner] = PeerRecord(owner, record, expiration_time)
    return records
