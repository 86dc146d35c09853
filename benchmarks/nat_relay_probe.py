"""Can a trainer nobody can dial be reached through a circuit relay at the coordinator? A probe on loopback.

    .venv/bin/python benchmarks/nat_relay_probe.py              # about 2 min
    .venv/bin/python benchmarks/nat_relay_probe.py --wait 200

hivemind offers two ways for a peer behind NAT: client mode (dial out only; geotrain's choice, see
docs/deployment.md, behind NAT) and a libp2p circuit relay (``use_auto_relay=True``: the peer reserves a slot at
a relay, by default its initial peers, and announces ``/p2p/RELAY/p2p-circuit`` addresses through it). This
probe starts a bootstrap DHT node (a coordinator: hivemind's p2pd serves as a relay by default) and a second node
that asks for a relay the way hivemind lets it (auto relay, reachability forced private, the bootstrap node as its
trusted relay), and records, for ``--wait`` seconds, whether the relay reserved a slot for it (from p2pd's debug
log) and whether it announces a circuit address. A second variant turns p2pd's relay discovery off
(``-relayDiscovery=0``, which hivemind 1.1.12 does not expose; set here through its private daemon-argument
table, for this probe only), so that the trusted relay is used at once.

Writes ``benchmarks/results/nat_relay_probe.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "nat_relay_probe.json"
# p2pd logs through hivemind's logger; these modules say when a relay reserves a slot
os.environ["GOLOG_LOG_LEVEL"] = "autorelay=debug,relay=debug"
os.environ["HIVEMIND_LOGLEVEL"] = "DEBUG"


def reservation_after_s(log: Path, peer_id: str, started: float) -> float | None:
    """Seconds from ``started`` to the relay's "reserving relay slot for PEER_ID" in p2pd's log (its daemons log
    from the DHT nodes' own processes, to the stderr they inherit), None if it never reserved one."""
    for line in log.read_text(errors="replace").splitlines():
        if f"reserving relay slot for {peer_id}" in line:
            clock = time.strptime(line.split()[2].split(".")[0], "%H:%M:%S")
            at = time.mktime(time.localtime(started)[:3] + clock[3:6] + time.localtime(started)[6:])
            return round(at + float("0." + line.split()[2].split(".")[1]) - started, 1)
    return None


def probe(variant: str, wait_s: float, log: Path) -> dict:
    import hivemind
    from hivemind.p2p import P2P

    original = P2P.FORCE_REACHABILITY_MAPPING
    if variant == "relay discovery off":
        P2P.FORCE_REACHABILITY_MAPPING = {**original, "private": {**original["private"], "relayDiscovery": 0}}
    relay = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    relay_addresses = [str(a) for a in relay.get_visible_maddrs()]
    started = time.time()
    relayed = hivemind.DHT(initial_peers=relay_addresses, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True,
                           use_auto_relay=True, force_reachability="private", trusted_relays=relay_addresses)
    P2P.FORCE_REACHABILITY_MAPPING = original
    peer_id = str(relayed.peer_id)
    circuit, circuit_after_s = [], None
    try:
        while time.time() - started < wait_s:
            circuit = [str(a) for a in relayed.get_visible_maddrs(latest=True) if "/p2p-circuit" in str(a)]
            if circuit:
                circuit_after_s = time.time() - started
                break
            time.sleep(1.0)
        announced = [str(a) for a in relayed.get_visible_maddrs(latest=True)]
    finally:
        relayed.shutdown()
        relay.shutdown()
    return {"variant": variant, "relay_addresses": relay_addresses, "waited_s": round(time.time() - started, 1),
            "reservation_after_s": reservation_after_s(log, peer_id, started),
            "circuit_address_after_s": None if circuit_after_s is None else round(circuit_after_s, 1),
            "announced_addresses": announced}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wait", type=float, default=60.0, help="seconds to wait for a circuit address")
    parser.add_argument("--json", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="geotrain-relay-probe-") as directory:
        for variant in ("hivemind's options", "relay discovery off"):
            log = Path(directory) / f"{len(results)}.log"
            saved_stderr = os.dup(2)
            with open(log, "w") as out:
                os.dup2(out.fileno(), 2)  # the DHT processes and their p2pd inherit it
            try:
                results.append(probe(variant, args.wait, log))
            finally:
                os.dup2(saved_stderr, 2)
                os.close(saved_stderr)
    for result in results:
        print(f"{result['variant']}: reservation after {result['reservation_after_s']} s, circuit address after "
              f"{result['circuit_address_after_s']} s (waited {result['waited_s']} s)", flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"probes": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
