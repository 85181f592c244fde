"""Tests for `loopax.optimizers.periodic_cosine` (GoMLX's restarting cosine schedule) and
`schedule_from_name`."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loopax
from loopax import losses, optimizers

ONE_DEVICE = jax.devices()[:1]


def gomlx_cosine(step, learning_rate, period, min_learning_rate=0.0, warmup_steps=0):
    """GoMLX's cosineschedule (and its schedules_test.go), for 0-based step `step`."""
    if step < warmup_steps:
        ratio = step / warmup_steps
    else:
        cycle = (step - warmup_steps) / period
        ratio = (math.cos((cycle - math.floor(cycle)) * math.pi) + 1.0) / 2.0
    return ratio * (learning_rate - min_learning_rate) + min_learning_rate


# ---------------------------------------------------------------------------------------
# Values.


def test_restarts_where_optax_cosine_decay_stays_at_its_floor():
    # The example: at step 150 of a 100-step period the cosine is half-way again.
    assert float(optax.cosine_decay_schedule(1.0, 100, alpha=0.001)(150)) == pytest.approx(0.001)
    schedule = optimizers.periodic_cosine(1.0, period_steps=100, min_value=0.001)
    assert float(schedule(150)) == pytest.approx(0.5005, abs=1e-6)


@pytest.mark.parametrize("warmup_steps", [0, 10])
def test_matches_gomlx_over_two_periods(warmup_steps):
    # GoMLX's TestCosineAnnealingSchedule: period 100, min 0.001, base 1.0, every step.
    schedule = jax.jit(
        optimizers.periodic_cosine(
            1.0, period_steps=100, min_value=0.001, warmup_steps=warmup_steps
        )
    )
    for step in range(2 * 100 + warmup_steps):
        expected = gomlx_cosine(step, 1.0, 100, 0.001, warmup_steps)
        assert float(schedule(step)) == pytest.approx(expected, abs=1e-6), step


def test_num_cycles_splits_the_steps_after_the_warmup():
    # GoMLX's "numCycles with warmUp": 2 cycles over 210 steps with a 10-step warmup.
    schedule = optimizers.periodic_cosine(
        1.0, min_value=0.001, warmup_steps=10, num_cycles=2, total_steps=210
    )
    for step in range(210):
        expected = gomlx_cosine(step, 1.0, 100, 0.001, 10)
        assert float(schedule(step)) == pytest.approx(expected, abs=1e-6), step


def test_num_cycles_may_give_a_fractional_period():
    schedule = optimizers.periodic_cosine(0.5, num_cycles=3, total_steps=100)
    period = 100 / 3
    for step in [0, 1, 16, 33, 34, 50, 66, 67, 99, 100, 133, 134]:
        expected = gomlx_cosine(step, 0.5, period)
        assert float(schedule(step)) == pytest.approx(expected, abs=1e-6), step


@pytest.mark.parametrize("warmup_steps", [0, 3])
def test_restarts_exactly_at_each_period_boundary(warmup_steps):
    init_value, min_value, period = 0.2, 0.02, 7
    schedule = optimizers.periodic_cosine(init_value, period, min_value, warmup_steps)
    for cycle in range(6):
        start = warmup_steps + cycle * period
        assert float(schedule(start)) == pytest.approx(init_value, abs=1e-7)
        last = float(schedule(start + period - 1))
        # The last step of a period is the lowest, just above the minimum, then it jumps.
        expected_last = min_value + (init_value - min_value) * 0.5 * (
            1 + math.cos(math.pi * (period - 1) / period)
        )
        assert last == pytest.approx(expected_last, abs=1e-7)
        values = [float(schedule(start + offset)) for offset in range(period)]
        assert values == sorted(values, reverse=True)
        assert float(schedule(start + period)) > values[0] - 1e-7


