"""Pure trigger rules: *when* a hook fires, separate from *what* it does.

Each rule answers one question over integers (steps) or seconds, with no reference to a
`Loop`. The loop-facing schedules of `_triggers` (`EveryNSteps`, `NTimes`, ...) wrap them, so
every ready hook (checkpoint, tensorboard, plot, ...) reuses the same rules instead of
re-implementing a step counter.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator

# Points at which `NTimesRule` fires while the length of the run is unknown: done = 128, 256, ...
_FIRST_POINT_WHILE_END_UNKNOWN = 128


def _check_positive_int(argument: str, value: object) -> int:
    """Returns `value` as an int, or raises ValueError naming `argument` and `value`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(
            f"{argument} must be a positive int, got {value!r} of type {type(value).__name__}; "
            f"pass an int such as {argument}=10"
        )
    if value <= 0:
        raise ValueError(f"{argument} must be a positive int, got {argument}={value}")
    return int(value)


def round_half_away_from_zero(value: float) -> int:
    """Rounds to the nearest int, ties away from zero (unlike Python's banker's `round`).

    Example:
      >>> round_half_away_from_zero(2.5), round_half_away_from_zero(-2.5), round(2.5)
      (3, -3, 2)
    """
    return int(math.copysign(math.floor(abs(value) + 0.5), value))


class EveryNStepsRule:
    """Fires at step k iff `(k + 1) % n == 0`: aligned to the global step, so resumes agree.

    Stateless: a resumed run fires at the same steps as an uninterrupted one.

    Args:
      n: the period in steps, a positive int.

    Raises:
      ValueError: if `n` is not a positive int.

    Example:
      >>> schedule = EveryNStepsRule(10)
      >>> [step for step in range(35) if schedule.should_fire(step)]
      [9, 19, 29]
    """

    n: int

    def __init__(self, n: int):
        self.n = _check_positive_int("n", n)

    def should_fire(self, step: int) -> bool:
        """Whether to fire after 0-based `step` has run."""
        return (step + 1) % self.n == 0

    def __repr__(self) -> str:
        return f"EveryNStepsRule({self.n})"


