"""A hostile peer, for tests: joins a swarm and tries to forge, overwrite, poison and flood metric records.

    python metric_attacker.py RUN_ID VICTIM_PEER_ID INITIAL_PEER...
    python metric_attacker.py flood RUN_ID FRESH_SUBKEYS REWRITES INITIAL_PEER...

The first prints one JSON object: for each attack, whether any honest DHT node accepted it. The flood
sends every DHT node it knows, properly signed and schema-valid, one oversized record, REWRITES versions
of one subkey in a single request and FRESH_SUBKEYS subkeys of its own (one signing key signs any
subkey that contains it), then reads back what each node holds. It prints, per node: how many of each
it accepted, and the subkeys and bytes it then holds under the metric key (honest ones apart).
"""

from __future__ import annotations

import json
import sys
import time
from functools import partial

FORGED_SAMPLES_PER_SECOND = 1.0e9


async def send_forged(key, subkey, forged: dict, expiration: float, _dht, node) -> list[bool]:
    """Store ``forged`` with a bogus signature on every DHT node in our routing table; True where accepted."""
    from hivemind.dht.routing import DHTID
    from hivemind.utils import MSGPackSerializer

    value = MSGPackSerializer.dumps(forged) + b"[signature:" + b"A" * 256 + b"]"
    answers = []
    for peer_id in list(node.protocol.routing_table.peer_id_to_uid):
        answer = await node.protocol.call_store(peer_id, keys=[DHTID.generate(source=key)], values=[value],
                                                expiration_time=[expiration], subkeys=[subkey])
        answers.append(bool(answer and answer[0]))
    return answers


def main(run_id: str, victim_peer_id: str, initial_peers: list[str]) -> None:
    import hivemind
    from hivemind.utils import get_dht_time

    from geotrain.hive.dht.metric_records import local_public_key, metrics_key
    from geotrain.hive.dht.node import record_validators

    key = metrics_key(run_id)
    dht = hivemind.DHT(initial_peers=initial_peers, client_mode=True, start=True,
                       record_validators=record_validators(run_id))
    entry = dht.get(key, latest=True)
    victim = [(subkey, item.value) for subkey, item in entry.value.items()
              if isinstance(item.value, dict) and item.value.get("peer_id") == victim_peer_id]
    assert victim, f"no record of {victim_peer_id} to attack"
    victim_subkey, victim_record = victim[0]
    forged = {**victim_record, "samples_per_second": FORGED_SAMPLES_PER_SECOND, "time": float(get_dht_time())}
    expiration = get_dht_time() + 60

    # 1. overwrite the victim's record under its subkey; our node can not sign for the victim's key
    overwrite = dht.store(key, subkey=victim_subkey, value=forged, expiration_time=expiration)

    # 2. the same with a made-up signature, sent straight to every node we know
    forged_signature = dht.run_coroutine(partial(send_forged, key, victim_subkey, forged, expiration))

    # 3. a record of our own, properly signed, that breaks the schema
    malformed = dht.store(key, subkey=local_public_key(),
                          value={"peer_id": "poison", "samples_per_second": "fast", "epoch": -1},
                          expiration_time=expiration)
    dht.shutdown()
    print(json.dumps({"overwrite_accepted": bool(overwrite), "forged_signature_accepted": forged_signature,
                      "malformed_accepted": bool(malformed)}), flush=True)


def flood_record(number: int, regions: int = 1) -> dict:
    """A schema-valid metric record; ``regions`` destination regions make it as large as wanted."""
    from hivemind.utils import get_dht_time

    return {"peer_id": f"flood-{number}", "role": "trainer", "region": "flood", "cloud": "flood",
            "instance_type": "flood", "purchase": "spot", "time": float(get_dht_time()), "epoch": 0,
            "samples_total": 0, "samples_per_second": 0.0, "granularity": None, "compute_seconds_total": 0.0,
            "communication_seconds_total": 0.0,
            "sent_bytes_by_region": {f"region-{n:04d}": 1 for n in range(regions)},
            "received_bytes_total": 0, "addresses": []}


def signed(key: str, records: list[tuple[bytes, dict, float]]) -> list[tuple[bytes, bytes, float]]:
    """(subkey, value bytes with this process's signature, expiration), as hivemind's DHT would store them."""
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer

    signer = RSASignatureValidator()
    key_bytes = DHTID.generate(source=key).to_bytes()
    return [(subkey, signer.sign_value(DHTRecord(key_bytes, MSGPackSerializer.dumps(subkey),
                                                 MSGPackSerializer.dumps(value), expiration)), expiration)
            for subkey, value, expiration in records]