def test_warmup_rises_linearly_from_the_minimum():
    # GoMLX's warmup starts at the minimum learning rate (not at 0).
    schedule = optimizers.periodic_cosine(1.0, period_steps=10, min_value=0.1, warmup_steps=4)
    values = [float(schedule(step)) for step in range(6)]
    np.testing.assert_allclose(values, [0.1, 0.325, 0.55, 0.775, 1.0, 0.9779754], rtol=1e-6)


def test_stays_accurate_on_long_runs():
    schedule = jax.jit(optimizers.periodic_cosine(1.0, period_steps=1000, warmup_steps=7))
    for step in [10_000_007, 12_345_678, 16_000_506]:
        expected = gomlx_cosine(step, 1.0, 1000, warmup_steps=7)
        assert float(schedule(jnp.int32(step))) == pytest.approx(expected, abs=1e-5), step


def test_min_value_equal_to_init_value_is_constant():
    schedule = optimizers.periodic_cosine(0.3, period_steps=5, min_value=0.3, warmup_steps=2)
    assert {round(float(schedule(step)), 7) for step in range(20)} == {0.3}


# ---------------------------------------------------------------------------------------
# Bad arguments.


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"init_value": 1.0}, "give exactly one of period_steps .* or num_cycles"),
        (
            {"init_value": 1.0, "period_steps": 10, "num_cycles": 2, "total_steps": 100},
            "give exactly one of period_steps",
        ),
        ({"init_value": 1.0, "period_steps": 0}, "period_steps=0 must be a positive integer"),
        ({"init_value": 1.0, "period_steps": 2.5}, "period_steps=2.5 must be a positive integer"),
        ({"init_value": 1.0, "period_steps": True}, "period_steps=True must be a positive"),
        ({"init_value": -1.0, "period_steps": 10}, "init_value=-1.0 must be a non-negative"),
        ({"init_value": float("nan"), "period_steps": 10}, "init_value=nan must be"),
        ({"init_value": 1.0, "period_steps": 10, "min_value": -0.1}, "min_value=-0.1 must be"),
        (
            {"init_value": 0.1, "period_steps": 10, "min_value": 0.2},
            "min_value=0.2 must not exceed",
        ),
        ({"init_value": 1.0, "period_steps": 10, "warmup_steps": -1}, "warmup_steps=-1 must be"),
        (
            {"init_value": 1.0, "period_steps": 10, "total_steps": 100},
            "total_steps=100 is only used with num_cycles",
        ),
        ({"init_value": 1.0, "num_cycles": 2}, "num_cycles=2 needs total_steps"),
        ({"init_value": 1.0, "num_cycles": 0, "total_steps": 10}, "num_cycles=0 must be"),
        (
            {"init_value": 1.0, "num_cycles": 2, "total_steps": 10, "warmup_steps": 10},
            "total_steps=10 must be larger than warmup_steps=10",
        ),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=f"periodic_cosine: .*{message}"):
        optimizers.periodic_cosine(**kwargs)


# ---------------------------------------------------------------------------------------
# By name.


@pytest.mark.parametrize(
    "name, kwargs, factory",
    [
        (
            "periodic_cosine",
            {"init_value": 0.5, "period_steps": 7, "min_value": 0.1},
            "periodic_cosine",
        ),
        ("constant", {"value": 0.25}, "constant_schedule"),
        ("constant_schedule", {"value": 0.25}, "constant_schedule"),
        ("cosine_decay", {"init_value": 1.0, "decay_steps": 10, "alpha": 0.1}, "cosine_decay"),
        (
            "warmup_cosine",
            {"peak_value": 1.0, "warmup_steps": 2, "decay_steps": 10},
            "warmup_cosine",
        ),
        (
            "exponential_decay",
            {"init_value": 1.0, "transition_steps": 3, "decay_rate": 0.5},
            "exponential_decay",
        ),
        (
            "Periodic_Cosine",
            {"init_value": 0.5, "num_cycles": 2, "total_steps": 9},
            "periodic_cosine",
        ),
    ],
)
def test_schedule_from_name_round_trip(name, kwargs, factory):
    by_name = optimizers.schedule_from_name(name, **kwargs)
    direct = getattr(optimizers, factory)(**kwargs)
    for step in range(25):
        assert float(by_name(step)) == float(direct(step)), step


