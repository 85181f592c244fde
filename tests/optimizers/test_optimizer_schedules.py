"""Tests for loopax.optimizers' learning-rate schedules against closed-form formulas."""

import math

import pytest

from loopax import optimizers

_STEPS = [0, 1, 7, 50, 99, 100, 101, 250]


def test_constant_schedule():
    schedule = optimizers.constant_schedule(0.3)
    for step in _STEPS:
        assert float(schedule(step)) == pytest.approx(0.3)


@pytest.mark.parametrize("alpha", [0.0, 0.2])
def test_cosine_decay(alpha):
    init_value, decay_steps = 0.5, 100
    schedule = optimizers.cosine_decay(init_value, decay_steps, alpha=alpha)
    for step in _STEPS:
        progress = min(step, decay_steps) / decay_steps
        expected = init_value * ((1 - alpha) * 0.5 * (1 + math.cos(math.pi * progress)) + alpha)
        assert float(schedule(step)) == pytest.approx(expected, abs=1e-6), step


@pytest.mark.parametrize("init_value, end_value", [(0.0, 0.0), (0.01, 0.05)])
def test_warmup_cosine(init_value, end_value):
    peak_value, warmup_steps, decay_steps = 1.0, 20, 100
    schedule = optimizers.warmup_cosine(
        peak_value, warmup_steps, decay_steps, init_value=init_value, end_value=end_value
    )
    for step in _STEPS + [10, 19, 20, 21, 60]:
        if step < warmup_steps:
            expected = init_value + (peak_value - init_value) * step / warmup_steps
        else:
            progress = min(step - warmup_steps, decay_steps - warmup_steps) / (
                decay_steps - warmup_steps
            )
            cosine = 0.5 * (1 + math.cos(math.pi * progress))
            expected = end_value + (peak_value - end_value) * cosine
        assert float(schedule(step)) == pytest.approx(expected, abs=1e-6), step


def test_warmup_cosine_without_warmup_starts_at_peak():
    schedule = optimizers.warmup_cosine(0.2, warmup_steps=0, decay_steps=10)
    assert float(schedule(0)) == pytest.approx(0.2)
    assert float(schedule(10)) == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize("staircase", [False, True])
def test_exponential_decay(staircase):
    init_value, transition_steps, decay_rate, begin = 2.0, 10, 0.7, 5
    schedule = optimizers.exponential_decay(
        init_value, transition_steps, decay_rate, transition_begin=begin, staircase=staircase
    )
    for step in _STEPS + [4, 5, 15, 23]:
        if step <= begin:
            expected = init_value
        else:
            exponent = (step - begin) / transition_steps
            if staircase:
                exponent = math.floor(exponent)
            expected = init_value * decay_rate**exponent
        assert float(schedule(step)) == pytest.approx(expected, rel=1e-5), step


def test_exponential_decay_end_value_bounds_the_decay():
    schedule = optimizers.exponential_decay(1.0, 1, 0.5, end_value=0.1)
    assert float(schedule(2)) == pytest.approx(0.25)
    assert float(schedule(100)) == pytest.approx(0.1)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: optimizers.constant_schedule(-1.0), "value=-1.0"),
        (lambda: optimizers.cosine_decay(1.0, 0), "decay_steps=0 must be a positive"),
        (lambda: optimizers.cosine_decay(1.0, 10, alpha=2.0), r"alpha=2.0 must be in \[0, 1\]"),
        (lambda: optimizers.warmup_cosine(1.0, -1, 10), "warmup_steps=-1"),
        (lambda: optimizers.warmup_cosine(1.0, 10, 10), "decay_steps=10 must be larger"),
        (lambda: optimizers.exponential_decay(1.0, 0, 0.5), "transition_steps=0"),
        (lambda: optimizers.exponential_decay(1.0, 10, 0.0), "decay_rate=0.0"),
        (lambda: optimizers.exponential_decay(1.0, 10, 0.5, transition_begin=-3), "-3"),
    ],
)
def test_invalid_schedules_raise(build, message):
    with pytest.raises(ValueError, match=message):
        build()
