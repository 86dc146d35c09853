"""Stopping a peer on SIGINT/SIGTERM: cleanly when possible, within a hard deadline always.

The first signal asks the peer to stop: it finishes its micro-step, says goodbye to the swarm and
shuts hivemind down. If that has not finished ``deadline_s`` after the signal (a peer can be blocked
inside an averaging round), a watchdog stops every child process, p2pd included, and exits.
A second signal does the same at once.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from geotrain.processes import kill_descendants

logger = logging.getLogger(__name__)

STOP_DEADLINE_S = 20.0  # well inside the 30 s a spot VM gets after its soft-off signal (GCE)
EXIT_CODE_FORCED = 143


class StopSignals:
    """Turns SIGINT/SIGTERM into ``self.stop`` (a threading.Event) plus a forced-exit watchdog."""

    def __init__(self, deadline_s: float = STOP_DEADLINE_S):
        self.stop = threading.Event()
        self.deadline_s = deadline_s
        self.signal_time: float | None = None
        self._previous = {}
        self._owner_pid = os.getpid()

    def install(self) -> "StopSignals":
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, _frame) -> None:
        if os.getpid() != self._owner_pid:
            # a process hivemind forked inherited this handler: let the signal do what it normally does
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        name = signal.Signals(signum).name
        if self.stop.is_set():
            logger.warning("%s again: stopping now", name)
            self._force_exit()
        self.signal_time = time.monotonic()
        logger.info("%s received: leaving the swarm (at most %.0f s)", name, self.deadline_s)
        self.stop.set()
        watchdog = threading.Timer(self.deadline_s, self._deadline_passed)
        watchdog.daemon = True
        watchdog.start()

    def _deadline_passed(self) -> None:
        logger.warning("clean shutdown took over %.0f s; stopping hivemind's processes", self.deadline_s)
        self._force_exit()

    @staticmethod
    def _force_exit() -> None:
        kill_descendants(grace_s=2.0)
        logging.shutdown()
        os._exit(EXIT_CODE_FORCED)
