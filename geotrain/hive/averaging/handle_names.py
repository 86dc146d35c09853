"""The names under which geotrain's averagers answer hivemind's calls."""

from __future__ import annotations


def hivemind_handle_name(cls, namespace, method_name: str) -> str:
    """hivemind names a peer's handlers after its averager class; geotrain's classes answer under the name of
    the hivemind class they extend, so that they speak hivemind's protocol whatever they add (and tests'
    hostile peers, built on hivemind's classes, reach them as a real attacker's would)."""
    hivemind_class = next(c for c in cls.__mro__ if c.__module__.startswith("hivemind."))
    handle_name = f"{hivemind_class.__name__}.{method_name}"
    return handle_name if namespace is None else f"{namespace}::{handle_name}"
