"""Data parallelism on 4 simulated CPU devices (tests/conftest.py sets XLA_FLAGS).

With N devices the result must equal the 1-device result on the same global batches.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loopax
from loopax import metrics

ONE_DEVICE = jax.devices()[:1]
FOUR_DEVICES = jax.devices()[:4]
PARALLEL = ["shard_map", "pmap"]
STEPS = 10

pytestmark = pytest.mark.skipif(
    jax.device_count() < 4,
    reason="needs 4 devices: XLA_FLAGS=--xla_force_host_platform_device_count=4 before jax loads",
)


def mlp_model(ctx, spec, inputs):
    return nn.Dense(1)(nn.tanh(nn.Dense(8)(inputs[0])))


def squared_error(labels, predictions):
    return (labels[0] - predictions[0]) ** 2


def mae(labels, predictions):
    return jnp.abs(labels[0] - predictions[0])


def regression_data(steps=STEPS, batch_size=8):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * batch_size, 3)).astype(np.float32)
    y = np.sin(x @ np.array([[1.0], [-2.0], [0.5]], np.float32)).astype(np.float32)
    return x, y


def train_run(devices, parallel="shard_map"):
    """Trains the MLP on the same 10 global batches; returns per-step metrics and the trainer."""
    trainer = loopax.Trainer(
        mlp_model,
        squared_error,
        optax.sgd(0.1),
        train_metrics=[metrics.Mean("mae", mae)],
        eval_metrics=[
            metrics.Mean("mae", mae),
            metrics.Mean("batch_mean", lambda y, p: jnp.mean(p[0])),
        ],
        devices=devices,
        parallel=parallel,
    )
    x, y = regression_data()
    dataset = loopax.ArrayDataset(x, y, batch_size=8, seed=3)
    loop = loopax.Loop(trainer)
    step_metrics = []
    loop.on_step("record", lambda loop, metrics: step_metrics.append(metrics))
    loop.run_steps(dataset, STEPS)
    assert all(list(m) == ["loss", "moving_average_loss", "mae"] for m in step_metrics)
    return [{name: np.asarray(value) for name, value in m.items()} for m in step_metrics], trainer


@pytest.fixture(scope="module")
def one_device_run():
    return train_run(ONE_DEVICE)


@pytest.fixture(scope="module", params=PARALLEL)
def four_device_run(request):
    return train_run(FOUR_DEVICES, request.param)


def assert_close_trees(got, want):
    jax.tree.map(
        lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6),
        jax.device_get(got),
        jax.device_get(want),
    )


def test_four_devices_give_the_one_device_result(one_device_run, four_device_run):
    expected_metrics, expected_trainer = one_device_run
    step_metrics, trainer = four_device_run
    assert trainer.num_devices == 4
    assert trainer.global_step == STEPS
    assert_close_trees(trainer.params, expected_trainer.params)
    assert_close_trees(step_metrics, expected_metrics)


def test_state_has_no_device_axis(one_device_run, four_device_run):
    _, expected_trainer = one_device_run
    _, trainer = four_device_run
    state, expected_state = jax.device_get(trainer.state), jax.device_get(expected_trainer.state)
    assert jax.tree.structure(state) == jax.tree.structure(expected_state)
    assert jax.tree.map(np.shape, state) == jax.tree.map(np.shape, expected_state)
    assert np.shape(state.step) == () and int(state.step) == STEPS
    # The state round-trips through the setter on a multi-device trainer.
    trainer.state = jax.tree.map(np.array, state)
    assert trainer.global_step == STEPS
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(trainer.state), state)


def test_eval_metrics_on_four_devices_equal_one_device(one_device_run, four_device_run):
    x, y = regression_data(steps=1, batch_size=12)
    batches = [([x[:8]], [y[:8]]), ([x[8:]], [y[8:]])]  # uneven sizes, multiples of 4
    dataset = loopax.IterableDataset(lambda: iter(batches), name="uneven")
    expected = one_device_run[1].evaluate(dataset)
    results = four_device_run[1].evaluate(dataset)
    assert list(results) == ["mean_loss", "mae", "batch_mean"]
    for name in expected:
        np.testing.assert_allclose(
            results[name],
            expected[name],
            rtol=1e-5,
            atol=1e-6,
            err_msg=f"{name}: {results} vs {expected}",
        )


def test_train_batch_not_divisible_by_the_device_count_raises():
    trainer = loopax.Trainer(mlp_model, squared_error, optax.sgd(0.1), devices=FOUR_DEVICES)
    x, y = regression_data(batch_size=6, steps=1)
    with pytest.raises(ValueError, match="batch size 6 is not divisible by the 4 devices"):
        trainer.train_step(None, [x], [y])
    # Evaluation takes it: every example counts once (tests/trainer/test_evaluate_all_examples.py).
    assert float(trainer.eval_step(None, [x], [y])["mean_loss"]) > 0


def dropout_batch_norm_model(ctx, spec, inputs):
    hidden = nn.Dense(16)(inputs[0])
    hidden = nn.BatchNorm(use_running_average=not ctx.training, axis_name=ctx.axis_name)(hidden)
    hidden = nn.Dropout(0.1, deterministic=not ctx.training)(nn.relu(hidden))
    return nn.Dense(1)(hidden)


@pytest.mark.parametrize("parallel", PARALLEL)
def test_dropout_and_batch_norm_train_on_four_devices(parallel):
    trainer = loopax.Trainer(
        dropout_batch_norm_model,
        squared_error,
        optax.adam(0.01),
        devices=FOUR_DEVICES,
        parallel=parallel,
    )
    x, y = regression_data(steps=4, batch_size=16)
    dataset = loopax.ArrayDataset(x, y, batch_size=16, loop_forever=True)
    losses_seen = []
    loop = loopax.Loop(trainer)
    loop.on_step("record", lambda loop, metrics: losses_seen.append(metrics["loss"]))
    loop.run_steps(dataset, 80)
    values = np.array(jax.device_get(losses_seen))
    assert np.all(np.isfinite(values))
    # The last 10 steps' mean loss is 0.53 of the first 10's (0.68 after 40 steps, which
    # cleared 0.7 by too little to rest on one CPU's floats).
    assert values[-10:].mean() < 0.7 * values[:10].mean()
    stats = jax.device_get(trainer.state.model_state)["batch_stats"]["BatchNorm_0"]
    assert stats["mean"].shape == (16,) and np.all(np.isfinite(stats["var"]))
    assert not np.allclose(stats["var"], 1.0), "batch_stats are updated in training"
    results = trainer.evaluate(loopax.ArrayDataset(x, y, batch_size=16))
    assert np.isfinite(results["mean_loss"])


def per_device_random_model(ctx, spec, inputs):
    """Adds the spread of every device's first random draw: 0 if devices share a key."""
    draw = jax.random.uniform(ctx.make_rng("dropout"), ())
    everyone = jax.lax.all_gather(draw, ctx.axis_name)
    ctx.add_loss(jnp.max(everyone) - jnp.min(everyone))
    return inputs[0] + 0.0 * nn.Dense(1)(inputs[0])  # a parameter: a model needs one


@pytest.mark.parametrize("parallel", PARALLEL)
def test_make_rng_differs_per_device(parallel):
    trainer = loopax.Trainer(
        per_device_random_model, None, optax.sgd(0.1), devices=FOUR_DEVICES, parallel=parallel
    )
    x = np.ones((4, 1), np.float32)
    spreads = jax.device_get([trainer.train_step(None, [x], [])["loss"] for _ in range(3)])
    assert all(spread > 0 for spread in spreads)
    assert len(set(float(s) for s in spreads)) == 3, "and per step"
