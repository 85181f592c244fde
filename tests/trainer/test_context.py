"""`ctx.variable` and `ctx.global_step` in a model function, on 1 and 4 simulated devices."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loopax
from loopax import metrics

needs_four_devices = pytest.mark.skipif(
    jax.device_count() < 4,
    reason="needs 4 devices: XLA_FLAGS=--xla_force_host_platform_device_count=4 before jax loads",
)
DEVICE_COUNTS = [1, pytest.param(4, marks=needs_four_devices)]
BATCH = 8
ONE_DEVICE = jax.devices()[:1]


def squared_error(labels, predictions):
    return (labels[0] - predictions[0]) ** 2


def model_state_value(trainer, name):
    """The one leaf of the trainer's model state whose key is `name` (any collection)."""
    leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(trainer.state.model_state))[0]
    found = [leaf for path, leaf in leaves if getattr(path[-1], "key", None) == name]
    assert len(found) == 1, f"{name!r} in model state: {leaves}"
    return found[0]


def param_names(trainer):
    leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(trainer.params))[0]
    return {getattr(key, "key", None) for path, _ in leaves for key in path}


def linear_batch(rng, w=3.0):
    x = rng.normal(size=(BATCH, 1)).astype(np.float32)
    return None, [x], [w * x]


# -- trainable variables -------------------------------------------------------------------


@pytest.mark.parametrize("devices", DEVICE_COUNTS)
def test_a_trainable_scalar_variable_learns(devices):
    def model(ctx, spec, inputs):
        return ctx.variable("w", 0.0) * inputs[0]

    trainer = loopax.Trainer(model, squared_error, optax.sgd(0.1), devices=jax.devices()[:devices])
    rng = np.random.default_rng(0)
    trainer.train_step(*linear_batch(rng))
    params = jax.device_get(trainer.params)
    assert list(params) == ["w"]
    assert np.shape(params["w"]) == () and params["w"].dtype == np.float32
    assert params["w"] != 0.0  # trained from its initial value already
    for _ in range(100):
        # Waited for: with 4 simulated devices on 2 cores, a long queue of dispatched
        # steps can stall XLA's collectives (the Loop bounds it; a hand loop must).
        jax.block_until_ready(trainer.train_step(*linear_batch(rng)))
    assert float(jax.device_get(trainer.params)["w"]) == pytest.approx(3.0, abs=1e-3)


def test_a_callable_init_gets_a_key_and_trains_beside_flax_layers():
    keys = []

    def model(ctx, spec, inputs):
        def init(key):
            keys.append(key)
            return jax.random.normal(key, (2,))

        scale = ctx.variable("scale", init)
        return nn.Dense(1)(inputs[0] * scale)

    def make():
        return loopax.Trainer(model, squared_error, optax.sgd(0.1), devices=jax.devices()[:1])

    batch = None, [np.ones((BATCH, 2), np.float32)], [np.ones((BATCH, 1), np.float32)]
    trainer, again = make(), make()
    trainer.train_step(*batch)
    again.train_step(*batch)
    assert keys, "the init callable was never called"
    params = jax.device_get(trainer.params)
    assert {"scale", "Dense_0"} <= set(params)
    assert params["scale"].shape == (2,) and params["scale"].dtype == np.float32
    assert not np.array_equal(params["scale"][0], params["scale"][1])  # random, not constant
    # Deterministic from the seed.
    np.testing.assert_array_equal(params["scale"], jax.device_get(again.params)["scale"])


# -- non-trainable variables (model state) -------------------------------------------------


def counting_model(ctx, spec, inputs):
    calls = ctx.variable("calls", jnp.zeros((), jnp.float32), trainable=False)
    batch_mean = ctx.variable("batch_mean", 0.0, trainable=False)
    if ctx.training:
        calls.value = calls.value + 1.0
        batch_mean.value = jnp.mean(inputs[0])
    return nn.Dense(1)(inputs[0])


@pytest.mark.parametrize("devices", DEVICE_COUNTS)
def test_a_non_trainable_variable_is_kept_across_steps_and_averaged_across_devices(devices):
    trainer = loopax.Trainer(
        counting_model, squared_error, optax.sgd(0.1), devices=jax.devices()[:devices]
    )
    rng = np.random.default_rng(0)
    calls = []
    for _ in range(5):
        # Each device's quarter of the batch has a different mean.
        x = (rng.normal(size=(BATCH, 3)) + np.arange(BATCH)[:, None]).astype(np.float32)
        trainer.train_step(None, [x], [x[:, :1]])
        calls.append(float(model_state_value(trainer, "calls")))
        np.testing.assert_allclose(model_state_value(trainer, "batch_mean"), x.mean(), rtol=1e-5)
    assert np.diff(calls).tolist() == [1.0] * 4  # one increment a step, on every device count
    assert not {"calls", "batch_mean"} & param_names(trainer)
    before = model_state_value(trainer, "calls")
    trainer.eval_step(None, [x], [x[:, :1]])
    assert model_state_value(trainer, "calls") == before  # eval steps leave it alone


