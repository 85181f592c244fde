"""Tests for `loopax.optimizers.stepped`, the piecewise-constant schedule (optax's
`piecewise_constant_schedule`, `flax.training.lr_schedule`'s stepped schedule)."""

from __future__ import annotations

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loopax
from loopax import losses, optimizers

ONE_DEVICE = jax.devices()[:1]


def flax_stepped(step, base, steps_per_epoch, lr_sched_steps, warmup_length=0.0):
    """`flax.training.lr_schedule.create_stepped_learning_rate_schedule`, written out (the
    module is deprecated in Flax): absolute factors per epoch boundary, warmup in epochs."""
    epoch = step / steps_per_epoch
    factor = 1.0
    for boundary_epoch, boundary_factor in lr_sched_steps:
        if epoch >= boundary_epoch:
            factor = boundary_factor
    value = base * factor
    if warmup_length > 0:
        value *= min(1.0, epoch / warmup_length)
    return value


def test_equals_optax_piecewise_constant_schedule():
    boundaries_and_scales = {10: 0.5, 25: 0.1, 40: 2.0}
    ours = optimizers.stepped(0.3, boundaries_and_scales)
    theirs = optax.piecewise_constant_schedule(0.3, boundaries_and_scales)
    for step in range(60):
        assert float(ours(step)) == pytest.approx(float(theirs(step)), rel=1e-6), step
    # The scales multiply: 0.3, 0.15, 0.015, 0.03.
    assert [round(float(ours(step)), 6) for step in (9, 10, 25, 40)] == [0.3, 0.15, 0.015, 0.03]


def test_matches_flax_stepped_schedule_with_warmup():
    steps_per_epoch, base = 5, 0.4
    lr_sched_steps = [[3, 0.1], [6, 0.01]]
    # flax's absolute factors become multiplying scales at epoch * steps_per_epoch.
    schedule = optimizers.stepped(
        base,
        {3 * steps_per_epoch: 0.1, 6 * steps_per_epoch: 0.1},
        warmup_steps=2 * steps_per_epoch,
    )
    for step in range(45):
        expected = flax_stepped(step, base, steps_per_epoch, lr_sched_steps, warmup_length=2)
        assert float(schedule(step)) == pytest.approx(expected, rel=1e-5, abs=1e-9), step
    assert float(schedule(0)) == 0.0  # the warmup starts at 0


def test_by_name_from_a_json_configuration():
    config = json.loads(
        '{"name": "stepped", "init_value": 0.1, "boundaries_and_scales": {"4": 0.5, "8": 0.5},'
        ' "warmup_steps": 2}'
    )
    name = config.pop("name")
    by_name = optimizers.schedule_from_name(name, **config)
    direct = optimizers.stepped(0.1, [(4, 0.5), (8, 0.5)], warmup_steps=2)
    values = [float(by_name(step)) for step in range(12)]
    assert values == [float(direct(step)) for step in range(12)]
    np.testing.assert_allclose(
        values, [0.0, 0.05, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05, 0.025, 0.025, 0.025, 0.025]
    )


def test_empty_boundaries_is_constant():
    schedule = optimizers.stepped(0.2, {})
    assert [float(schedule(step)) for step in (0, 5, 10_000)] == pytest.approx([0.2] * 3)


@pytest.mark.parametrize(
    "build, error, message",
    [
        (lambda: optimizers.stepped(-0.1, {}), ValueError, r"init_value=-0\.1"),
        (lambda: optimizers.stepped(0.1, {5: -0.5}), ValueError, r"boundaries_and_scales\[5\]"),
        (lambda: optimizers.stepped(0.1, {-2: 0.5}), ValueError, "step=-2 must be a non-negative"),
        (lambda: optimizers.stepped(0.1, {2.5: 0.5}), ValueError, "step=2.5 must be"),
        (lambda: optimizers.stepped(0.1, [(3, 0.5), (3, 0.1)]), ValueError, "step 3 appears twice"),
        (lambda: optimizers.stepped(0.1, {1: 0.5}, warmup_steps=-1), ValueError, "warmup_steps"),
        (lambda: optimizers.stepped(0.1, 0.5), TypeError, "must be a dict"),
        (lambda: optimizers.stepped(0.1, [(3, 0.5, 1)]), TypeError, r"\(step, scale\) pair"),
    ],
)
def test_invalid_arguments_name_the_culprit(build, error, message):
    with pytest.raises(error, match=message):
        build()


def test_trainer_follows_the_steps_without_recompiling():
    schedule = optimizers.schedule_from_name(
        "stepped", init_value=0.05, boundaries_and_scales={3: 0.1, 6: 0.1}, warmup_steps=2
    )

    def model_fn(ctx, spec, inputs):
        return nn.Dense(1)(inputs[0])

    trainer = loopax.Trainer(
        model_fn, losses.mean_squared_error, optimizers.sgd(schedule), devices=ONE_DEVICE
    )
    compiled = []
    trainer.on_exec_creation(compiled.append)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 3)).astype(np.float32)
    y = x.sum(axis=1, keepdims=True).astype(np.float32)
    rates = []
    for _ in range(9):
        trainer.train_step(None, [x], [y])
        rates.append(float(optimizers.get_learning_rate(trainer.state.opt_state)))
    # After update k (1-based) the state holds the rate that update used: schedule(k - 1).
    np.testing.assert_allclose(
        rates, [0.0, 0.025, 0.05, 0.005, 0.005, 0.005, 0.0005, 0.0005, 0.0005], rtol=1e-5
    )
    assert len(compiled) == 1
    assert jnp.isfinite(trainer.state.params["Dense_0"]["kernel"]).all()
