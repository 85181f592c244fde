"""The schedules: when a hook runs, as `Schedule` objects for `when=`.

Each asks one function of `_schedule_math` (or a clock) both where it may fire next
(`next_step`: the loop asks a step schedule only from the step it names) and whether it
fires (`should_fire`), and carries its position across a checkpoint resume
(`get_state`/`set_state`).
"""

from __future__ import annotations

import bisect
import math
import numbers
import time
from collections.abc import Callable, Iterable
from typing import Any

from .._validate import positive_int
from ..loop import RunInfo, Schedule
from ..loop._internal import NEVER
from ._schedule_math import (
    every_n_next,
    exponential_from,
    n_times_next,
    round_half_away_from_zero,
)


def _finite_above(value: Any, bound: float) -> bool:
    """Whether `value` is a finite real number (not a bool) greater than `bound`."""
    is_real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    return is_real and math.isfinite(value) and float(value) > bound


class EveryNSteps(Schedule):
    """Fires at step k iff `(k + 1) % n == 0`, i.e. at global steps that are multiples of n.

    Aligned to the global step, so a resumed run fires where an uninterrupted one would.
    Stateless.

    Raises:
      ValueError: `n` is not a positive int.

    Example:
      >>> import types
      >>> every = EveryNSteps(10)
      >>> run = types.SimpleNamespace(start_step=0, end_step=35, loop_step=19, epoch=0)
      >>> every.next_step(run, 10), every.should_fire(run)
      (19, True)
    """

    n: int

    def __init__(self, n: int):
        self.n = positive_int("n", n)

    def next_step(self, run: RunInfo, step: int) -> int:
        return every_n_next(self.n, step)

    def should_fire(self, run: RunInfo) -> bool:
        return every_n_next(self.n, run.loop_step) == run.loop_step

    def __repr__(self) -> str:
        return f"every_n_steps({self.n})"


class NTimes(Schedule):
    """Fires at most n times per run, evenly spaced, always at the run's last step.

    For a run of T known steps from `start_step`, fires where `k - start_step + 1` equals
    `ceil(i * T / n)` for i = 1..n (every step when T <= n). While the end is unknown (first
    epoch of `run_epochs`) fires after 128, 256, 512, ... steps of the run; once the end is
    known, continues with the even points. A run resumed from a checkpoint that ends at the
    same `end_step` keeps the original run's points.

    Raises:
      ValueError: `n` is not a positive int.
    """

    n: int
    run_end_step: int

    def __init__(self, n: int):
        self.n = positive_int("n", n)
        self.run_start_step: int | None = None
        self.run_end_step = -1
        self._restored: dict[str, int] | None = None

    def start_run(self, run: RunInfo) -> None:
        restored, self._restored = self._restored, None
        self.run_start_step = run.start_step
        self.run_end_step = run.end_step
        if (
            restored is not None
            and restored["end_step"] >= 0
            and restored["end_step"] == run.end_step
            and restored["start_step"] <= run.start_step < restored["end_step"]
        ):
            # Resuming the same run: keep its firing points.
            self.run_start_step = restored["start_step"]

    def next_step(self, run: RunInfo, step: int) -> int:
        start = self.run_start_step
        assert start is not None, "start_run was not called"
        self.run_end_step = run.end_step
        total = None if run.end_step < 0 else run.end_step - start
        point = n_times_next(self.n, step - start + 1, total)
        return NEVER if point is None else start + point - 1

    def should_fire(self, run: RunInfo) -> bool:
        return self.next_step(run, run.loop_step) == run.loop_step

    def get_state(self) -> dict[str, Any]:
        if self.run_start_step is None:
            return {}
        return {"start_step": self.run_start_step, "end_step": self.run_end_step}

    def set_state(self, state: dict[str, Any]) -> None:
        self._restored = (
            {"start_step": int(state["start_step"]), "end_step": int(state["end_step"])}
            if state
            else None
        )

    def __repr__(self) -> str:
        return f"n_times_during_loop({self.n})"


