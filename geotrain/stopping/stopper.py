"""Stopping a peer: on SIGINT/SIGTERM or a preemption notice, cleanly when possible, within a deadline always.

A stop request asks the peer to finish its micro-step, say goodbye to the swarm and shut hivemind down.
If that has not finished ``deadline_s`` after the request (a peer can be blocked inside an averaging
round), a watchdog stops every child process, p2pd included, and exits. A second signal does the same
at once.
"""

from __future__ import annotations

import ctypes
import logging
import faulthandler
import os
import signal
import threading
import time

from geotrain.stopping.processes import kill_descendants, remember_descendants

logger = logging.getLogger(__name__)

STOP_DEADLINE_S = 20.0  # well inside the 30 s a spot VM gets after its soft-off signal (GCE)
EXIT_CODE_FORCED = 143


_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In every process forked from a peer: get SIGTERM when the peer dies, even by SIGKILL.

    Without it, a peer killed hard (OOM killer, ``kill -9``) leaves its DHT node and p2pd running.
    """
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class Stopper:
    """``self.stop`` (a threading.Event) is set by SIGINT/SIGTERM or :meth:`request_stop`."""

    def __init__(self, deadline_s: float = STOP_DEADLINE_S):
        self.stop = threading.Event()
        self.deadline_s = deadline_s
        self.requested_monotonic_s: float | None = None
        self.deadline_monotonic_s: float | None = None
        self.reason: str | None = None
        self.exit_code: int | None = None  # set by a request that wants a particular code
        self._owner_pid = os.getpid()
        self._lock = threading.Lock()
        self._handlers_installed = False
        self._on_stop: list = []

    def install_signal_handlers(self) -> "Stopper":
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._handle_signal)
        self._handlers_installed = True
        os.register_at_fork(after_in_child=die_with_parent)
        return self

    def reclaim_signals(self) -> None:
        """Take SIGINT and SIGTERM back after hivemind's averagers started.

        ``DecentralizedAverager.run_in_background`` sets SIGINT to SIG_IGN in the process that starts an
        averager (so that its forked child ignores Ctrl-C), which left a peer deaf to Ctrl-C once its
        optimizer existed. The children keep ignoring it; they stop with their parent (die_with_parent).
        """
        remember_descendants()  # hivemind's processes: what they share is removed on the way out
        if not self._handlers_installed:
            return
        for signum in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(signum) != self._handle_signal:
                signal.signal(signum, self._handle_signal)

    def _handle_signal(self, signum: int, _frame) -> None:
        if os.getpid() != self._owner_pid:
            # A process hivemind forked (DHT node, averager) inherited this handler. It is being stopped,
            # typically because its parent died (see die_with_parent): take its own children, such as
            # p2pd, down with it, then let the signal do what it normally does.
            kill_descendants(grace_s=1.0)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        name = signal.Signals(signum).name
        if self.stop.is_set():
            logger.warning("%s again: stopping now", name)
            self._force_exit()
        self.request_stop(f"{name} received", self.deadline_s)

    def on_stop(self, callback) -> None:
        """Call ``callback()`` as soon as a stop is requested (at once if one was), in a thread of its own:
        for what must not wait until the training loop notices, such as leaving matchmaking."""
        with self._lock:
            self._on_stop.append(callback)
            requested = self.stop.is_set()
        if requested:
            self._run_callbacks([callback])

    def request_stop(self, reason: str, deadline_s: float, exit_code: int | None = None) -> None:
        with self._lock:
            if self.stop.is_set():
                return
            self.requested_monotonic_s = time.monotonic()
            self.deadline_monotonic_s = self.requested_monotonic_s + deadline_s
            self.reason = reason
            self.exit_code = exit_code
            logger.info("%s: leaving the swarm (at most %.0f s)", reason, deadline_s)
            remember_descendants()
            self.stop.set()
            callbacks = list(self._on_stop)
        watchdog = threading.Timer(deadline_s, self._deadline_passed, args=(deadline_s,))
        watchdog.daemon = True
        watchdog.start()
        self._run_callbacks(callbacks)

    @staticmethod
    def _run_callbacks(callbacks) -> None:
        def run() -> None:
            for callback in callbacks:
                try:
                    callback()
                except Exception as error:  # leaving anyway: the training loop stops at its next micro-step
                    logger.warning("while stopping: %s", error)

        if callbacks:
            threading.Thread(target=run, name="on-stop", daemon=True).start()

    def seconds_left(self, default_s: float) -> float:
        """Time left before the watchdog fires, or ``default_s`` when no stop was requested."""
        if self.deadline_monotonic_s is None:
            return default_s
        return self.deadline_monotonic_s - time.monotonic()

    def seconds_since_request(self) -> float | None:
        if self.requested_monotonic_s is None:
            return None
        return time.monotonic() - self.requested_monotonic_s

    def _deadline_passed(self, deadline_s: float) -> None:
        logger.warning("clean shutdown took over %.0f s; stopping hivemind's processes (where each thread "
                       "was stuck follows)", deadline_s)
        faulthandler.dump_traceback(all_threads=True)  # to stderr: what to report if this happens again
        self._force_exit()

    def _force_exit(self) -> None:
        kill_descendants(grace_s=2.0, final=True)
        logging.shutdown()
        os._exit(self.exit_code if self.exit_code is not None else EXIT_CODE_FORCED)
