"""A peer's machine-readable log: one JSON object per line, one line per state change.

The trainer writes it when given ``--events PATH``; ``geotrain local`` reads the files of its peers
for live progress and the summary. Lines are flushed one by one, so a reader sees whole lines
except possibly a last, unfinished one, which :func:`read_events` ignores.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from geotrain.errors import UserError


class EventLog:
    def __init__(self, path: Path | None):
        self._handle = None
        if path is not None:
            try:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                self._handle = open(path, "a", buffering=1)
            except OSError as error:
                raise UserError(f"cannot write the events file {path}: {error.strerror}; "
                                "give a writable path with --events") from None

    def write(self, event: str, **fields: Any) -> None:
        if self._handle is None:
            return
        self._handle.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")
        self._handle.flush()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


def read_events(path: Path) -> list[dict[str, Any]]:
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    events = []
    for line in text.splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line still being written
    return events