class Exponential(Schedule):
    """Fires on an absolute grid of steps whose gaps grow by `factor`.

    The grid: `start_step`, then `next += gap; gap = round_half_away_from_zero(gap * factor)` (100,
    1.2: 100, 220, 364, 537, 745, ...).

    The grid is absolute: a resumed run lands on it, and a grid point equal to the first
    step of a run still fires. Fires at most once per step, catching up one step at a time
    when behind.

    Raises:
      ValueError: `start_step` is not a positive int or `factor` not a finite number > 1.
    """

    start_step: int
    factor: float
    point: int  # the next grid point
    gap: int  # the gap after it

    def __init__(self, start_step: int, factor: float):
        self.start_step = positive_int("start_step", start_step)
        if not _finite_above(factor, 1):
            raise ValueError(
                f"factor must be a finite number > 1 so that the gaps grow, got factor={factor!r}; "
                "use every_n_steps for a constant period"
            )
        self.factor = float(factor)
        self.point, self.gap = 0, self.start_step  # the origin, until a run starts

    def start_run(self, run: RunInfo) -> None:
        # `loop_step`, not `start_step`: they agree before a run's first step, and a hook
        # registered during a run starts at its grid points from there, not catching up
        # the points of the run's earlier steps.
        self.point, self.gap = exponential_from(self.start_step, self.factor, run.loop_step)

    restart = start_run  # a rollback or restore continues on the grid from its step

    def next_step(self, run: RunInfo, step: int) -> int:
        return max(step, self.point)

    def should_fire(self, run: RunInfo) -> bool:
        if self.next_step(run, run.loop_step) != run.loop_step:
            return False
        self.point += self.gap
        self.gap = round_half_away_from_zero(self.gap * self.factor)
        return True

    def __repr__(self) -> str:
        return f"exponential_callback({self.start_step}, {self.factor:g})"


class ClockSchedule(Schedule):
    """Fires when `period_seconds` of `clock` passed since it last fired.

    With `fire_first` it also fires at its first step. It reads the clock only every so often.

    A clock reading on every step would cost every step; instead it measures how fast its
    clock runs per step and asks again after half the steps it predicts are left (at most
    `MAX_AHEAD`), so a period of a second costs a handful of readings, and it fires at most
    `MAX_AHEAD` steps late if the steps suddenly slow down. `last` is read after the callback
    returned, so slow callbacks and paused time are not caught up.
    """

    period_seconds: float
    time_based = True

    MAX_AHEAD = 32

    def __init__(self, period_seconds: float, clock: Callable[[], float], fire_first: bool):
        if not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds, got {clock!r}")
        self.period_seconds = float(period_seconds)
        self.clock = clock
        self.fire_first = fire_first
        self.last: float | None = None  # when it last fired (or started)
        self._read: tuple[int, float] | None = None  # the last (step, clock reading)
        self._per_step: float | None = None  # clock seconds per step, from the readings

    def start_run(self, run: RunInfo) -> None:
        self.last = None
        self.restart(run)

    def restart(self, run: RunInfo) -> None:
        self._read, self._per_step = None, None  # the steps jumped: measure again

    def _now(self, run: RunInfo) -> float:
        now = self.clock()
        step = run.loop_step
        if self._read is not None and step > self._read[0]:
            self._per_step = (now - self._read[1]) / (step - self._read[0])
        self._read = (step, now)
        return now

    def should_fire(self, run: RunInfo) -> bool:
        now = self._now(run)
        if self.last is not None:
            return now - self.last >= self.period_seconds
        self.last = now  # the run's first step
        return self.fire_first

    def fired(self, run: RunInfo) -> None:
        self.last = self._now(run)  # also the newest reading, for the prediction

    def next_step(self, run: RunInfo, step: int) -> int:
        if self.last is None or self._read is None or not self._per_step:
            return step
        read_step, read_time = self._read
        left = self.last + self.period_seconds - read_time
        ahead = int(left / self._per_step / 2) if self._per_step > 0 else 0
        return max(step, read_step + max(1, min(ahead, self.MAX_AHEAD)))