def flood_records(kind: str, count: int, own_key: bytes, now: float) -> list[tuple[bytes, dict, float]]:
    if kind == "oversized":
        return [(own_key + b"#oversized", flood_record(-1, regions=500), now + 40)]
    if kind == "rewrites":  # one subkey, each version a little later than the last
        return [(own_key, flood_record(-2), now + 30 + n / 1000) for n in range(count)]
    # about 2.4 KB each (under the size bound), so that a few hundred fill a key's bytes
    return [(own_key + b"#%d" % n, flood_record(n, regions=160), now + 40) for n in range(count)]


async def store_everywhere(key, kind, count, own_key, now, _dht, node) -> dict[str, dict]:
    """Sign the records of ``kind`` here, in the DHT process (hivemind's pipe to it chokes on megabytes), and
    send them to every DHT node in our routing table; node -> how many it accepted, in how long.
    Rewrites go in one request, so that the node gets them faster than any token bucket refills."""
    from hivemind.dht.routing import DHTID

    records = signed(key, flood_records(kind, count, own_key, now))
    batch = len(records) if kind == "rewrites" else 100
    key_id = DHTID.generate(source=key)
    outcome = {"value_bytes": len(records[0][1])}
    for peer_id in list(node.protocol.routing_table.peer_id_to_uid):
        accepted, started = 0, time.monotonic()
        for start in range(0, len(records), batch):
            subkeys, values, expirations = zip(*records[start:start + batch])
            for _attempt in range(3):  # a node busy averaging may drop a request
                answer = await node.protocol.call_store(peer_id, keys=[key_id] * len(subkeys), values=list(values),
                                                        expiration_time=list(expirations), subkeys=list(subkeys))
                if answer is not None:
                    break
            accepted += sum(bool(ok) for ok in answer or [])
        outcome[str(peer_id)] = {"accepted": accepted, "seconds": time.monotonic() - started}
    return outcome


async def held_everywhere(key, own_key: bytes, _dht, node) -> dict[str, dict]:
    """What each DHT node returns for ``key``: its subkeys and bytes, and how many are not ours."""
    from hivemind.dht.routing import DHTID

    key_id = DHTID.generate(source=key)
    held = {}
    for peer_id in list(node.protocol.routing_table.peer_id_to_uid):
        answer = await node.protocol.call_find(peer_id, [key_id])
        value = None if answer is None else answer[key_id][0]
        if value is None:
            held[str(peer_id)] = None  # no answer, or a dictionary too large for one response
            continue
        entries = list(value.value.items())
        held[str(peer_id)] = {"subkeys": len(entries),
                              "bytes": sum(len(subkey) + len(item.value) for subkey, item in entries),
                              "honest": sum(own_key not in subkey for subkey, _ in entries)}
    return held


def flood(run_id: str, fresh_subkeys: int, rewrites: int, initial_peers: list[str]) -> None:
    import hivemind
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.schema import SchemaValidator
    from hivemind.utils import get_dht_time

    from geotrain.hive.dht.metric_records import MetricsSchema, local_public_key, metrics_key

    key, own_key = metrics_key(run_id), local_public_key()
    # an attacker's own node needs no limits; it validates what it reads like any node
    dht = hivemind.DHT(initial_peers=initial_peers, client_mode=True, start=True, wait_timeout=30,
                       record_validators=[SchemaValidator(MetricsSchema, prefix=run_id), RSASignatureValidator()])
    dht.get(key, latest=True)  # meets the nodes that hold the key
    now = get_dht_time()
    outcome = {kind: dht.run_coroutine(partial(store_everywhere, key, kind, count, own_key, now))
               for kind, count in (("oversized", 1), ("rewrites", rewrites), ("fresh", fresh_subkeys))}
    outcome = {"oversized_bytes": outcome["oversized"].pop("value_bytes"),
               **{kind: {node: result for node, result in nodes.items() if node != "value_bytes"}
                  for kind, nodes in outcome.items()},
               "held": dht.run_coroutine(partial(held_everywhere, key, own_key))}
    dht.shutdown()
    print(json.dumps(outcome), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "flood":
        flood(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:])
    else:
        main(sys.argv[1], sys.argv[2], sys.argv[3:])
