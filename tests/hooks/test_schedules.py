"""The schedules' arithmetic and the schedules without a Loop: exact sequences from
SEMANTICS.md and properties."""

import decimal
import itertools
import math
import sys
import types

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loopax.hooks import (
    AtSteps,
    EveryNEpochs,
    EveryNSteps,
    Exponential,
    FirstNSteps,
    NTimes,
    Periodic,
)
from loopax.hooks._schedule_math import (
    every_n_next,
    exponential_grid,
    n_times_next,
    round_half_away_from_zero,
)


def n_times_points(n, total_steps):
    """The reference: the `steps_done` at which a run of `total_steps` steps fires n times,
    at ceil(i * total / n) for i = 1..n."""
    return sorted({-(-i * total_steps // n) for i in range(1, n + 1)} - {0})


def run_info(start_step=0, end_step=-1, loop_step=0, epoch=0):
    """What a Loop tells a schedule, without a Loop."""
    return types.SimpleNamespace(
        start_step=start_step, end_step=end_step, loop_step=loop_step, epoch=epoch
    )


def fired_steps(should_fire, steps):
    return [step for step in steps if should_fire(step)]


def every_n_fires(n):
    return lambda step: every_n_next(n, step) == step


def n_times_fires(n, steps_done, total_steps):
    return n_times_next(n, steps_done, total_steps) == steps_done


def n_times_steps(n, start_step, total_steps):
    return [
        step
        for step in range(start_step, start_step + total_steps)
        if n_times_fires(n, step - start_step + 1, total_steps)
    ]


def schedule_steps(schedule, run, steps):
    """The steps at which `schedule` fires, asked at every step of `steps` as a Loop would."""
    fired = []
    for step in steps:
        run.loop_step = step
        if schedule.should_fire(run):
            fired.append(step)
            schedule.fired(run)
    return fired


def exponential_steps(start_step, factor, first_step, end_step):
    schedule = Exponential(start_step, factor)
    run = run_info(start_step=first_step, loop_step=first_step)
    schedule.start_run(run)
    return schedule_steps(schedule, run, range(first_step, end_step))


def grid_points(start_step, factor):
    return (point for point, _ in exponential_grid(start_step, factor))


# every_n_steps


def test_every_n_steps_fresh_run_of_35():
    assert fired_steps(every_n_fires(10), range(0, 35)) == [9, 19, 29]


def test_every_n_steps_resumed_at_25_for_30_steps():
    assert fired_steps(every_n_fires(10), range(25, 55)) == [29, 39, 49]


def test_every_n_steps_of_one_fires_every_step():
    assert fired_steps(every_n_fires(1), range(5)) == [0, 1, 2, 3, 4]


@given(n=st.integers(1, 50), start=st.integers(0, 500), steps=st.integers(0, 300))
def test_every_n_steps_is_aligned_to_the_global_step(n, start, steps):
    fired = fired_steps(every_n_fires(n), range(start, start + steps))
    assert fired == [step for step in range(start, start + steps) if (step + 1) % n == 0]
    assert all(later - earlier == n for earlier, later in itertools.pairwise(fired))


@given(n=st.integers(1, 50), split=st.integers(0, 300), steps=st.integers(0, 300))
def test_every_n_steps_split_run_equals_uninterrupted(n, split, steps):
    schedule = EveryNSteps(n)
    whole = schedule_steps(schedule, run_info(end_step=steps), range(steps))
    split = min(split, steps)
    parts = schedule_steps(schedule, run_info(end_step=split), range(split)) + schedule_steps(
        schedule, run_info(start_step=split, end_step=steps), range(split, steps)
    )
    assert parts == whole


# n_times_during_loop


def test_n_times_10_in_100_steps():
    assert n_times_steps(10, 0, 100) == [9, 19, 29, 39, 49, 59, 69, 79, 89, 99]


def test_n_times_10_in_95_steps():
    assert n_times_steps(10, 0, 95) == [9, 18, 28, 37, 47, 56, 66, 75, 85, 94]


def test_n_times_3_in_10_steps():
    assert n_times_steps(3, 0, 10) == [3, 6, 9]
    assert n_times_points(3, 10) == [4, 7, 10]


def test_n_times_10_in_5_steps_fires_every_step():
    assert n_times_steps(10, 0, 5) == [0, 1, 2, 3, 4]


def test_n_times_resumed_at_500_for_100_steps():
    assert n_times_steps(10, 500, 100) == list(range(509, 600, 10))


def test_n_times_with_unknown_end_fires_at_powers_of_two_from_128():
    fired = [done for done in range(1, 5000) if n_times_fires(10, done, None)]
    assert fired == [128, 256, 512, 1024, 2048, 4096]


def test_n_times_never_fires_outside_the_run():
    assert not n_times_fires(4, 0, 10)
    assert not n_times_fires(4, 11, 10)
    assert not n_times_fires(4, 0, None)


@given(n=st.integers(1, 60), total=st.integers(1, 2000))
def test_n_times_fires_min_n_t_times_evenly_and_at_the_last_step(n, total):
    fired = [done for done in range(1, total + 1) if n_times_fires(n, done, total)]
    assert len(fired) == min(n, total)
    assert fired[-1] == total
    assert fired == n_times_points(n, total)
    gaps = [later - earlier for earlier, later in itertools.pairwise([0, *fired])]
    assert max(gaps) - min(gaps) <= 1


@given(n=st.integers(1, 60), total=st.integers(1, 2000))
def test_n_times_matches_the_ceil_formula(n, total):
    expected = sorted({math.ceil(i * total / n) for i in range(1, n + 1)} - {0})
    assert [d for d in range(1, total + 1) if n_times_fires(n, d, total)] == expected


# exponential_callback


def test_exponential_100_by_1_2():
    assert exponential_steps(100, 1.2, 0, 1700) == [100, 220, 364, 537, 745, 995, 1295, 1655]


def test_exponential_10_by_1_2():
    assert exponential_steps(10, 1.2, 0, 254) == [10, 22, 36, 53, 73, 97, 126, 161, 203, 253]


def test_exponential_200_by_1_2():
    assert exponential_steps(200, 1.2, 0, 2000) == [200, 440, 728, 1074, 1489, 1987]


def test_exponential_100_by_1_2_resumed_at_300():
    assert exponential_steps(100, 1.2, 300, 800) == [364, 537, 745]


def test_exponential_grid_matches_the_fired_steps():
    grid = grid_points(100, 1.2)
    assert [next(grid) for _ in range(8)] == [100, 220, 364, 537, 745, 995, 1295, 1655]


def test_exponential_resumed_on_a_grid_point_still_fires_it():
    # SEMANTICS.md: keep advancing while next < the run's start step, so stopping and
    # resuming never drops a firing.
    assert exponential_steps(100, 1.2, 364, 800) == [364, 537, 745]


def test_exponential_far_behind_catches_up_one_call_at_a_time():
    schedule = Exponential(10, 2.0)  # grid 10, 30, 70, 150
    run = run_info()
    schedule.start_run(run)
    run.loop_step = 200
    assert [schedule.should_fire(run) for _ in range(5)] == [True, True, True, True, False]
    assert schedule.next_step(run, 200) == 310


def test_exponential_gap_rounds_half_away_from_zero():
    # gaps 5 -> 7.5 rounds to 8 (banker's rounding would give 8 too) -> 12 -> 18
    assert list(_take(grid_points(5, 1.5), 4)) == [5, 13, 25, 43]
    # gap 1 -> 2.5 rounds to 3 (banker's rounding would give 2) -> 7.5 -> 8
    assert list(_take(grid_points(1, 2.5), 4)) == [1, 4, 12, 32]


def _take(iterator, count):
    return [next(iterator) for _ in range(count)]


@given(
    start_step=st.integers(1, 200),
    factor=st.floats(1.01, 3.0),
    first_step=st.integers(0, 3000),
)
def test_exponential_resumed_run_lands_on_the_same_grid(start_step, factor, first_step):
    end_step = first_step + 2000
    grid = []
    for point in grid_points(start_step, factor):
        if point >= end_step:
            break
        grid.append(point)
    assert exponential_steps(start_step, factor, first_step, end_step) == [
        point for point in grid if point >= first_step
    ]


@given(start_step=st.integers(1, 200), factor=st.floats(1.01, 3.0))
def test_exponential_gaps_never_shrink(start_step, factor):
    points = _take(grid_points(start_step, factor), 30)
    gaps = [later - earlier for earlier, later in itertools.pairwise([0, *points])]
    assert gaps[0] == start_step
    assert all(later >= earlier for earlier, later in itertools.pairwise(gaps))


@given(st.floats(-1e9, 1e9, allow_nan=False))
def test_round_half_away_from_zero_matches_decimal(value):
    expected = decimal.Decimal(value).quantize(decimal.Decimal(1), decimal.ROUND_HALF_UP)
    assert round_half_away_from_zero(value) == int(expected)


# periodic_callback


class Clock:
    """A clock the test sets: `now` seconds."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class PeriodicAt:
    """A `Periodic` asked at the times the test names, one step per question."""

    def __init__(self, period):
        self.clock = Clock()
        self.schedule = Periodic(period, self.clock)
        self.run = run_info()
        self.schedule.start_run(self.run)

    def should_fire(self, now):
        self.clock.now = now
        fire = self.schedule.should_fire(self.run)
        self.run.loop_step += 1
        return fire

    def fired(self, now):
        self.clock.now = now
        self.schedule.fired(self.run)


def started_periodic(period):
    periodic = PeriodicAt(period)
    assert not periodic.should_fire(0.0)  # the run's first step starts the clock
    return periodic


def test_periodic_fires_every_three_seconds_of_one_second_steps():
    schedule = started_periodic(3)
    fired = []
    for now in range(1, 13):
        if schedule.should_fire(float(now)):
            fired.append(now)
            schedule.fired(float(now))
    assert fired == [3, 6, 9, 12]


def test_periodic_does_not_fire_before_it_is_started():
    assert not PeriodicAt(1).should_fire(1e9)


def test_periodic_period_restarts_after_a_slow_callback():
    schedule = started_periodic(3)
    assert schedule.should_fire(3.0)
    schedule.fired(10.0)  # the callback took 7 s: those are not caught up
    assert not schedule.should_fire(12.0)
    assert schedule.should_fire(13.0)


@given(
    period=st.floats(0.01, 100.0),
    ticks=st.lists(st.floats(0.0, 50.0), min_size=1, max_size=50),
)
def test_periodic_firings_are_at_least_a_period_apart(period, ticks):
    schedule = started_periodic(period)
    now = 0.0
    fired = [now]
    for tick in ticks:
        now += tick
        if schedule.should_fire(now):
            assert now - fired[-1] >= period
            fired.append(now)
            schedule.fired(now)
        else:
            assert now - fired[-1] < period


# bad configuration


@pytest.mark.parametrize("n", [0, -1])
@pytest.mark.parametrize("schedule_class", [EveryNSteps, NTimes, EveryNEpochs, FirstNSteps])
def test_non_positive_n_is_rejected(schedule_class, n):
    with pytest.raises(ValueError, match=rf"n must be a positive int, got n={n}"):
        schedule_class(n)


@pytest.mark.parametrize("n", [1.5, 10.0, "10", True, None])
@pytest.mark.parametrize("schedule_class", [EveryNSteps, NTimes, EveryNEpochs, FirstNSteps])
def test_non_int_n_is_rejected(schedule_class, n):
    with pytest.raises(ValueError, match=r"n must be a positive int, got .*" + repr(n)[:2]):
        schedule_class(n)


@pytest.mark.parametrize("start_step", [0, -5, 2.5])
def test_bad_exponential_start_step_is_rejected(start_step):
    with pytest.raises(ValueError, match=rf"start_step must be a positive int, got .*{start_step}"):
        Exponential(start_step, 1.2)


@pytest.mark.parametrize("factor", [1, 1.0, 0.5, -2.0, float("nan"), float("inf")])
def test_bad_exponential_factor_is_rejected(factor):
    message = rf"factor must be a finite number > 1 .*got factor={factor}"
    with pytest.raises(ValueError, match=message):
        Exponential(100, factor)


@pytest.mark.parametrize("period", [0, -1.0, float("nan"), float("inf")])
def test_bad_period_is_rejected(period):
    message = rf"period_seconds must be a finite number > 0, got period_seconds={period}"
    with pytest.raises(ValueError, match=message):
        Periodic(period)


@given(
    n=st.integers(1, 50),
    total=st.one_of(st.none(), st.integers(1, 3000)),
    done=st.integers(1, 3500),
)
def test_n_times_next_point_is_the_next_firing_point(n, total, done):
    # The loop asks a schedule only from the step it names: it must never skip a firing.
    limit = 5000 if total is None else total
    firing = [d for d in range(done, limit + 1) if n_times_fires(n, d, total)]
    assert n_times_next(n, done, total) == (firing[0] if firing else None)


# the schedules, told where the run stands without a Loop


def steps_asked_as_the_loop_does(schedule, run, steps):
    """Fired steps when asked only from the step `next_step` names, as the Loop asks."""
    fired = []
    next_step = schedule.next_step(run, steps.start)
    for step in steps:
        if step < next_step:
            continue
        run.loop_step = step
        if schedule.should_fire(run):
            fired.append(step)
        next_step = schedule.next_step(run, step + 1)
    return fired


SCHEDULES = {
    "every_n_steps": lambda n: EveryNSteps(n),
    "n_times": lambda n: NTimes(n),
    "at_steps": lambda n: AtSteps(range(n, 40 * n, 3 * n + 1)),
    "exponential": lambda n: Exponential(n, 1.5),
    "first_n_steps": lambda n: FirstNSteps(n),
}


@pytest.mark.parametrize("kind", sorted(SCHEDULES))
@given(n=st.integers(1, 20), start=st.integers(0, 300), steps=st.integers(0, 300))
def test_next_step_never_skips_a_firing(kind, n, start, steps):
    # `next_step` and `should_fire` share one arithmetic: asking only where `next_step`
    # points fires at the very steps that asking at every step does.
    def fired(ask):
        schedule = SCHEDULES[kind](n)
        run = run_info(start_step=start, end_step=start + steps, loop_step=start)
        schedule.start_run(run)
        return ask(schedule, run, range(start, start + steps))

    assert fired(steps_asked_as_the_loop_does) == fired(schedule_steps)


def test_every_n_steps_names_its_next_step():
    run = run_info(end_step=35, loop_step=19)
    assert [EveryNSteps(10).next_step(run, step) for step in (0, 9, 10, 19)] == [9, 9, 19, 19]
    assert EveryNSteps(10).should_fire(run)


def test_n_times_fires_at_the_even_points_of_the_run_it_is_told():
    schedule = NTimes(3)
    run = run_info(start_step=100, end_step=110, loop_step=100)
    schedule.start_run(run)
    assert schedule_steps(schedule, run, range(100, 110)) == [103, 106, 109]
    assert schedule.next_step(run, 110) == sys.maxsize


def test_n_times_resumed_from_its_state_keeps_the_runs_points():
    schedule = NTimes(3)
    schedule.start_run(run_info(start_step=0, end_step=10))
    state = schedule.get_state()
    assert state == {"start_step": 0, "end_step": 10}
    resumed = NTimes(3)
    resumed.set_state(state)
    run = run_info(start_step=5, end_step=10, loop_step=5)
    resumed.start_run(run)
    assert schedule_steps(resumed, run, range(5, 10)) == [6, 9]
    # A run to another end starts its own points.
    other = NTimes(3)
    other.set_state(state)
    run = run_info(start_step=5, end_step=11, loop_step=5)
    other.start_run(run)
    assert schedule_steps(other, run, range(5, 11)) == [6, 8, 10]


def test_n_times_with_an_unknown_end_continues_once_it_is_known():
    schedule = NTimes(2)
    run = run_info(start_step=0, end_step=-1)
    schedule.start_run(run)
    assert schedule.next_step(run, 0) == 127
    run.end_step = 100
    assert schedule.next_step(run, 0) == 49


def test_at_steps_fires_at_global_steps_and_then_never():
    schedule = AtSteps([10, 1, 10, 5])
    run = run_info(end_step=20)
    assert repr(schedule) == "at_steps(1, 5, 10)"
    assert schedule_steps(schedule, run, range(20)) == [0, 4, 9]
    assert schedule.next_step(run, 10) == sys.maxsize


def test_first_n_steps_of_the_process_counts_across_runs():
    schedule = FirstNSteps(3, of_process=True)
    run = run_info(start_step=0, end_step=2)
    schedule.start_run(run)
    assert schedule_steps(schedule, run, range(2)) == [0, 1]
    run = run_info(start_step=2, end_step=6, loop_step=2)
    schedule.start_run(run)
    assert schedule_steps(schedule, run, range(2, 6)) == [2]
    per_run = FirstNSteps(3)
    per_run.start_run(run)
    assert schedule_steps(per_run, run, range(2, 6)) == [2, 3, 4]


def test_every_n_epochs_fires_at_the_ends_of_every_nth_epoch():
    schedule = EveryNEpochs(2)
    fired = [epoch for epoch in range(7) if schedule.should_fire(run_info(epoch=epoch))]
    assert fired == [1, 3, 5]
