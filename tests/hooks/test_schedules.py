"""The pure trigger rules: exact sequences from SEMANTICS.md and properties."""

import decimal
import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loopax.hooks._schedules import (
    EveryNStepsRule,
    ExponentialRule,
    NTimesRule,
    PeriodicRule,
    round_half_away_from_zero,
)


def fired_steps(should_fire, steps):
    return [step for step in steps if should_fire(step)]


def n_times_steps(n, start_step, total_steps):
    schedule = NTimesRule(n)
    return [
        step
        for step in range(start_step, start_step + total_steps)
        if schedule.should_fire(step - start_step + 1, total_steps)
    ]


def exponential_steps(start_step, factor, first_step, end_step):
    schedule = ExponentialRule(start_step, factor)
    schedule.start_run(first_step)
    return fired_steps(schedule.should_fire, range(first_step, end_step))


# every_n_steps


def test_every_n_steps_fresh_run_of_35():
    assert fired_steps(EveryNStepsRule(10).should_fire, range(0, 35)) == [9, 19, 29]


def test_every_n_steps_resumed_at_25_for_30_steps():
    assert fired_steps(EveryNStepsRule(10).should_fire, range(25, 55)) == [29, 39, 49]


def test_every_n_steps_of_one_fires_every_step():
    assert fired_steps(EveryNStepsRule(1).should_fire, range(5)) == [0, 1, 2, 3, 4]


@given(n=st.integers(1, 50), start=st.integers(0, 500), steps=st.integers(0, 300))
def test_every_n_steps_is_aligned_to_the_global_step(n, start, steps):
    fired = fired_steps(EveryNStepsRule(n).should_fire, range(start, start + steps))
    assert fired == [step for step in range(start, start + steps) if (step + 1) % n == 0]
    assert all(later - earlier == n for earlier, later in itertools.pairwise(fired))


@given(n=st.integers(1, 50), split=st.integers(0, 300), steps=st.integers(0, 300))
def test_every_n_steps_split_run_equals_uninterrupted(n, split, steps):
    schedule = EveryNStepsRule(n)
    whole = fired_steps(schedule.should_fire, range(steps))
    split = min(split, steps)
    parts = fired_steps(schedule.should_fire, range(split)) + fired_steps(
        schedule.should_fire, range(split, steps)
    )
    assert parts == whole


# n_times_during_loop


def test_n_times_10_in_100_steps():
    assert n_times_steps(10, 0, 100) == [9, 19, 29, 39, 49, 59, 69, 79, 89, 99]


def test_n_times_10_in_95_steps():
    assert n_times_steps(10, 0, 95) == [9, 18, 28, 37, 47, 56, 66, 75, 85, 94]


def test_n_times_3_in_10_steps():
    assert n_times_steps(3, 0, 10) == [3, 6, 9]
    assert NTimesRule(3).points(10) == [4, 7, 10]


def test_n_times_10_in_5_steps_fires_every_step():
    assert n_times_steps(10, 0, 5) == [0, 1, 2, 3, 4]


def test_n_times_resumed_at_500_for_100_steps():
    assert n_times_steps(10, 500, 100) == list(range(509, 600, 10))


def test_n_times_with_unknown_end_fires_at_powers_of_two_from_128():
    schedule = NTimesRule(10)
    fired = [done for done in range(1, 5000) if schedule.should_fire(done, None)]
    assert fired == [128, 256, 512, 1024, 2048, 4096]


def test_n_times_never_fires_outside_the_run():
    schedule = NTimesRule(4)
    assert not schedule.should_fire(0, 10)
    assert not schedule.should_fire(11, 10)
    assert not schedule.should_fire(0, None)


@given(n=st.integers(1, 60), total=st.integers(1, 2000))
def test_n_times_fires_min_n_t_times_evenly_and_at_the_last_step(n, total):
    schedule = NTimesRule(n)
    fired = [done for done in range(1, total + 1) if schedule.should_fire(done, total)]
    assert len(fired) == min(n, total)
    assert fired[-1] == total
    assert fired == schedule.points(total)
    gaps = [later - earlier for earlier, later in itertools.pairwise([0, *fired])]
    assert max(gaps) - min(gaps) <= 1


@given(n=st.integers(1, 60), total=st.integers(1, 2000))
def test_n_times_matches_the_ceil_formula(n, total):
    expected = sorted({math.ceil(i * total / n) for i in range(1, n + 1)} - {0})
    schedule = NTimesRule(n)
    assert [d for d in range(1, total + 1) if schedule.should_fire(d, total)] == expected


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
    schedule = ExponentialRule(100, 1.2)
    grid = schedule.grid()
    assert [next(grid) for _ in range(8)] == [100, 220, 364, 537, 745, 995, 1295, 1655]


def test_exponential_resumed_on_a_grid_point_still_fires_it():
    # SEMANTICS.md: keep advancing while next < the run's start step, so stopping and
    # resuming never drops a firing.
    assert exponential_steps(100, 1.2, 364, 800) == [364, 537, 745]


