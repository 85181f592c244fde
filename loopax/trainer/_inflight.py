"""A cheap bound on the number of dispatched steps that have not finished."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import jax

from .._devices import Device

DEFAULT_LIMIT = 8
# On one device no collective can deadlock, so more steps may queue and the host wakes less
# often (once per 17 steps): each wake-up is a thread hand-off that shows on a small model
# (figures: docs/benchmarks.md, "Why the code is the way it is").
SINGLE_DEVICE_LIMIT = 32
# Several CPU devices of one process (simulated ones, `--xla_force_host_platform_device_count`)
# keep a shorter queue, counted in the XLA computations it holds rather than in steps. XLA's
# CPU client admits at most 32 unfinished computations per device (`CpuClientOptions.
# max_inflight_computations_per_device`), and a program over several devices is launched on
# each device from a thread of its client pool, which blocks while that device is at the cap.
# The pool has max(cores, devices) threads, so with no more cores than devices (4 simulated
# devices on a 2-core machine) one blocked launch leaves a collective fewer threads than
# participants: the devices that entered it wait for one that never runs, and after
# `--xla_cpu_collective_call_terminate_timeout_seconds` (40 s) XLA aborts the process
# ("Fatal Python error: Aborted" in a test worker). A step is often several programs (an
# on-device dataset's gathers, the stacking of accumulated micro-batches, a hook's
# reductions): the 9 steps a limit of 8 lets queue, at 5 programs each (a step of 2
# accumulated micro-batches of on-device data took 2 gathers, 2 stackings and the step),
# went past the cap. At most 5 steps queued leave room for 6 programs per step under it.
MULTI_CPU_DEVICE_LIMIT = 4


def limit_for(devices: Sequence[Device]) -> int:
    """The in-flight bound for a step over `devices` (all processes' devices)."""
    if len(devices) == 1:
        return SINGLE_DEVICE_LIMIT
    process = jax.process_index()
    local = [device for device in devices if device.process_index == process]
    if len(local) > 1 and local[0].platform == "cpu":
        return MULTI_CPU_DEVICE_LIMIT
    return DEFAULT_LIMIT


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
