"""hivemind's averager keeps its running tasks alive until they end.

An asyncio event loop holds its tasks by weak reference only. hivemind 1.1.12's averager process starts each request
from the peer (a gradient round's ``_step``, a state download, ...) with ``asyncio.create_task`` and keeps no
reference to the task; ``_step`` in turn waits on tasks and futures that only it refers to. When the garbage
collector runs at the wrong moment, such a cycle is collected while it is still pending: the log says ``Task was
destroyed but it is pending!`` for ``DecentralizedAverager._step``, that round never ends, and the averager is
wedged (no group forms, state downloads stall). Python's documentation asks callers of ``create_task`` to keep a
reference; :func:`install` gives the averager's event loop a task factory that does, until each task is done.
"""

from __future__ import annotations

import asyncio

import hivemind.averaging.averager as averager_module

_original_switch_to_uvloop = averager_module.switch_to_uvloop


class TaskReferences:
    """A task factory that holds every task it makes until the task is done."""

    def __init__(self):
        self.pending: set[asyncio.Task] = set()

    def __call__(self, loop: asyncio.AbstractEventLoop, coro, context=None) -> asyncio.Task:
        task = asyncio.Task(coro, loop=loop, context=context)
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)
        return task


def loop_that_keeps_its_tasks() -> asyncio.AbstractEventLoop:
    """hivemind's new event loop (uvloop), with a :class:`TaskReferences` task factory."""
    loop = _original_switch_to_uvloop()
    loop.set_task_factory(TaskReferences())
    return loop


def install() -> None:
    """Give the event loop of every averager this process starts from now on (they fork) a task factory that
    keeps its tasks."""
    averager_module.switch_to_uvloop = loop_that_keeps_its_tasks
