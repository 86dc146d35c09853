"""A hostile peer, for tests: joins a swarm and tries to forge, overwrite and poison metric records.

    python metric_attacker.py RUN_ID VICTIM_PEER_ID INITIAL_PEER...

Prints one JSON object: for each attack, whether any honest DHT node accepted it.
"""

from __future__ import annotations

import json
import sys
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

    from geotrain.hive.metric_records import local_public_key, metrics_key
    from geotrain.hive.dht import record_validators

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


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
