"""A trainer that starts next to its coordinator reads the coordinator's addresses from a file.

``geotrain coordinator --initial-peers-file FILE`` writes its join addresses there once it listens (whole, by a
rename). ``geotrain peer --initial-peers-file FILE`` waits for that file, so that both can be started at once:
the trainer builds its model and loads torch while the coordinator starts, instead of after it. The docker
entrypoint's ``GEOTRAIN_INITIAL_PEERS_FILE`` does the same for containers.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from geotrain.hive.dht.multiaddrs import multiaddr_problem
from geotrain.errors import StopRequested, SwarmUnreachableError, UserError
from geotrain.text_files import read_user_text

POLL_S = 0.1


def wait_for_initial_peers(path: Path, timeout_s: float, stop: threading.Event | None = None) -> list[str]:
    """The addresses in ``path`` (whitespace-separated), once it exists and holds one; waits up to ``timeout_s``.

    Raises :class:`SwarmUnreachableError` when no address came in time (exit 3), :class:`UserError` for a file
    that holds something other than addresses (exit 2), :class:`StopRequested` as soon as ``stop`` is set.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if stop is not None and stop.is_set():
            raise StopRequested("a stop was requested while waiting for the initial peers file")
        text = read_user_text(path, "--initial-peers-file") if path.is_file() else ""
        addresses = text.split()
        if addresses:
            for address in addresses:
                problem = multiaddr_problem(address)
                if problem is not None:
                    raise UserError(f"--initial-peers-file {path}: {address!r} is not a peer's address ({problem}); "
                                    "the file should hold what `geotrain coordinator --initial-peers-file` writes")
            return addresses
        if time.monotonic() >= deadline:
            raise SwarmUnreachableError(
                f"--initial-peers-file {path}: no address there after {timeout_s:.0f} s; start the coordinator "
                f"with --initial-peers-file {path}, or wait longer with --bootstrap-timeout")
        time.sleep(POLL_S)