def test_the_first_step_reads_the_initial_value_of_a_non_trainable_variable():
    # Creating the variables runs the model once before the first step; what that run
    # writes must not count as a step (GoMLX has no such run; Flax's BatchNorm skips its
    # update while initializing for the same reason).
    trainer = loopax.Trainer(counting_model, squared_error, optax.sgd(0.1), devices=ONE_DEVICE)
    x = np.ones((BATCH, 3), np.float32)
    trainer.train_step(None, [x], [x[:, :1]])
    assert model_state_value(trainer, "calls") == 1.0


# -- ctx.global_step -----------------------------------------------------------------------


def step_recording_model(ctx, spec, inputs):
    """Stores `ctx.global_step` in model state and returns it as a second prediction, one
    value per example, for the metrics below to read.
    """
    assert jnp.issubdtype(ctx.global_step.dtype, jnp.integer)
    assert ctx.global_step.shape == ()
    seen = ctx.variable("seen_step", jnp.array(-1, jnp.int32), trainable=False)
    if ctx.training:
        seen.value = ctx.global_step
    prediction = nn.Dense(1)(inputs[0])
    step_as_prediction = jnp.full((inputs[0].shape[0],), ctx.global_step, jnp.float32)
    return [prediction, step_as_prediction]


def seen_step_metrics():
    """The mean of the global step the examples saw, and of its square: both together say
    whether every example of a step saw the same value (a variance of zero).
    """
    return [
        metrics.Mean("seen step", lambda labels, predictions: predictions[1]),
        metrics.Mean("seen step squared", lambda labels, predictions: predictions[1] ** 2),
    ]


def step_trainer(devices=1, accumulate_steps=1):
    return loopax.Trainer(
        step_recording_model,
        lambda labels, predictions: (labels[0] - predictions[0]) ** 2,
        optax.sgd(0.01),
        train_metrics=seen_step_metrics(),
        eval_metrics=seen_step_metrics(),
        devices=jax.devices()[:devices],
        accumulate_steps=accumulate_steps,
    )


def assert_every_example_saw(step_metrics, step):
    assert float(step_metrics["seen step"]) == step
    assert float(step_metrics["seen step squared"]) == step**2


@pytest.mark.parametrize("devices", DEVICE_COUNTS)
def test_global_step_is_the_optimizer_steps_before_this_one(devices):
    trainer = step_trainer(devices)
    x = np.ones((BATCH, 3), np.float32)
    for step in range(4):
        trainer.reset_train_metrics()
        assert_every_example_saw(trainer.train_step(None, [x], [x[:, :1]]), step)
        assert model_state_value(trainer, "seen_step") == step  # 0 in the first step
    # In an eval step it equals trainer.global_step.
    dataset = loopax.IterableDataset(lambda: iter([([x], [x[:, :1]])]), name="one")
    assert_every_example_saw(trainer.evaluate(dataset), 4)


@pytest.mark.parametrize("devices", DEVICE_COUNTS)
def test_every_micro_batch_of_an_optimizer_step_sees_the_same_global_step(devices):
    trainer = step_trainer(devices, accumulate_steps=3)
    x = np.ones((3, BATCH, 3), np.float32)
    for step in range(3):
        trainer.reset_train_metrics()
        assert_every_example_saw(trainer.train_step(None, [x], [x[..., :1]]), step)
        assert model_state_value(trainer, "seen_step") == step


def test_the_loop_gives_each_accumulated_step_its_global_step():
    trainer = step_trainer(accumulate_steps=3)
    loop = loopax.Loop(trainer)
    recorded = []
    loop.on_step("record", lambda loop, m: recorded.append(m))
    x = np.ones((6 * 3 * BATCH, 3), np.float32)
    loop.run_steps(loopax.ArrayDataset(x, x[:, :1], BATCH, shuffle=False), 6)
    assert trainer.global_step == 6
    assert model_state_value(trainer, "seen_step") == 5
    # Running means since the run started: after step s, mean(t) = s/2 and
    # mean(t**2) = s(2s+1)/6 over t = 0..s, when every micro-batch of step t saw t.
    for step, step_metrics in enumerate(recorded):
        assert float(step_metrics["seen step"]) == pytest.approx(step / 2)
        assert float(step_metrics["seen step squared"]) == pytest.approx(step * (2 * step + 1) / 6)
