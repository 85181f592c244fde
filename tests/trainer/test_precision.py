"""Mixed precision: `Trainer(..., compute_dtype=..., loss_scale=...)`.

The model computes in `compute_dtype`; parameters and optimizer state stay float32; the
loss and metrics reduce in float32. `loss_scale="dynamic"` skips a step whose gradient is
not finite, halves the scale and checkpoints it.
"""

import importlib.util
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loopax
from loopax import hooks, losses, metrics

ONE_DEVICE = jax.devices()[:1]
BATCH = 8

needs_four_devices = pytest.mark.skipif(
    jax.device_count() < 4,
    reason="needs 4 devices: XLA_FLAGS=--xla_force_host_platform_device_count=4 before jax loads",
)
DEVICE_COUNTS = [1, pytest.param(4, marks=needs_four_devices)]


def squared_error(labels, predictions):
    return (labels[0] - predictions[0]) ** 2


def floating_leaves(tree):
    leaves = jax.tree.leaves(jax.device_get(tree))
    return [leaf for leaf in leaves if jnp.issubdtype(np.asarray(leaf).dtype, jnp.floating)]


def assert_float32(tree, what):
    leaves = floating_leaves(tree)
    assert leaves, f"{what} has no floating leaves"
    dtypes = {np.asarray(leaf).dtype for leaf in leaves}
    assert dtypes == {np.dtype(np.float32)}, f"{what}: {dtypes}"


def assert_trees_equal(got, want):
    got, want = jax.device_get(got), jax.device_get(want)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(g, w)


def regression_batch(rng, batch=BATCH):
    x = rng.normal(size=(batch, 3)).astype(np.float32)
    y = np.tanh(x @ np.array([[0.5], [-1.0], [0.25]], np.float32)).astype(np.float32)
    return x, y


# -- what computes in which dtype ----------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("devices", DEVICE_COUNTS)
def test_the_model_computes_in_the_dtype_and_the_state_stays_float32(dtype, devices):
    seen = {}

    def model(ctx, spec, inputs):
        seen["inputs"] = [x.dtype for x in inputs]
        dense = nn.Dense(1)
        output = dense(inputs[0] * inputs[1][:, None].astype(inputs[0].dtype))
        seen["kernel"] = dense.variables["params"]["kernel"].dtype
        seen["output"] = output.dtype
        return output

    trainer = loopax.Trainer(
        model,
        squared_error,
        optax.adam(0.01),
        train_metrics=[metrics.Mean("mean prediction", lambda labels, p: p[0][:, 0])],
        devices=jax.devices()[:devices],
        compute_dtype=dtype,
    )
    x, y = regression_batch(np.random.default_rng(0))
    counts = np.ones((BATCH,), np.int32)  # an integer input is not cast
    step_metrics = trainer.train_step(None, [x, counts], [y])
    assert seen["inputs"] == [jnp.dtype(dtype), jnp.dtype(jnp.int32)]
    assert seen["kernel"] == jnp.dtype(dtype)  # floating params are cast for the model
    assert seen["output"] == jnp.dtype(dtype)
    assert list(step_metrics) == ["loss", "moving_average_loss", "mean prediction"]
    for name, value in step_metrics.items():
        assert value.dtype == jnp.float32, name
    assert_float32(trainer.params, "params")
    assert_float32(trainer.state.opt_state, "optimizer state")
    for _ in range(3):
        trainer.train_step(None, [x, counts], [y])
    assert_float32(trainer.params, "params")
    assert_float32(trainer.state.opt_state, "optimizer state")
    assert all(np.isfinite(leaf).all() for leaf in floating_leaves(trainer.params))


# -- bfloat16 digits -----------------------------------------------------------------------

_DIGITS = Path(__file__).resolve().parents[2] / "examples" / "digits.py"


