"""The arithmetic of the schedules: pure functions over steps, with no `Loop` and no state.

Each rule has one function that names its next firing point; whether it fires at a point is
whether that point is the next one, so `Schedule.next_step` and `Schedule.should_fire` can
never disagree.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

# Points at which `n_times_next` fires while the length of the run is unknown: done = 128, 256, ...
FIRST_POINT_WHILE_END_UNKNOWN = 128


def round_half_away_from_zero(value: float) -> int:
    """Rounds to the nearest int, ties away from zero (unlike Python's banker's `round`).

    Example:
      >>> round_half_away_from_zero(2.5), round_half_away_from_zero(-2.5), round(2.5)
      (3, -3, 2)
    """
    return int(math.copysign(math.floor(abs(value) + 0.5), value))


def every_n_next(n: int, step: int) -> int:
    """The first 0-based step `>= step` after which a period of `n` fires: `(k + 1) % n == 0`.

    Aligned to the global step, so a resumed run fires where an uninterrupted one would.

    Example:
      >>> [every_n_next(10, step) for step in (0, 9, 10)]
      [9, 9, 19]
    """
    return -(-(step + 1) // n) * n - 1


def n_times_next(n: int, steps_done: int, total_steps: int | None) -> int | None:
    """The smallest `steps_done >= steps_done` at which `n` even firings per run fire.

    For a run of `total_steps` known steps the firing points are `ceil(i * total_steps / n)`
    for i in 1..n (every step when `total_steps <= n`, always the last one); while the length
    is unknown (`None`, as in the first epoch of `run_epochs`), 128, 256, 512, ...

    Args:
      n: how many times to fire per run.
      steps_done: 1-based count of the steps run so far in this run.
      total_steps: the length of the run, or None while unknown.

    Returns:
      The next firing point, or None when none is left in the run.

    Example:
      >>> n_times_next(3, 5, 10), n_times_next(3, 11, 10), n_times_next(3, 1, None)
      (7, None, 128)
    """
    steps_done = max(steps_done, 1)
    if total_steps is None:
        point = FIRST_POINT_WHILE_END_UNKNOWN
        while point < steps_done:
            point *= 2
        return point
    if steps_done > total_steps:
        return None
    # The smallest i with ceil(i * T / n) >= done is floor((done - 1) * n / T) + 1.
    i = (steps_done - 1) * n // total_steps + 1
    return -(-i * total_steps // n)


def exponential_grid(start_step: int, factor: float) -> Iterator[tuple[int, int]]:
    """The absolute grid whose gaps grow by `factor`, endless, as (point, next gap) pairs.

    From `point = 0, gap = start_step`, each point is `point + gap`, and the gap then grows to
    `round_half_away_from_zero(gap * factor)`.

    Example:
      >>> grid = exponential_grid(100, 1.2)
      >>> [next(grid)[0] for _ in range(6)]
      [100, 220, 364, 537, 745, 995]
    """
    point, gap = 0, start_step
    while True:
        point += gap
        gap = round_half_away_from_zero(gap * factor)
        yield point, gap


def exponential_from(start_step: int, factor: float, first_step: int) -> tuple[int, int]:
    """The first grid point `>= first_step` and the gap after it.

    A point equal to the first step of a run still fires, so stopping and resuming never
    drops a firing.

    Example:
      >>> exponential_from(100, 1.2, 300), exponential_from(100, 1.2, 364)
      ((364, 173), (364, 173))
    """
    for point, gap in exponential_grid(start_step, factor):
        if point >= first_step:
            return point, gap
    raise AssertionError("the grid is endless")
