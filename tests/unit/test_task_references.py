"""The averager's event loop keeps its running tasks (geotrain.hive.patches.task_references).

hivemind's averager starts each request as a task it keeps no reference to, and a task waiting on futures that
only it refers to is garbage: here, a collection destroys such a task in hivemind's own loop and not in the
installed one.
"""

from __future__ import annotations

import asyncio
import gc
import threading

import hivemind.averaging.averager as averager_module

from geotrain.hive.patches import task_references


def tasks_left_after_a_collection(make_loop) -> int:
    """A task that waits on a future only it refers to, started without keeping a reference (as hivemind's
    averager does), then a garbage collection: how many such tasks the loop still has."""
    left = []

    def run() -> None:
        loop = make_loop()

        async def main() -> None:
            async def waits_on_its_own_future() -> None:
                await asyncio.get_running_loop().create_future()

            asyncio.create_task(waits_on_its_own_future())
            await asyncio.sleep(0.05)
            gc.collect()
            others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            left.append(len(others))
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        loop.set_exception_handler(lambda *_: None)  # (hivemind's loop logs the destroyed task)
        loop.run_until_complete(main())
        loop.close()

    thread = threading.Thread(target=run)  # hivemind's averager runs its loop in a thread of its own too
    thread.start()
    thread.join(timeout=30)
    return left[0]


def test_a_collection_destroys_a_pending_task_in_hiveminds_loop_and_not_in_the_installed_one():
    assert tasks_left_after_a_collection(task_references._original_switch_to_uvloop) == 0
    assert tasks_left_after_a_collection(task_references.loop_that_keeps_its_tasks) == 1


def test_install_gives_the_averagers_that_fork_later_the_loop_that_keeps_its_tasks(monkeypatch):
    monkeypatch.setattr(averager_module, "switch_to_uvloop", task_references._original_switch_to_uvloop)
    task_references.install()
    assert averager_module.switch_to_uvloop is task_references.loop_that_keeps_its_tasks