def test_schedule_from_name_errors_name_the_culprit():
    with pytest.raises(ValueError, match="unknown schedule 'cosine'; valid names are: constant,"):
        optimizers.schedule_from_name("cosine")
    with pytest.raises(
        TypeError,
        match=r"schedule 'periodic_cosine' got unknown hyperparameter\(s\) 'period' "
        r"\(did you mean 'period_steps' for 'period'\?\); valid ones are: init_value, ",
    ):
        optimizers.schedule_from_name("periodic_cosine", init_value=1.0, period=10)
    with pytest.raises(ValueError, match="period_steps=-4 must be a positive integer"):
        optimizers.schedule_from_name("periodic_cosine", init_value=1.0, period_steps=-4)


# ---------------------------------------------------------------------------------------
# In optimizers and the Trainer.


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw", "rmsprop"])
def test_every_optimizer_follows_the_schedule_and_reports_it(name):
    schedule = optimizers.periodic_cosine(0.5, period_steps=4, min_value=0.1, warmup_steps=2)
    optimizer = optimizers.from_name(name, learning_rate=schedule, clip_global_norm=10.0)
    params = {"w": jnp.ones(3)}
    state = optimizer.init(params)
    update = jax.jit(optimizer.update)
    seen = []
    for _ in range(12):
        _, state = update({"w": jnp.ones(3)}, state, params)
        seen.append(float(optimizers.get_learning_rate(state)))
    # After update k (1-based) the state holds the rate that update used: schedule(k - 1).
    expected = [gomlx_cosine(step, 0.5, 4, 0.1, 2) for step in range(12)]
    np.testing.assert_allclose(seen, expected, rtol=1e-6)
    # It restarted: steps 2, 6 and 10 start a period.
    assert seen[2] == seen[6] == seen[10] == pytest.approx(0.5)


def test_sgd_step_size_follows_the_schedule():
    schedule = optimizers.periodic_cosine(1.0, period_steps=3)
    optimizer = optimizers.sgd(schedule)
    state = optimizer.init(jnp.zeros(()))
    steps = []
    for _ in range(7):
        updates, state = optimizer.update(jnp.ones(()), state)
        steps.append(-float(updates))
    np.testing.assert_allclose(steps, [gomlx_cosine(step, 1.0, 3) for step in range(7)], rtol=1e-6)


def test_scheduled_rate_is_driven_by_the_schedule_not_set_learning_rate():
    state = optimizers.adam(optimizers.periodic_cosine(0.1, period_steps=5)).init({"w": 0.0})
    with pytest.raises(ValueError, match="driven by a schedule"):
        optimizers.set_learning_rate(state, 0.01)


def test_trainer_reads_the_live_rate_and_never_recompiles():
    schedule = optimizers.schedule_from_name(
        "periodic_cosine", init_value=0.05, period_steps=5, min_value=0.005, warmup_steps=2
    )

    def model_fn(ctx, spec, inputs):
        return nn.Dense(1)(inputs[0])

    trainer = loopax.Trainer(
        model_fn, losses.mean_squared_error, optimizers.adam(schedule), devices=ONE_DEVICE
    )
    compiled = []
    trainer.on_exec_creation(compiled.append)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 3)).astype(np.float32)
    y = x.sum(axis=1, keepdims=True).astype(np.float32)
    rates, step_losses = [], []
    for _ in range(14):
        metrics = trainer.train_step(None, [x], [y])
        step_losses.append(float(metrics["loss"]))
        rates.append(float(optimizers.get_learning_rate(trainer.state.opt_state)))
    expected = [gomlx_cosine(step, 0.05, 5, 0.005, 2) for step in range(14)]
    np.testing.assert_allclose(rates, expected, rtol=1e-5)
    assert step_losses[-1] < step_losses[0]
    assert len(compiled) == 1
