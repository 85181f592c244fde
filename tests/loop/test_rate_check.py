"""A NaN learning rate is named as such, before the loss it caused (issue 35, item 4).

A schedule that is not finite at some update count makes that step's update, then the
parameters and the next loss, NaN. The error says so first (the schedule, the step, the
value) and offers only the fix that applies: not a lower learning rate, clipped gradients or
`hooks.nan_guard`, which the loss's usual advice names.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import loopax


def model(ctx, spec, inputs):
    return nn.Dense(1)(nn.relu(nn.Dense(8)(inputs[0])))


def divided_by_zero(count):  # NaN at count 0 (0 / 0), 1e-3 after (min(1, inf))
    return 1e-3 * jnp.minimum(1.0, count / 0)


def nan_from_five(count):
    return jnp.where(count >= 5, jnp.nan, 1e-3)


def run(learning_rate, steps=12, **loop_kwargs):
    trainer = loopax.Trainer(
        model,
        loopax.losses.mean_squared_error,
        loopax.optimizers.adam(learning_rate=learning_rate),
        devices=jax.devices()[:1],
    )
    inputs = np.random.default_rng(0).normal(size=(32, 3)).astype(np.float32)
    data = loopax.ArrayDataset(inputs, inputs.sum(1, keepdims=True), 8, loop_forever=True)
    with pytest.raises(loopax.NonFiniteLossError) as raised:
        loopax.Loop(trainer, **loop_kwargs).run_steps(data, steps)
    return str(raised.value), raised.value.step


def assert_only_the_fix_that_applies(message):
    assert "lower the learning rate" not in message.lower()
    assert "attach hooks.nan_guard" not in message and "clip_global_norm" not in message
    assert message.endswith(
        "a lower learning rate, clipped gradients or hooks.nan_guard cannot help with it"
    )


def test_a_schedule_nan_at_its_first_count_is_named_before_the_loss():
    message, step = run(divided_by_zero)
    line = divided_by_zero.__code__.co_firstlineno
    assert message.startswith(
        "the learning rate is nan at step 0 (global step 1): the schedule divided_by_zero "
        f"({__file__}:{line}) gives nan at update count 0. That step's update made the "
        "parameters non-finite, so the loss is nan at step 1 (global step 2), the first "
        "non-finite step"
    ), message
    assert "Fix the schedule so that it is finite at every count" in message
    assert_only_the_fix_that_applies(message)
    assert step == 1


@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_a_schedule_nan_later_names_its_step_per_step_and_fused(steps_per_execution):
    message, step = run(nan_from_five, steps_per_execution=steps_per_execution)
    assert message.startswith(
        "the learning rate is nan at step 5 (global step 6): the schedule nan_from_five "
    ), message
    assert "gives nan at update count 5" in message
    assert_only_the_fix_that_applies(message)
    assert step == 6


def test_a_learning_rate_set_to_nan_is_named():
    trainer = loopax.Trainer(
        model,
        loopax.losses.mean_squared_error,
        loopax.optimizers.adam(1e-3),
        devices=jax.devices()[:1],
    )
    inputs = np.random.default_rng(0).normal(size=(32, 3)).astype(np.float32)
    data = loopax.ArrayDataset(inputs, inputs.sum(1, keepdims=True), 8, loop_forever=True)
    loop = loopax.Loop(trainer)
    loop.run_steps(data, 2)
    trainer.set_learning_rate(float("nan"))
    with pytest.raises(loopax.NonFiniteLossError) as raised:
        loop.run_steps(data, 4)
    message = str(raised.value)
    assert message.startswith(
        "the learning rate is nan at step 2 (global step 3): the optimizer's learning rate is nan"
    ), message
    assert "Set a finite learning rate" in message
    assert_only_the_fix_that_applies(message)


def test_a_finite_schedule_leaves_the_loss_advice():
    # A rate far too large, but finite: the loss diverges and the usual advice stays.
    message, _ = run(lambda count: 1e12 + 0.0 * count, steps=30)
    assert message.startswith("the loss is "), message
    assert "lower the learning rate" in message
