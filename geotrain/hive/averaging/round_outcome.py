"""How an averaging round (a hivemind StepControl) ended: ok, timeout or failed, and why."""

from __future__ import annotations


def round_error(control) -> str:
    if not control.done():
        return "no result within the averaging timeout"
    if control.cancelled():
        return "cancelled"
    return repr(control.exception())


def averaging_round_result(control) -> str:
    """ok, timeout or failed: how one averaging round ended."""
    if not control.done():
        return "timeout"  # hivemind stopped waiting for it (averaging_timeout)
    if control.cancelled():
        return "failed"
    error = control.exception()
    if error is None:
        return "ok"
    return "timeout" if isinstance(error, TimeoutError) else "failed"