@pytest.fixture(scope="module")
def digits():
    pytest.importorskip("sklearn")
    spec = importlib.util.spec_from_file_location("digits_example", _DIGITS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def digits_accuracy(digits, compute_dtype):
    (train_x, train_y), (test_x, test_y) = digits.load_digits(seed=0)
    trainer = loopax.Trainer(
        digits.model_fn,
        losses.sparse_categorical_crossentropy_logits,
        loopax.optimizers.adam(1e-3),
        train_metrics=[metrics.MovingAverageSparseCategoricalAccuracy()],
        eval_metrics=[metrics.SparseCategoricalAccuracy()],
        devices=ONE_DEVICE,
        compute_dtype=compute_dtype,
    )
    train = loopax.ArrayDataset(train_x, train_y, 64, loop_forever=True)
    test = loopax.ArrayDataset(test_x, test_y, 40, shuffle=False, name="test")
    last = loopax.Loop(trainer).run_steps(train, 300)
    for name, value in last.items():
        assert value.dtype == jnp.float32, name
    results = trainer.evaluate(test)
    assert_float32(trainer.params, "params")
    assert_float32(trainer.state.opt_state, "optimizer state")
    return results["Accuracy"]


def test_bfloat16_digits_reach_the_float32_accuracy(digits):
    float32 = digits_accuracy(digits, None)
    bfloat16 = digits_accuracy(digits, jnp.bfloat16)
    assert float32 > 0.9
    # Same data, seed and steps: bfloat16 lands within 3 points of float32.
    assert bfloat16 > float32 - 0.03, f"bfloat16 {bfloat16:.3f} vs float32 {float32:.3f}"


# -- static loss scale ---------------------------------------------------------------------


def tiny_loss(labels, predictions):
    # Gradients of ~1e-10 at the predictions: zero once cast to float16 (smallest
    # subnormal ~6e-8), unless the loss is scaled up before the gradient.
    return 1e-9 * (labels[0] - predictions[0]) ** 2


def dense_model(ctx, spec, inputs):
    return nn.Dense(1)(inputs[0])


def test_a_static_loss_scale_saves_float16_gradients_from_underflow():
    x, y = regression_batch(np.random.default_rng(0))
    y = y + 1.0  # residuals of ~1

    def trained_kernel(loss_scale):
        trainer = loopax.Trainer(
            dense_model,
            tiny_loss,
            optax.adam(0.01),  # any non-zero gradient moves a parameter
            devices=ONE_DEVICE,
            compute_dtype=jnp.float16,
            loss_scale=loss_scale,
        )
        trainer.train_step(None, [x], [y])
        initial = loopax.Trainer(dense_model, tiny_loss, optax.sgd(0.0), devices=ONE_DEVICE)
        initial.train_step(None, [x], [y])  # same seed: the same initial parameters
        return (
            jax.device_get(trainer.params)["Dense_0"]["kernel"],
            jax.device_get(initial.params)["Dense_0"]["kernel"],
        )

    unscaled, initial = trained_kernel(None)
    np.testing.assert_array_equal(unscaled, initial)  # the gradient underflowed to zero
    scaled, initial = trained_kernel(2.0**20)
    # Unscaled, these gradients (~1e-9) are below adam's eps (1e-8): a first step moves a
    # parameter by lr * |g| / (|g| + eps), ~1e-3 here; float32's spacing near them is ~3e-8.
    assert np.all(np.abs(scaled - initial) > 1e-5)


def test_a_static_loss_scale_is_undone_before_the_update():
    x, y = regression_batch(np.random.default_rng(1))

    def kernel_after_steps(loss_scale):
        trainer = loopax.Trainer(
            dense_model,
            squared_error,
            optax.sgd(0.1),  # the update is proportional to the gradient
            devices=ONE_DEVICE,
            compute_dtype=jnp.float16,
            loss_scale=loss_scale,
        )
        first = trainer.train_step(None, [x], [y])
        for _ in range(4):
            trainer.train_step(None, [x], [y])
        return float(first["loss"]), jax.device_get(trainer.params)["Dense_0"]["kernel"]

    loss_unscaled, unscaled = kernel_after_steps(None)
    loss_scaled, scaled = kernel_after_steps(1024.0)
    assert loss_scaled == pytest.approx(loss_unscaled, rel=1e-3)  # the reported loss is unscaled
    np.testing.assert_allclose(scaled, unscaled, rtol=2e-3, atol=1e-4)


# -- dynamic loss scale --------------------------------------------------------------------


@jax.custom_vjp
def overflow_gradient_if(x, flag):
    """Identity on `x`; its gradient is +inf wherever `flag` (one per example) is set:
    a float16 gradient overflow injected in the backward pass, the loss staying finite.
    """
    return x


def _overflow_forward(x, flag):
    return x, flag


def _overflow_backward(flag, cotangent):
    blown = jnp.where(flag[:, None] > 0, jnp.asarray(jnp.inf, cotangent.dtype), cotangent)
    return blown, jnp.zeros_like(flag)


overflow_gradient_if.defvjp(_overflow_forward, _overflow_backward)


def overflow_model(ctx, spec, inputs):
    hidden = nn.tanh(nn.Dense(4)(inputs[0]))
    return nn.Dense(1)(overflow_gradient_if(hidden, inputs[1]))


def dynamic_trainer(devices=1):
    return loopax.Trainer(
        overflow_model,
        squared_error,
        optax.adam(0.01),
        devices=jax.devices()[:devices],
        compute_dtype=jnp.float16,
        loss_scale="dynamic",
    )


def overflow_batch(rng, overflow=False):
    x, y = regression_batch(rng)
    flag = np.full((BATCH,), 1.0 if overflow else 0.0, np.float32)
    return None, [x, flag], [y]


@pytest.mark.parametrize("devices", DEVICE_COUNTS)
def test_dynamic_scaling_skips_an_overflowing_step_and_halves_the_scale(devices):
    trainer = dynamic_trainer(devices)
    rng = np.random.default_rng(0)
    for _ in range(3):
        step_metrics = trainer.train_step(*overflow_batch(rng))
    assert list(step_metrics)[:2] == ["loss", "moving_average_loss"]
    assert {"skipped_steps", "loss_scale"} <= set(step_metrics)
    scale = float(step_metrics["loss_scale"])
    skipped = float(step_metrics["skipped_steps"])
    assert scale > 1.0
    before = jax.device_get(trainer.state)

    step_metrics = trainer.train_step(*overflow_batch(rng, overflow=True))
    assert np.isfinite(float(step_metrics["loss"]))  # only the gradient overflowed
    assert float(step_metrics["skipped_steps"]) == skipped + 1
    assert float(step_metrics["loss_scale"]) == scale / 2
    after = jax.device_get(trainer.state)
    assert_trees_equal(after.params, before.params)
    assert_trees_equal(after.opt_state, before.opt_state)

    losses_after = []
    for _ in range(20):
        step_metrics = trainer.train_step(*overflow_batch(rng))
        losses_after.append(float(step_metrics["loss"]))
    assert float(step_metrics["skipped_steps"]) == skipped + 1  # training went on
    assert all(np.isfinite(losses_after))
    assert all(np.isfinite(leaf).all() for leaf in floating_leaves(trainer.params))
    assert not np.array_equal(
        jax.device_get(trainer.params)["Dense_0"]["kernel"], after.params["Dense_0"]["kernel"]
    )
    assert_float32(trainer.params, "params")
    assert_float32(trainer.state.opt_state, "optimizer state")


def test_dynamic_scale_grows_after_a_run_of_finite_steps():
    trainer = dynamic_trainer()
    loop = loopax.Loop(trainer)
    scales = []
    loop.on_step("record", lambda loop, m: scales.append(m["loss_scale"]))
    x, y = regression_batch(np.random.default_rng(0), batch=64)
    flag = np.zeros((64,), np.float32)
    last = loop.run_steps(loopax.ArrayDataset([x, flag], y, BATCH, loop_forever=True), 2500)
    scales = np.array(jax.device_get(scales), np.float64)
    skipped = float(last["skipped_steps"])
    changes = scales[1:] / scales[:-1]
    assert set(np.unique(changes)) <= {0.5, 1.0, 2.0}, np.unique(changes)
    assert np.count_nonzero(changes == 2.0) >= 1, "the scale never grew in 2500 finite steps"
    assert np.count_nonzero(changes == 0.5) <= skipped
    assert all(np.isfinite(leaf).all() for leaf in floating_leaves(trainer.params))


def test_the_dynamic_scale_is_checkpointed_and_a_resume_continues_with_it(tmp_path):
    rng = np.random.default_rng(0)
    x, y = regression_batch(rng, batch=8 * BATCH)
    flag = np.zeros((8 * BATCH,), np.float32)
    flag[3 * BATCH : 4 * BATCH] = 1.0  # batch 3 of every epoch overflows

    def dataset():
        return loopax.ArrayDataset([x, flag], y, BATCH, shuffle=False, loop_forever=True)

    def run(trainer, target, directory=None):
        loop = loopax.Loop(trainer)
        checkpointer = None if directory is None else hooks.checkpoint(loop, directory)
        scales = []
        loop.on_step("record", lambda loop, m: scales.append((loop.loop_step, m["loss_scale"])))
        loop.run_to_step(dataset(), target)
        if checkpointer is not None:
            checkpointer.wait()
        return {step: float(scale) for step, scale in jax.device_get(scales)}

    uninterrupted = dynamic_trainer()
    want = run(uninterrupted, 8)
    assert want[3] == want[2] / 2  # the overflow halved it
    run(dynamic_trainer(), 5, tmp_path)
    resumed = dynamic_trainer()
    got = run(resumed, 8, tmp_path)
    assert sorted(got) == [5, 6, 7]
    assert got == {step: want[step] for step in (5, 6, 7)}
    assert_trees_equal(resumed.state.params, uninterrupted.state.params)
    assert_trees_equal(resumed.state.opt_state, uninterrupted.state.opt_state)


# -- bad arguments -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options,message",
    [
        ({"loss_scale": "dynamic"}, "compute_dtype"),
        ({"loss_scale": 128.0}, "compute_dtype"),
        ({"compute_dtype": jnp.int8}, "int8"),
        ({"compute_dtype": "fp8"}, "fp8"),
        ({"compute_dtype": jnp.float16, "loss_scale": "static"}, "static"),
        ({"compute_dtype": jnp.float16, "loss_scale": 0.0}, "loss_scale"),
        ({"compute_dtype": jnp.float16, "loss_scale": -2.0}, "loss_scale"),
    ],
)
def test_bad_precision_arguments_raise_at_construction(options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        loopax.Trainer(dense_model, squared_error, optax.sgd(0.1), devices=ONE_DEVICE, **options)
