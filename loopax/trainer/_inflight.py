"""A cheap bound on the number of dispatched steps that have not finished."""

from __future__ import annotations

import collections

import jax

DEFAULT_LIMIT = 4


class InFlight:
    """Keeps at most `limit` steps in flight by waiting for the oldest one.

    JAX dispatches steps asynchronously; an unbounded queue grows memory and, with many
    simulated devices on few cores, can deadlock cross-device collectives. Waiting on a
    step `limit` steps back keeps the device busy while bounding the queue, and costs
    nothing when that step is already done.
    """

    def __init__(self, limit: int = DEFAULT_LIMIT):
        if limit < 1:
            raise ValueError(f"the in-flight limit must be >= 1, got {limit}")
        self.limit = limit
        self._pending: collections.deque[jax.Array] = collections.deque()

    def push(self, output: jax.Array) -> None:
        """Records a dispatched step's output; waits for the oldest past the limit."""
        pending = self._pending
        pending.append(output)
        if len(pending) > self.limit:
            pending.popleft().block_until_ready()

    def wait_all(self) -> None:
        """Waits for every recorded step."""
        while self._pending:
            self._pending.popleft().block_until_ready()
