"""Tests for `loopax.losses.adaptive_power_loss` ("apl") against GoMLX's formula in NumPy."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import loopax
from loopax import losses, optimizers

ONE_DEVICE = jax.devices()[:1]


def ref_apl_power(delta, power_near=2.0, power_far=1.0, middle_delta=1.0, sharpness=1.0):
    """GoMLX's MakeAdaptivePowerLoss exponent, in float64, for power_near > power_far.

    s = ln(max(delta / middle, 1e-7)) * (near - far) / sharpness
    power = near + (far - near) * sigmoid(s)
    For power_near < power_far loopax uses |near - far| (GoMLX's documented behaviour).
    """
    delta = np.asarray(delta, np.float64)
    scaled = np.log(np.maximum(delta / middle_delta, 1e-7)) * abs(power_near - power_far)
    scaled = scaled / sharpness
    return power_near + (power_far - power_near) / (1.0 + np.exp(-scaled))


def ref_apl(labels, predictions, **params):
    delta = np.abs(np.asarray(labels, np.float64) - np.asarray(predictions, np.float64))
    if params.get("power_near", 2.0) == params.get("power_far", 1.0):
        return delta ** params.get("power_near", 2.0)
    return delta ** ref_apl_power(delta, **params)


def _loss(loss_fn, labels, predictions):
    return float(loss_fn([jnp.asarray(label) for label in labels], [jnp.asarray(predictions)]))


# ---------------------------------------------------------------------------------------
# Values.


def test_matches_gomlx_own_test_values():
    # GoMLX's TestAdaptivePowerLoss: powerNear=3, powerFar=1, middleDelta=10, sharpness=1.
    predictions = 1.0 + np.array([0.0, 0.1, -0.1, 10.0, -1000.0], np.float32)
    labels = np.ones_like(predictions)
    loss_fn = losses.adaptive_power_loss(power_near=3.0, power_far=1.0, middle_delta=10.0)
    expected = (0 + 0.1**3 + 0.1**3 + 10 * 10 + 1001.38275) / 5
    assert _loss(loss_fn, [labels], predictions) == pytest.approx(expected, rel=1e-5)

    # GoMLX's gradient check: the power is a constant, so d/dp |p - y|^k = k |p - y|^(k-1).
    gradient = jax.grad(lambda p: loss_fn([jnp.asarray(labels)], [p]))(jnp.asarray(predictions))
    np.testing.assert_allclose(
        gradient, [0.0, 3 * 0.01 / 5, -3 * 0.01 / 5, 2 * 10 / 5, -1 / 5], rtol=1e-2, atol=1e-6
    )


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"power_near": 3.0, "power_far": 1.0, "middle_delta": 10.0},
        {"power_near": 2.0, "power_far": 0.5, "middle_delta": 0.3, "sharpness": 0.25},
        {"power_near": 1.5, "power_far": 1.0, "sharpness": 4.0},
        {"power_near": 1.0, "power_far": 2.0},
        {"power_near": 1.5, "power_far": 1.5},
    ],
)
def test_matches_reference(params):
    rng = np.random.default_rng(0)
    labels = rng.normal(size=(6, 3)).astype(np.float32)
    predictions = (labels + rng.normal(size=(6, 3)) * np.logspace(-3, 2, 18).reshape(6, 3)).astype(
        np.float32
    )
    expected = ref_apl(labels, predictions, **params).mean()
    got = _loss(losses.adaptive_power_loss(**params), [labels], predictions)
    assert got == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("power_near, power_far", [(2.0, 1.0), (1.0, 2.0), (3.0, 0.5)])
def test_near_far_and_middle_regimes(power_near, power_far):
    loss_fn = losses.adaptive_power_loss(power_near=power_near, power_far=power_far)
    # At the middle delta the power is exactly half-way.
    middle = (power_near + power_far) / 2
    middle_loss = losses.adaptive_power_loss(
        power_near=power_near, power_far=power_far, middle_delta=4.0
    )
    assert _loss(middle_loss, [[0.0]], np.array([4.0])) == pytest.approx(4.0**middle, rel=1e-6)
    # Far below the middle the power tends to power_near, far above to power_far (sign of the
    # error does not matter).
    small, large = 1e-3, 1e4
    assert _loss(loss_fn, [[0.0]], np.array([-small])) == pytest.approx(small**power_near, rel=0.02)
    assert _loss(loss_fn, [[0.0]], np.array([large])) == pytest.approx(large**power_far, rel=0.02)


def test_sharpness_makes_the_change_sudden():
    soft = losses.adaptive_power_loss(sharpness=4.0)
    sharp = losses.adaptive_power_loss(sharpness=0.05)
    # At error 3 (ln 3 = 1.1 past the middle) a sharp loss is already ~linear, a soft one not.
    assert _loss(sharp, [[0.0]], np.array([3.0])) == pytest.approx(3.0, rel=1e-3)
    assert _loss(soft, [[0.0]], np.array([3.0])) == pytest.approx(
        3.0 ** ref_apl_power(3.0, 2, 1, 1, 4)
    )
    assert _loss(soft, [[0.0]], np.array([3.0])) > 3.0 * 1.5


def test_zero_error_is_zero_loss():
    loss_fn = losses.adaptive_power_loss()
    assert _loss(loss_fn, [[1.0, -2.0]], np.array([1.0, -2.0])) == 0.0


# ---------------------------------------------------------------------------------------
# Masks and weights.


@pytest.mark.parametrize("extra_shape", [(4, 2), (4,)])
def test_weights_and_mask(extra_shape):
    rng = np.random.default_rng(1)
    labels = rng.normal(size=(4, 2)).astype(np.float32)
    predictions = (labels + 3 * rng.normal(size=(4, 2))).astype(np.float32)
    weights = rng.uniform(0.5, 2.0, size=extra_shape).astype(np.float32)
    mask = np.array([True, False, True, True] * 2)[: math.prod(extra_shape)].reshape(extra_shape)
    per_element = ref_apl(labels, predictions)
    weights_full = np.broadcast_to(
        weights.reshape(extra_shape + (1,) * (2 - len(extra_shape))), (4, 2)
    )
    mask_full = np.broadcast_to(mask.reshape(extra_shape + (1,) * (2 - len(extra_shape))), (4, 2))
    loss_fn = losses.adaptive_power_loss()

    weighted = (per_element * weights_full).mean()
    assert _loss(loss_fn, [labels, weights], predictions) == pytest.approx(weighted, rel=1e-5)
    masked = per_element[mask_full].mean()
    assert _loss(loss_fn, [labels, mask], predictions) == pytest.approx(masked, rel=1e-5)
    both = (per_element * weights_full)[mask_full].mean()
    assert _loss(loss_fn, [labels, mask, weights], predictions) == pytest.approx(both, rel=1e-5)
    assert _loss(loss_fn, [labels, weights, mask], predictions) == pytest.approx(both, rel=1e-5)


def test_masked_out_padding_may_be_non_finite_and_all_masked_is_zero():
    loss_fn = losses.adaptive_power_loss()
    labels = np.array([0.0, np.nan], np.float32)
    predictions = np.array([0.5, np.inf], np.float32)
    mask = np.array([True, False])
    expected = float(ref_apl(0.0, 0.5))
    assert _loss(loss_fn, [labels, mask], predictions) == pytest.approx(expected, rel=1e-5)
    assert _loss(loss_fn, [labels[:1], np.array([False])], predictions[:1]) == 0.0


def test_bad_extra_label_names_the_expected_shapes():
    loss_fn = losses.adaptive_power_loss()
    with pytest.raises(ValueError, match=r"labels\[1\] has shape \(3,\).*\(4, 2\)"):
        loss_fn([jnp.zeros((4, 2)), jnp.ones(3)], [jnp.zeros((4, 2))])


# ---------------------------------------------------------------------------------------
# Gradients.


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"power_near": 3.0, "power_far": 1.0, "middle_delta": 10.0},
        {"power_near": 1.0, "power_far": 2.0},
    ],
)
def test_gradient_is_finite_at_edge_points(params):
    loss_fn = losses.adaptive_power_loss(**params)
    middle = params.get("middle_delta", 1.0)
    # Zero error, the smallest normal float32 error, the middle delta, huge errors.
    errors = np.array([0.0, 1.2e-38, 1e-7, middle, -middle, 1e6, -1e6], np.float32)
    gradient = jax.grad(lambda p: loss_fn([jnp.zeros(7)], [p]))(jnp.asarray(errors))
    assert np.all(np.isfinite(gradient))
    assert gradient[0] == 0.0
    # The power is held constant: the gradient is power * |e|^(power - 1) * sign(e) / n.
    power = ref_apl_power(np.abs(errors[3:]), **params)
    expected = power * np.abs(errors[3:].astype(np.float64)) ** (power - 1) * np.sign(errors[3:])
    np.testing.assert_allclose(gradient[3:], expected / 7, rtol=1e-4)


def test_gradient_is_finite_in_float64():
    with jax.enable_x64(True):
        loss_fn = losses.adaptive_power_loss()
        errors = jnp.array([0.0, 1e-300, 1.0, 1e300], jnp.float64)
        gradient = jax.grad(lambda p: loss_fn([jnp.zeros(4, jnp.float64)], [p]))(errors)
        assert gradient.dtype == jnp.float64
        assert np.all(np.isfinite(gradient))


# ---------------------------------------------------------------------------------------
# Arguments, names, dtypes and compilation.


@pytest.mark.parametrize("argument", ["power_near", "power_far", "middle_delta", "sharpness"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf"), True, "2"])
def test_bad_parameters_raise_naming_them(argument, value):
    with pytest.raises(ValueError, match=f"adaptive_power_loss: {argument}=.* must be a positive"):
        losses.adaptive_power_loss(**{argument: value})


def test_parameters_are_keyword_only():
    with pytest.raises(TypeError):
        losses.adaptive_power_loss(2.0, 1.0)  # type: ignore[misc]


def test_shape_mismatch_raises():
    with pytest.raises(
        ValueError, match=r"labels shape \(3,\) differs from predictions shape \(3, 1\)"
    ):
        losses.adaptive_power_loss()([jnp.zeros(3)], [jnp.zeros((3, 1))])


@pytest.mark.parametrize("name", ["apl", "adaptive_power_loss"])
def test_from_name_round_trip(name):
    params = {"power_near": 3.0, "power_far": 1.0, "middle_delta": 10.0, "sharpness": 2.0}
    by_name = losses.from_name(name, **params)
    direct = losses.adaptive_power_loss(**params)
    assert by_name.__name__ == "adaptive_power_loss"
    assert losses.from_name(by_name.__name__, **params).__name__ == by_name.__name__
    labels, predictions = np.zeros(3, np.float32), np.array([0.1, 10.0, -300.0], np.float32)
    assert _loss(by_name, [labels], predictions) == _loss(direct, [labels], predictions)
    assert _loss(losses.from_name(name), [labels], predictions) == pytest.approx(
        ref_apl(labels, predictions).mean(), rel=1e-5
    )


def test_from_name_rejects_unknown_parameters():
    with pytest.raises(
        ValueError, match="invalid parameters.*valid ones are: power_near, power_far"
    ):
        losses.from_name("apl", power=2.0)
    with pytest.raises(ValueError, match="power_far=0.0 must be a positive"):
        losses.from_name("apl", power_far=0.0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_keeps_its_dtype_and_computes_in_float32(dtype):
    loss_fn = losses.adaptive_power_loss(power_near=3.0, power_far=1.0, middle_delta=10.0)
    predictions = jnp.array([1e-3, 10.0, 300.0], dtype)
    loss = loss_fn([jnp.zeros(3, dtype)], [predictions])
    assert loss.dtype == dtype
    expected = ref_apl(
        np.zeros(3),
        np.asarray(predictions, np.float64),
        power_near=3.0,
        power_far=1.0,
        middle_delta=10.0,
    )
    assert float(loss) == pytest.approx(expected.mean(), rel=1e-2)


def test_jit_compiles_once_and_matches_eager():
    loss_fn = losses.adaptive_power_loss()
    traces = []

    @jax.jit
    def compiled(labels, predictions):
        traces.append(1)
        return loss_fn(labels, predictions)

    rng = np.random.default_rng(2)
    for _ in range(3):
        labels = [
            jnp.asarray(rng.normal(size=(5,)), jnp.float32),
            jnp.asarray(rng.uniform(size=5) > 0.3),
        ]
        predictions = [jnp.asarray(rng.normal(size=(5,)) * 5, jnp.float32)]
        assert float(compiled(labels, predictions)) == pytest.approx(
            float(loss_fn(labels, predictions)), rel=1e-6
        )
    assert len(traces) == 1


def test_trains_a_regression_through_the_trainer():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(128, 3)).astype(np.float32)
    y = (x @ np.array([[1.5], [-2.0], [0.5]], np.float32) + 3.0).astype(np.float32)
    y[::16] += 50.0  # outliers, where the far (linear) regime keeps the gradient bounded

    def model_fn(ctx, spec, inputs):
        return nn.Dense(1)(inputs[0])

    trainer = loopax.Trainer(
        model_fn, losses.from_name("apl"), optimizers.adam(0.05), devices=ONE_DEVICE
    )
    compiled = []
    trainer.on_exec_creation(compiled.append)
    data = loopax.ArrayDataset(x, y, 32, loop_forever=True)
    before = trainer.evaluate(loopax.ArrayDataset(x, y, 32))["mean_loss"]
    loopax.Loop(trainer).run_steps(data, 60)
    after = trainer.evaluate(loopax.ArrayDataset(x, y, 32))["mean_loss"]
    assert np.isfinite(after)
    assert after < 0.5 * before
    assert [info.graph_type for info in compiled] == ["eval", "train"]