class NTimesRule:
    """Fires at most `n` times per run, split evenly, always at the last step of the run.

    For a run of `total_steps` known steps, fires when `steps_done` (1-based count of steps run
    in this run) equals `ceil(i * total_steps / n)` for some i in 1..n: every step when
    `total_steps <= n`. While the length of the run is unknown (`total_steps is None`, as in the
    first epoch of `run_epochs`), fires at steps_done = 128, 256, 512, ...

    Stateless: the caller supplies the run's position.

    Args:
      n: how many times to fire per run, a positive int.

    Raises:
      ValueError: if `n` is not a positive int.

    Example:
      >>> schedule = NTimesRule(3)
      >>> [done - 1 for done in range(1, 11) if schedule.should_fire(done, 10)]
      [3, 6, 9]
      >>> schedule.points(10)
      [4, 7, 10]
    """

    n: int

    def __init__(self, n: int):
        self.n = _check_positive_int("n", n)

    def should_fire(self, steps_done: int, total_steps: int | None) -> bool:
        """Whether to fire once `steps_done` steps of a run of `total_steps` have run.

        Args:
          steps_done: 1-based count of the steps run so far in this run.
          total_steps: the length of the run, or None while unknown.
        """
        if steps_done <= 0:
            return False
        if total_steps is None:
            return (
                steps_done >= _FIRST_POINT_WHILE_END_UNKNOWN and steps_done & (steps_done - 1) == 0
            )
        if steps_done > total_steps:
            return False
        # The smallest i with ceil(i * T / n) >= done is floor((done - 1) * n / T) + 1; done is a
        # firing point iff that i lands exactly on it (i <= n always holds for done <= T).
        i = (steps_done - 1) * self.n // total_steps + 1
        return -(-i * total_steps // self.n) == steps_done

    def next_point(self, steps_done: int, total_steps: int | None) -> int | None:
        """The smallest firing `steps_done` value `>= steps_done`, or None when none is left.

        Example:
          >>> NTimesRule(3).next_point(5, 10), NTimesRule(3).next_point(11, 10)
          (7, None)
          >>> NTimesRule(3).next_point(1, None)
          128
        """
        steps_done = max(steps_done, 1)
        if total_steps is None:
            point = _FIRST_POINT_WHILE_END_UNKNOWN
            while point < steps_done:
                point *= 2
            return point
        if steps_done > total_steps:
            return None
        i = (steps_done - 1) * self.n // total_steps + 1
        return -(-i * total_steps // self.n)

    def points(self, total_steps: int) -> list[int]:
        """The `steps_done` values at which a run of `total_steps` steps fires, ascending."""
        return sorted({-(-i * total_steps // self.n) for i in range(1, self.n + 1)} - {0})

    def __repr__(self) -> str:
        return f"NTimesRule({self.n})"


class ExponentialRule:
    """An absolute grid of steps whose gaps grow by `factor`: start_step, then ever wider.

    The grid starts at `next = 0, gap = start_step`; advancing does `next += gap;
    gap = round_half_away_from_zero(gap * factor)`. `start_run(first_step)` positions it on the
    first grid point at or after `first_step`, so a resumed run lands on the same grid as an
    uninterrupted one (and a point equal to the resume step still fires); `should_fire(step)`
    fires (and advances once) when `step` reached the next point, so a schedule far behind
    catches up one call at a time.

    Args:
      start_step: the first grid point and the first gap, a positive int.
      factor: how much each gap grows, a number > 1.

    Raises:
      ValueError: if `start_step` is not a positive int or `factor` is not a finite number > 1.

    Example:
      >>> schedule = ExponentialRule(100, 1.2)
      >>> schedule.start_run(0)
      >>> [step for step in range(1000) if schedule.should_fire(step)]
      [100, 220, 364, 537, 745, 995]
    """

    start_step: int
    factor: float
    next_step: int
    gap: int

    def __init__(self, start_step: int, factor: float):
        self.start_step = _check_positive_int("start_step", start_step)
        if (
            isinstance(factor, bool)
            or not isinstance(factor, numbers.Real)
            or not math.isfinite(factor)
            or factor <= 1
        ):
            raise ValueError(
                f"factor must be a finite number > 1 so that the gaps grow, got factor={factor!r}; "
                "use every_n_steps for a constant period"
            )
        self.factor = float(factor)
        self.next_step = 0
        self.gap = self.start_step

    def _advance(self) -> None:
        self.next_step += self.gap
        self.gap = round_half_away_from_zero(self.gap * self.factor)

    def start_run(self, first_step: int) -> None:
        """Positions the grid for a run whose first step is `first_step`.

        Advances from the origin once, then while the next point is `< first_step`: a grid
        point equal to the first step of a run still fires, so stopping and resuming never
        drops a firing.
        """
        self.next_step, self.gap = 0, self.start_step
        self._advance()
        while self.next_step < first_step:
            self._advance()

    def should_fire(self, step: int) -> bool:
        """Whether to fire at `step`; advances the grid by one point when it does."""
        if step < self.next_step:
            return False
        self._advance()
        return True

    def grid(self) -> Iterator[int]:
        """The whole grid from the origin, endless: start_step, start_step + gap, ..."""
        next_step, gap = 0, self.start_step
        while True:
            next_step += gap
            gap = round_half_away_from_zero(gap * self.factor)
            yield next_step

    def __repr__(self) -> str:
        return f"ExponentialRule({self.start_step}, {self.factor:g})"


class PeriodicRule:
    """Fires when at least `period_seconds` passed since the clock started or last fired.

    Times come from the caller (any monotonic clock, in seconds). `start(now)` starts the clock
    without firing; `should_fire(now)` is False until it is started; `fired(now)` restarts the
    period: pass the time *after* the callback returned so that slow callbacks and paused
    time are not caught up.

    Args:
      period_seconds: the minimum time between firings, a finite number > 0.

    Raises:
      ValueError: if `period_seconds` is not a finite number > 0.

    Example:
      >>> schedule = PeriodicRule(3.0)
      >>> schedule.start(0.0)
      >>> fired = []
      >>> for now in range(1, 10):
      ...     if schedule.should_fire(now):
      ...         fired.append(now)
      ...         schedule.fired(now)
      >>> fired
      [3, 6, 9]
    """

    def __init__(self, period_seconds: float):
        if (
            isinstance(period_seconds, bool)
            or not isinstance(period_seconds, numbers.Real)
            or not math.isfinite(period_seconds)
            or period_seconds <= 0
        ):
            raise ValueError(
                f"period_seconds must be a finite number > 0, got period_seconds={period_seconds!r}"
            )
        self.period_seconds = float(period_seconds)
        self.last: float | None = None

    def start(self, now: float) -> None:
        """Starts (or restarts) the clock at `now` without firing."""
        self.last = now

    def should_fire(self, now: float) -> bool:
        """Whether `period_seconds` passed since the clock started or last fired."""
        return self.last is not None and now - self.last >= self.period_seconds

    def fired(self, now: float) -> None:
        """Records a firing that finished at `now`: the next period starts there."""
        self.last = now

    def __repr__(self) -> str:
        return f"PeriodicRule({self.period_seconds:g})"