class Periodic(ClockSchedule):
    """Fires at most once every `period_seconds` of `clock`.

    The first step of each run only starts the clock (it usually includes compilation);
    after that it fires when `clock() - last >= period_seconds`, where `last` is read after
    the previous callback returned, so slow callbacks and paused time are not caught up.
    The clock is read only every few steps (see `ClockSchedule`). Nothing survives a
    restart: a clock's readings mean nothing in another process.

    Raises:
      ValueError: `period_seconds` is not a finite number > 0.
      TypeError: `clock` is not callable.
    """

    def __init__(self, period_seconds: float, clock: Callable[[], float] = time.monotonic):
        if not _finite_above(period_seconds, 0):
            raise ValueError(
                f"period_seconds must be a finite number > 0, got period_seconds={period_seconds!r}"
            )
        super().__init__(period_seconds, clock, fire_first=False)

    def __repr__(self) -> str:
        return f"periodic_callback({self.period_seconds:g}s)"


class AtSteps(Schedule):
    """Fires after the steps that bring `trainer.global_step` to one of `steps`.

    Raises:
      ValueError: `steps` is empty or holds something other than positive ints.
    """

    steps: tuple[int, ...]

    def __init__(self, steps: Iterable[int]):
        if isinstance(steps, (str, bytes)) or not hasattr(steps, "__iter__"):
            raise ValueError(
                f"steps must be a list of global steps such as [100, 1000], got {steps!r} of "
                f"type {type(steps).__name__}"
            )
        self.steps = tuple(sorted({positive_int("steps", step) for step in steps}))
        if not self.steps:
            raise ValueError("AtSteps needs at least one global step, e.g. AtSteps([100, 1000])")

    def next_step(self, run: RunInfo, step: int) -> int:
        index = bisect.bisect_left(self.steps, step + 1)
        return NEVER if index == len(self.steps) else self.steps[index] - 1

    def should_fire(self, run: RunInfo) -> bool:
        return self.next_step(run, run.loop_step) == run.loop_step

    def __repr__(self) -> str:
        shown = ", ".join(map(str, self.steps[:5])) + (", ..." if len(self.steps) > 5 else "")
        return f"at_steps({shown})"


class FirstNSteps(Schedule):
    """Fires at each of the first `n` steps of every run, or of this process.

    With `of_process=True` the steps are counted across this process's runs: the first steps after a
    restart, e.g. to watch them.

    Raises:
      ValueError: `n` is not a positive int.
    """

    n: int
    of_process: bool

    def __init__(self, n: int, *, of_process: bool = False):
        self.n = positive_int("n", n)
        self.of_process = bool(of_process)
        self._first: int | None = None  # the first step counted
        self._seen = 0  # steps counted before this run (of_process)

    def start_run(self, run: RunInfo) -> None:
        if not self.of_process:
            self._seen = 0
        self._first = run.start_step - self._seen

    def next_step(self, run: RunInfo, step: int) -> int:
        assert self._first is not None, "start_run was not called"
        return step if step - self._first < self.n else NEVER

    def should_fire(self, run: RunInfo) -> bool:
        assert self._first is not None, "start_run was not called"
        if self.of_process:
            self._seen = run.loop_step - self._first + 1
        return self.next_step(run, run.loop_step) == run.loop_step

    def __repr__(self) -> str:
        return f"first_n_steps({self.n}{', of_process=True' if self.of_process else ''})"


class EveryNEpochs(Schedule):
    """For `loop.on_epoch_end`: fires at the end of every n-th epoch of a `run_epochs`.

    Epochs are 0-based in the run: it fires at the ends of epochs n-1, 2n-1, ...

    Raises:
      ValueError: `n` is not a positive int.
    """

    n: int

    checks_every_step = True  # asked at every epoch end
    at_epoch_end = True

    def __init__(self, n: int):
        self.n = positive_int("n", n)

    def should_fire(self, run: RunInfo) -> bool:
        return every_n_next(self.n, run.epoch) == run.epoch

    def __repr__(self) -> str:
        return f"every_n_epochs({self.n})"
