"""An outsider, for tests: knows a private swarm's run id and a peer's address, not the swarm's token.

    python outsider.py RUN_ID PEER_MULTIADDR

It connects to the peer with libp2p (which needs no token) and calls what a swarm member would: join
an averaging group, download the state, store and read DHT records. Prints one JSON object: what each
attempt got.
"""

from __future__ import annotations

import asyncio
import json
import sys


async def attempt(run_id: str, address: str) -> dict:
    from hivemind.dht.protocol import DHTProtocol
    from hivemind.dht.routing import DHTID
    from hivemind.optim.grad_averager import GradientAverager
    from hivemind.optim.state_averager import TrainingStateAverager
    from hivemind.p2p import P2P, PeerID
    from hivemind.proto import averaging_pb2, dht_pb2
    from hivemind.utils import MSGPackSerializer, get_dht_time

    p2p = await P2P.create(initial_peers=[address])
    peer = PeerID.from_base58(address.rsplit("/p2p/", 1)[1])
    found: dict = {"outsider": p2p.peer_id.to_base58()}

    stub = GradientAverager.get_stub(p2p, peer, namespace=f"{run_id}_grad_averager")
    try:
        stream = await stub.rpc_join_group(averaging_pb2.JoinRequest(
            schema_hash=b"\0" * 20, expiration=get_dht_time() + 30, group_key=f"{run_id}_grad_averager.0b"))
        async for message in stream:
            found["join_group"] = averaging_pb2.MessageCode.Name(message.code)
            break
    except Exception as error:
        found["join_group"] = f"error: {error!r}"

    stub = TrainingStateAverager.get_stub(p2p, peer, namespace=f"{run_id}_state_averager")
    found["download_state_messages"] = 0
    try:
        async for _ in await stub.rpc_download_state(averaging_pb2.DownloadRequest()):
            found["download_state_messages"] += 1
    except Exception as error:
        found["download_state_error"] = repr(error)

    dht_stub = super(DHTProtocol, DHTProtocol).get_stub(p2p, peer)  # no authorizer: what an outsider can do
    key = DHTID.generate(source=f"{run_id}_outsider").to_bytes()
    try:
        answer = await dht_stub.rpc_store(dht_pb2.StoreRequest(
            keys=[key], subkeys=[MSGPackSerializer.dumps(None)], values=[MSGPackSerializer.dumps("outsider")],
            expiration_time=[get_dht_time() + 60], in_cache=[False], peer=dht_pb2.NodeInfo()))
        found["store"] = list(answer.store_ok)
    except Exception as error:
        found["store"] = f"error: {error!r}"
    try:
        answer = await dht_stub.rpc_find(dht_pb2.FindRequest(keys=[key], peer=dht_pb2.NodeInfo()))
        found["find"] = [result.type for result in answer.results]
    except Exception as error:
        found["find"] = f"error: {error!r}"

    await p2p.shutdown()
    return found


if __name__ == "__main__":
    print(json.dumps(asyncio.run(attempt(sys.argv[1], sys.argv[2]))))
