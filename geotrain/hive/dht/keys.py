"""The swarm's DHT keys, and the one way geotrain reads a dictionary record from the DHT.

Every swarm-wide fact lives under a key derived from the run id:

- ``{run_id}_progress``: each trainer's training progress (hivemind's progress tracker; signed);
- ``{run_id}_trainers``: trainers announce themselves here as soon as they join, before their first step;
- ``{run_id}_metrics``: each peer's metric record (:mod:`geotrain.hive.dht.metric_records`; signed);
- ``{run_id}_final``: the end-of-run agreement (:mod:`geotrain.hive.state.finalize`);
- ``{run_id}_state_averager.all_averagers``: state donors and their priorities (hivemind's own).

A dictionary record maps subkeys to values; :func:`read_subkeys` returns the live, non-empty ones.
"""

from __future__ import annotations

from typing import Any

from hivemind.optim.progress_tracker import LocalTrainingProgress
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

PRESENCE_TTL_S = 120.0


def progress_key(run_id: str) -> str:
    """DHT key under which hivemind.Optimizer publishes every peer's training progress."""
    return f"{run_id}_progress"


def trainers_key(run_id: str) -> str:
    """DHT key where trainers announce themselves as soon as they join (before their first step)."""
    return f"{run_id}_trainers"


def metrics_key(run_id: str) -> str:
    return f"{run_id}_metrics"


def final_key(run_id: str) -> str:
    return f"{run_id}_final"


def donors_key(run_id: str) -> str:
    """hivemind's key of the state averagers that share state, each with its priority."""
    return f"{run_id}_state_averager.all_averagers"


def read_subkeys(dht, key: str, timeout_s: float | None = None) -> dict[Any, tuple[Any, float]]:
    """subkey -> (value, expiration time) of a dictionary record; empty values (goodbyes) left out. ``timeout_s``:
    raise TimeoutError after it (a DHT whose process is gone never answers)."""
    if timeout_s is None:
        record = dht.get(key, latest=True)
    else:
        record = dht.get(key, latest=True, return_future=True).result(timeout=timeout_s)
    if record is None or not isinstance(record.value, dict):
        return {}
    return {subkey: (entry.value, entry.expiration_time) for subkey, entry in record.value.items()
            if entry.value is not None}


def announce_trainer(dht, run_id: str, peer_id: str) -> None:
    dht.store(trainers_key(run_id), subkey=peer_id, value=get_dht_time(),
              expiration_time=get_dht_time() + PRESENCE_TTL_S)


def announced_trainers(dht, run_id: str) -> set[str]:
    return {str(subkey) for subkey in read_subkeys(dht, trainers_key(run_id))}


def read_progress(dht, run_id: str, timeout_s: float | None = None) -> dict[str, LocalTrainingProgress]:
    """peer id -> hivemind LocalTrainingProgress, from the signed records every trainer publishes."""
    progress = {}
    for value, _ in read_subkeys(dht, progress_key(run_id), timeout_s).values():
        try:
            parsed = LocalTrainingProgress.parse_obj(value)
        except Exception:  # the schema validator rejects malformed records on store; stay defensive on read
            continue
        progress[str(PeerID(parsed.peer_id))] = parsed
    return progress


def swarm_epoch_and_trainers(dht, run_id: str) -> tuple[int, int]:
    """(global epoch, trainer peers) from the signed progress records in the DHT."""
    progress = read_progress(dht, run_id)
    return max((p.epoch for p in progress.values()), default=0), len(progress)


def best_donor_epoch(dht, run_id: str) -> float:
    """The highest state-sharing priority announced in the swarm (trainers announce their epoch).

    A coordinator holding a checkpoint announces its epoch here too, which is how trainers that start
    after every other trainer left find the state to continue from.
    """
    priorities = [value for value, _ in read_subkeys(dht, donors_key(run_id)).values()
                  if isinstance(value, (int, float))]
    return max(priorities, default=0.0)
