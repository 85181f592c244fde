"""A cheap bound on the number of dispatched steps that have not finished."""

from __future__ import annotations

import collections
from typing import Any

import jax

DEFAULT_LIMIT = 8
# On one device no collective can deadlock, so more steps may queue and the host wakes less
# often (once per 17 steps): each wake-up is a thread hand-off that shows on a small model
# (figures: docs/benchmarks.md, "Why the code is the way it is").
SINGLE_DEVICE_LIMIT = 32


def limit_for(num_devices: int) -> int:
    """The in-flight bound for a step over `num_devices` devices."""
    return SINGLE_DEVICE_LIMIT if num_devices == 1 else DEFAULT_LIMIT


class InFlight:
    """Keeps at most `limit` steps in flight, waiting in batches rather than every step.

    JAX dispatches steps asynchronously; an unbounded queue grows memory and, with many
    simulated devices on few cores, can deadlock cross-device collectives. When more than
    `limit` steps are pending, the host waits until only `limit // 2` are left (steps
    finish in order, so waiting on one step covers all before it). The device never runs
    dry, and the host sleeps and wakes once per `limit // 2 + 1` steps instead of every step.

    Each step comes with a token (the loop's `(step, metrics, dispatches)`); the tokens of
    the steps waited for are returned, so the caller can read their values (and, for a bad
    loss, look at their batches) at no extra wait.

    Attributes:
      finished: after each wait, the token of the newest step known finished: the one
        waited for, or a newer one already done (when the host came late, its dispatches
        having blocked or its thread having slept, the device went on), found without
        waiting (`jax.Array.is_ready`); None before the first wait.
    """

    def __init__(self, limit: int = DEFAULT_LIMIT):
        if limit < 2:
            raise ValueError(f"the in-flight limit must be >= 2, got {limit}")
        self.limit = limit
        self._keep = limit // 2
        self._pending: collections.deque[tuple[jax.Array, Any]] = collections.deque()
        self.finished: Any = None

    def __len__(self) -> int:
        return len(self._pending)

    def push(self, output: jax.Array, token: Any = None) -> list[Any] | None:
        """Records a dispatched step's output; past the limit, waits for the older half.

        Returns:
          The tokens of the steps it waited for, oldest first, or None when it did not wait.
        """
        pending = self._pending
        pending.append((output, token))
        if len(pending) <= self.limit:
            return None
        done = [pending.popleft() for _ in range(len(pending) - self._keep)]
        done[-1][0].block_until_ready()
        self.finished = done[-1][1]
        for output, token in reversed(pending):  # steps finish in order: the newest done
            ready = getattr(output, "is_ready", None)  # a jax.Array's (not in its stubs)
            if ready is not None and ready():
                self.finished = token
                break
        return [token for _, token in done]

    def wait_all(self) -> list[Any]:
        """Waits for every recorded step; returns their tokens, oldest first."""
        if not self._pending:
            return []
        self._pending[-1][0].block_until_ready()
        done = [token for _, token in self._pending]
        self.finished = done[-1]
        self._pending.clear()
        return done
