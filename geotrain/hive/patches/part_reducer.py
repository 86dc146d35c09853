"""hivemind's all-reduce, made to survive a group member that vanishes in the middle of a round.

hivemind 1.1.12's ``TensorPartReducer`` gives every sender of a part one shared future and each sender's
handler awaits it directly. When a sender's stream breaks (its VM was killed, its process left), hivemind's
p2p layer cancels that handler, and cancelling a task that awaits a future cancels the future itself: the
part is lost for every sender, this peer's own reduction of it included, and the next ban of a missing sender
raises ``InvalidStateError`` in hivemind's ban loop, so the remaining missing senders are never banned. The
round then hangs until the all-reduce timeout (the averaging timeout: 600 s in the ``intercontinental``
profile) with "Reducer: received 25.0% of input tensors", and the survivors fall an epoch behind.

:func:`install` makes each awaiter wait on a shield of the shared future: a cancelled handler stops waiting,
the part goes on for the others, and hivemind's own ``cancel()`` of the future (when the reducer is finalized)
still reaches every awaiter.
"""

from __future__ import annotations

import asyncio

from hivemind.averaging.partition import TensorPartReducer


class SharedPartFuture(asyncio.Future):
    """A future that many tasks await: cancelling one of them does not cancel it for the others."""

    def __await__(self):
        if self.done():  # (shield returns a done future itself)
            return super().__await__()
        return asyncio.shield(self).__await__()

    __iter__ = __await__


def _reset_accumulators_with_a_shared_future(self: TensorPartReducer) -> None:
    _original_reset_accumulators(self)
    future = self.current_part_future
    if not future.done() and not isinstance(future, SharedPartFuture):  # (a new part: no one awaits it yet)
        self.current_part_future = SharedPartFuture()


_original_reset_accumulators = TensorPartReducer.reset_accumulators


def install() -> None:
    """Give hivemind's part reducers :class:`SharedPartFuture`, in this process and those it forks."""
    TensorPartReducer.reset_accumulators = _reset_accumulators_with_a_shared_future
