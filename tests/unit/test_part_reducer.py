"""A group member that vanishes mid-round does not stall the round (geotrain.hive.patches.part_reducer).

hivemind's own TensorPartReducer, as its all-reduce drives it: each sender's handler awaits the part it
contributed to; p2p cancels the handler of a sender whose stream broke (a killed VM). Before the fix, that
cancel cancelled the part for every sender and the next ban raised, and the round hung for the averaging
timeout (seen in the lab's churn soak: 75 s, twice in one soak).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.averaging.partition import TensorPartReducer

from geotrain.hive.patches.part_reducer import install


@pytest.fixture(autouse=True)
def fixed_reducer():
    install()  # as build_hivemind_optimizer does before the averagers fork


def test_a_cancelled_senders_handler_leaves_the_part_to_the_others():
    async def round_with_a_vanished_sender():
        reducer = TensorPartReducer([torch.Size([4]), torch.Size([4])], num_senders=3)
        own = asyncio.create_task(reducer.accumulate_part(2, 0, torch.ones(4)))
        vanished = asyncio.create_task(reducer.accumulate_part(0, 0, torch.full((4,), 3.0)))
        await asyncio.sleep(0.05)
        vanished.cancel()  # its stream broke: hivemind's p2p layer cancels the handler
        await asyncio.sleep(0.05)
        assert not own.done(), "this peer's own part was cancelled with the vanished sender's handler"
        reducer.on_sender_failed(0)  # hivemind's bans: the vanished sender, and one that never started
        reducer.on_sender_failed(1)
        first = await asyncio.wait_for(own, 5)
        second = await asyncio.wait_for(reducer.accumulate_part(2, 1, torch.ones(4)), 5)
        return first, second, reducer.finished.is_set()

    first, second, finished = asyncio.run(round_with_a_vanished_sender())
    assert torch.equal(first, torch.full((4,), 2.0)), "the part the vanished sender sent before is averaged in"
    assert torch.equal(second, torch.ones(4)), "the next part is averaged without the banned senders"
    assert finished


def test_a_finalized_reducer_still_releases_everyone_waiting_on_a_part():
    async def finalized_mid_part():
        reducer = TensorPartReducer([torch.Size([4])], num_senders=2)
        waiting = asyncio.create_task(reducer.accumulate_part(0, 0, torch.ones(4)))
        await asyncio.sleep(0.05)
        reducer.finalize()  # the round was aborted
        await asyncio.sleep(0.05)
        return waiting

    waiting = asyncio.run(finalized_mid_part())
    assert waiting.cancelled()
