"""`time_limit`: stop training once a wall-time budget is spent, keeping the work."""

from __future__ import annotations

import logging
import math
import numbers
import time
from collections.abc import Callable
from typing import Any

from ..loop import Loop, Priority, RunInfo
from ._schedules import ClockSchedule

_logger = logging.getLogger("loopax")


class _PastBudget(ClockSchedule):
    """Fires at the first step whose clock reading is past `budget.deadline`.

    It reads the clock as `ClockSchedule` does (every so often, more often near the
    deadline), and keeps the start across runs: the budget is the process's, not a run's.
    """

    def __init__(self, budget: TimeLimit):
        super().__init__(budget.seconds, budget.clock, fire_first=False)
        self._budget = budget

    def start_run(self, run: RunInfo) -> None:
        self.restart(run)
        self.last = self._budget.started_at  # not reset: one budget for all runs

    def should_fire(self, run: RunInfo) -> bool:
        now = self._now(run)
        return self.last is not None and now - self.last >= self.period_seconds


class TimeLimit:
    """The time budget hooks; created by `time_limit`.

    Attributes:
      seconds: the budget.
      clock: returns the time in seconds.
      started_at: the clock reading when the first run of this process started (None
        before).
      stopped_step: the global step after which the budget stopped the training, or None.
    """

    def __init__(self, seconds: float, clock: Callable[[], float]):
        self.seconds = seconds
        self.clock = clock
        self.started_at: float | None = None
        self.stopped_step: int | None = None

    @property
    def remaining(self) -> float | None:
        """Seconds left of the budget (negative once past it), or None before the first run."""
        if self.started_at is None:
            return None
        return self.seconds - (self.clock() - self.started_at)

    def on_start(self, loop: Loop, dataset: Any) -> None:
        del dataset
        if self.started_at is None:
            self.started_at = self.clock()
        elif self.clock() - self.started_at >= self.seconds:
            self._stop(loop, loop.loop_step)  # spent by an earlier run: no step in this one

    def __call__(self, loop: Loop, metrics: Any) -> None:
        del metrics
        self._stop(loop, loop.loop_step + 1)

    def _stop(self, loop: Loop, step: int) -> None:
        self.stopped_step = step
        reason = f"time limit: {self.seconds:g} s of wall time spent at step {step}"
        _logger.info("%s", reason)
        loop.request_stop(reason)

    def __repr__(self) -> str:
        return (
            f"TimeLimit(seconds={self.seconds:g}, remaining={self.remaining}, "
            f"stopped_step={self.stopped_step})"
        )


def time_limit(
    loop: Loop,
    seconds: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    priority: int = Priority.VALIDATE,
) -> TimeLimit:
    """Stops training once `seconds` of wall time have passed, for jobs with a time limit.

    The budget starts when the first run of this process starts (compiling included) and
    spans every run of the loop in this process; a resumed job (a new process) gets a fresh
    budget. At the first step past it the hook calls `loop.request_stop`, so the run ends
    after that step's hooks: `loop.stop_reason` starts with `"time limit"`, and the
    checkpoint hook's end-of-run save keeps the work. A run started with the budget already
    spent stops before its first step. The clock is read every few steps, more often near
    the end (as the clock schedules do), so a step costs nothing extra; with fused steps
    the stop comes at a group's end. On several processes the stop is agreed, as every
    `request_stop` is, so all stop at the same step.

    Args:
      loop: the `loopax.Loop`.
      seconds: the budget, > 0.
      clock: returns the time in seconds; inject a fake one in tests.
      priority: the hook's priority (default `Priority.VALIDATE`: before evaluations and
        writers of the same step).

    Returns:
      The `TimeLimit` (`remaining`, `stopped_step`).

    Raises:
      ValueError: `seconds` is not a positive finite number.
      TypeError: `clock` is not callable.
    """
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, numbers.Real)
        or not 0 < seconds < math.inf
    ):
        raise ValueError(f"time_limit: seconds must be a number > 0, got {seconds!r}")
    if not callable(clock):
        raise TypeError(f"time_limit: clock must be a callable returning seconds, got {clock!r}")
    limit = TimeLimit(float(seconds), clock)
    loop.on_start("time_limit", limit.on_start, priority=priority)
    loop.on_step(
        "time_limit", limit, priority=priority, check_finite=False, when=_PastBudget(limit)
    )
    return limit
