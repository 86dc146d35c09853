"""What a peer's processes share about the guard: whom it banned (:class:`SharedBans`), what it refused and
counted, its events, and the state of its downloads (:class:`GuardReport`). All of it lives in shared memory made
before hivemind's averagers fork their processes."""

from __future__ import annotations

import json
import logging
import multiprocessing
import time
from pathlib import Path

from geotrain.hive.state.donors import DownloadProgress, OwnEpoch

logger = logging.getLogger(__name__)

# what the guard counts (Prometheus: geotrain_guard_refusals_total{what,reason}); index into a shared array
COUNTED = (
    ("contribution", "non-finite"), ("contribution", "norm"), ("contribution", "weight"),
    ("join_group", "not admitted"), ("join_group", "banned"), ("aggregate", "not admitted"), ("aggregate", "banned"),
    ("download_state", "not admitted"), ("download_state", "busy"), ("download_state", "non-finite state"),
    ("download_state", "malformed part request"), ("download_state", "own state non-finite"),
    ("step", "non-finite"), ("step", "norm"), ("microstep", "non-finite"),
    ("parameters", "non-finite after step"), ("parameters", "non-finite in loaded state"),
    ("parameters", "non-finite state average"),
    ("pseudo_gradient", "non-finite"), ("pseudo_gradient", "norm"),
)

# the payload of the all-reduce that this peer reduces (Prometheus: geotrain_averaging_payload_bytes_total{direction}):
# summed over the swarm, every byte of every averaging round that crossed between peers, counted once (by its
# reducer); what the compression changes, without the DHT's and the state downloads' traffic
AVERAGING_DIRECTIONS = ("received", "sent")


class SharedBans:
    """Peers this peer has banned, and until when: one list for all of the peer's processes.

    A fixed table in shared memory (made before hivemind's averagers fork): a ban by the gradient averager
    keeps the banned peer out of state downloads and the end-of-run agreement as well.
    """

    SLOTS = 256
    SLOT_BYTES = 64  # base58 peer ids are 46-52 characters

    def __init__(self):
        self._names = multiprocessing.Array("c", self.SLOTS * self.SLOT_BYTES, lock=True)
        self._until = multiprocessing.Array("d", self.SLOTS, lock=False)  # time.time(), guarded by _names' lock

    def _name(self, slot: int) -> str:
        raw = self._names.get_obj()[slot * self.SLOT_BYTES:(slot + 1) * self.SLOT_BYTES]
        return raw.split(b"\0", 1)[0].decode()

    def ban(self, peer_id: str, seconds: float) -> None:
        encoded = peer_id.encode()[:self.SLOT_BYTES]
        with self._names.get_lock():
            now = time.time()
            slots = range(self.SLOTS)
            slot = next((i for i in slots if self._name(i) == peer_id), None)
            if slot is None:  # a free or expired slot, else the one that expires first
                slot = min(slots, key=lambda i: self._until[i] if self._until[i] > now else float("-inf"))
            self._names.get_obj()[slot * self.SLOT_BYTES:(slot + 1) * self.SLOT_BYTES] = \
                encoded.ljust(self.SLOT_BYTES, b"\0")
            self._until[slot] = now + seconds

    def active(self) -> set[str]:
        with self._names.get_lock():
            now = time.time()
            return {self._name(i) for i in range(self.SLOTS) if self._until[i] > now}

    def is_banned(self, peer_id: str) -> bool:
        return peer_id in self.active()


class GuardReport:
    """Where refusals go: the log, the peer's events file and counters shared with the peer's main process;
    and what the peer's processes share: its bans, and the one donor a state download must come from.

    hivemind's averagers run in processes of their own (forked from the peer), so all of it lives in
    shared memory made before they start, and each process appends its own lines to the events file.
    """

    def __init__(self, events_path: Path | None):
        self.events_path = None if events_path is None else Path(events_path)
        self._counts = multiprocessing.Array("q", len(COUNTED), lock=True)
        self.bans = SharedBans()
        self._allowed_donors = multiprocessing.Array("c", self.ALLOWED_DONORS * SharedBans.SLOT_BYTES, lock=True)
        self._last_donor = multiprocessing.Array("c", 2 * SharedBans.SLOT_BYTES + 1, lock=True)
        self.downloads = DownloadProgress()
        self.own_epoch = OwnEpoch()
        self._averaging_bytes = multiprocessing.Array("q", len(AVERAGING_DIRECTIONS), lock=True)

    ALLOWED_DONORS = 64

    def set_allowed_donors(self, peer_ids) -> None:
        """Restrict this peer's state downloads to ``peer_ids`` (None or empty: any donor that is not banned);
        the nearest of them is asked first (geotrain.hive.state.donors)."""
        names = sorted(peer_ids or ())[:self.ALLOWED_DONORS]
        self._allowed_donors.value = " ".join(names).encode()

    def set_only_donor(self, peer_id: str | None) -> None:
        """Restrict this peer's state downloads to ``peer_id`` (None: any donor that is not banned)."""
        self.set_allowed_donors([peer_id] if peer_id else None)

    def allowed_donors(self) -> set[str] | None:
        names = self._allowed_donors.value.decode().split()
        return set(names) if names else None

    def note_donor(self, peer_id: str, region: str | None) -> None:
        self._last_donor.value = f"{peer_id} {region or '-'}".encode()[:len(self._last_donor) - 1]

    def last_donor(self) -> tuple[str | None, str | None]:
        """(peer id, region) of the donor of this peer's last state download; (None, None) before one."""
        peer_id, _, region = self._last_donor.value.decode().partition(" ")
        return (peer_id or None, None if region in ("", "-") else region)

    def count(self, what: str, reason: str) -> None:
        index = COUNTED.index((what, reason))
        with self._counts.get_lock():
            self._counts[index] += 1

    def counts(self) -> dict[tuple[str, str], int]:
        with self._counts.get_lock():
            return {key: int(value) for key, value in zip(COUNTED, self._counts[:])}

    def count_averaging_bytes(self, direction: str, size_bytes: int) -> None:
        """Averaging messages this peer handled as a reducer of an all-reduce: the parts that other peers sent
        it (``received``) and the averages it returned (``sent``)."""
        index = AVERAGING_DIRECTIONS.index(direction)
        with self._averaging_bytes.get_lock():
            self._averaging_bytes[index] += size_bytes

    def averaging_bytes(self) -> dict[str, int]:
        """Bytes of averaging messages by direction, as :meth:`count_averaging_bytes` counted them."""
        with self._averaging_bytes.get_lock():
            return dict(zip(AVERAGING_DIRECTIONS, (int(value) for value in self._averaging_bytes[:])))

    def event(self, event: str, **fields) -> None:
        if self.events_path is None:
            return
        try:
            with open(self.events_path, "a") as handle:  # one write per line: lines of processes never interleave
                handle.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")
        except OSError as error:
            logger.debug("event %s not written: %s", event, error)
