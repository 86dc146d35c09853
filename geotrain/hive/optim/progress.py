"""The swarm's progress as this peer counts it: hivemind's tracker without the peers this peer has banned.

A banned peer trains on in a swarm of its own (it is refused by this peer, not stopped): hivemind's tracker would
still count its samples towards this peer's epochs and take its epoch as the swarm's, so a peer that banned the
majority would keep reloading the state to reach an epoch that only banned donors hold, and never step again.
"""

from __future__ import annotations

from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.p2p import PeerID


class GuardedProgressTracker(ProgressTracker):
    """hivemind's progress tracker that leaves out the records of peers in ``bans`` (set once the peer's guard
    exists: hivemind builds the tracker before the averagers)."""

    bans = None  # geotrain.hive.guard.report.SharedBans

    def without_banned(self, metadata):
        """The swarm's progress records (hivemind's subkey -> record) less those of banned peers."""
        bans = self.bans
        if bans is None or not isinstance(metadata, dict):
            return metadata
        return {key: record for key, record in metadata.items() if not _banned(record, bans)}

    def _parse_swarm_progress_data(self, metadata):
        return super()._parse_swarm_progress_data(self.without_banned(metadata))


def _banned(record, bans) -> bool:
    value = getattr(record, "value", None)
    if not isinstance(value, dict) or not isinstance(value.get("peer_id"), bytes):
        return False
    try:
        peer_id = PeerID(value["peer_id"]).to_base58()
    except Exception:  # noqa: BLE001 - hivemind's parsing refuses the record; the filter only removes
        return False
    return bans.is_banned(peer_id)