def test_exponential_far_behind_catches_up_one_call_at_a_time():
    schedule = ExponentialRule(10, 2.0)  # grid 10, 30, 70, 150
    schedule.start_run(0)
    assert [schedule.should_fire(200) for _ in range(5)] == [True, True, True, True, False]
    assert schedule.next_step == 310


def test_exponential_gap_rounds_half_away_from_zero():
    # gaps 5 -> 7.5 rounds to 8 (banker's rounding would give 8 too) -> 12 -> 18
    assert list(_take(ExponentialRule(5, 1.5).grid(), 4)) == [5, 13, 25, 43]
    # gap 1 -> 2.5 rounds to 3 (banker's rounding would give 2) -> 7.5 -> 8
    assert list(_take(ExponentialRule(1, 2.5).grid(), 4)) == [1, 4, 12, 32]


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
    for point in ExponentialRule(start_step, factor).grid():
        if point >= end_step:
            break
        grid.append(point)
    assert exponential_steps(start_step, factor, first_step, end_step) == [
        point for point in grid if point >= first_step
    ]


@given(start_step=st.integers(1, 200), factor=st.floats(1.01, 3.0))
def test_exponential_gaps_never_shrink(start_step, factor):
    points = _take(ExponentialRule(start_step, factor).grid(), 30)
    gaps = [later - earlier for earlier, later in itertools.pairwise([0, *points])]
    assert gaps[0] == start_step
    assert all(later >= earlier for earlier, later in itertools.pairwise(gaps))


@given(st.floats(-1e9, 1e9, allow_nan=False))
def test_round_half_away_from_zero_matches_decimal(value):
    expected = decimal.Decimal(value).quantize(decimal.Decimal(1), decimal.ROUND_HALF_UP)
    assert round_half_away_from_zero(value) == int(expected)


# periodic_callback


def test_periodic_fires_every_three_seconds_of_one_second_steps():
    schedule = PeriodicRule(3)
    schedule.start(0.0)
    fired = []
    for now in range(1, 13):
        if schedule.should_fire(float(now)):
            fired.append(now)
            schedule.fired(float(now))
    assert fired == [3, 6, 9, 12]


def test_periodic_does_not_fire_before_it_is_started():
    assert not PeriodicRule(1).should_fire(1e9)


def test_periodic_period_restarts_after_a_slow_callback():
    schedule = PeriodicRule(3)
    schedule.start(0.0)
    assert schedule.should_fire(3.0)
    schedule.fired(10.0)  # the callback took 7 s: those are not caught up
    assert not schedule.should_fire(12.0)
    assert schedule.should_fire(13.0)


@given(
    period=st.floats(0.01, 100.0),
    ticks=st.lists(st.floats(0.0, 50.0), min_size=1, max_size=50),
)
def test_periodic_firings_are_at_least_a_period_apart(period, ticks):
    schedule = PeriodicRule(period)
    now = 0.0
    schedule.start(now)
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
@pytest.mark.parametrize("schedule_class", [EveryNStepsRule, NTimesRule])
def test_non_positive_n_is_rejected(schedule_class, n):
    with pytest.raises(ValueError, match=rf"n must be a positive int, got n={n}"):
        schedule_class(n)


@pytest.mark.parametrize("n", [1.5, 10.0, "10", True, None])
@pytest.mark.parametrize("schedule_class", [EveryNStepsRule, NTimesRule])
def test_non_int_n_is_rejected(schedule_class, n):
    with pytest.raises(ValueError, match=r"n must be a positive int, got .*" + repr(n)[:2]):
        schedule_class(n)


@pytest.mark.parametrize("start_step", [0, -5, 2.5])
def test_bad_exponential_start_step_is_rejected(start_step):
    with pytest.raises(ValueError, match=rf"start_step must be a positive int, got .*{start_step}"):
        ExponentialRule(start_step, 1.2)


@pytest.mark.parametrize("factor", [1, 1.0, 0.5, -2.0, float("nan"), float("inf")])
def test_bad_exponential_factor_is_rejected(factor):
    message = rf"factor must be a finite number > 1 .*got factor={factor}"
    with pytest.raises(ValueError, match=message):
        ExponentialRule(100, factor)


@pytest.mark.parametrize("period", [0, -1.0, float("nan"), float("inf")])
def test_bad_period_is_rejected(period):
    message = rf"period_seconds must be a finite number > 0, got period_seconds={period}"
    with pytest.raises(ValueError, match=message):
        PeriodicRule(period)


@given(
    n=st.integers(1, 50),
    total=st.one_of(st.none(), st.integers(1, 3000)),
    done=st.integers(1, 3500),
)
def test_n_times_next_point_is_the_next_firing_point(n, total, done):
    # The loop asks a schedule only from the step it names: it must never skip a firing.
    rule = NTimesRule(n)
    limit = 5000 if total is None else total
    firing = [d for d in range(done, limit + 1) if rule.should_fire(d, total)]
    assert rule.next_point(done, total) == (firing[0] if firing else None)
