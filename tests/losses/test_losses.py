"""Tests for `loopax.losses`: each loss against an independent NumPy (float64) reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import loopax.losses as losses

RNG = np.random.default_rng(0)
BATCH, FEATURES, CLASSES = 4, 3, 5
EPS = 1e-7


# ---------------------------------------------------------------------------------------
# Independent references, in float64 NumPy.


def _log_softmax(logits):
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _log_sigmoid(logits):
    return -np.logaddexp(0.0, -np.asarray(logits, np.float64))


def ref_mse(y, p):
    return (np.float64(y) - p) ** 2


def ref_mae(y, p):
    return np.abs(np.float64(y) - p)


def ref_huber(delta):
    def per_element(y, p):
        abs_error = np.abs(np.float64(y) - p)
        return np.where(abs_error <= delta, 0.5 * abs_error**2, delta * (abs_error - 0.5 * delta))

    return per_element


def ref_bce(y, p):
    p = np.clip(np.float64(p), EPS, 1 - EPS)
    return -(y * np.log(p) + (1 - y) * np.log(1 - p))


def ref_bce_logits(y, x):
    return -(y * _log_sigmoid(x) + (1 - y) * _log_sigmoid(-np.float64(x)))


def ref_cce(y, p):
    return -(y * np.log(np.clip(np.float64(p), EPS, 1 - EPS))).sum(axis=-1)


def ref_cce_logits(y, x):
    return -(y * _log_softmax(x)).sum(axis=-1)


def ref_sparse(class_ids, x):
    class_ids = np.asarray(class_ids).reshape(np.shape(x)[:-1])
    return -np.take_along_axis(_log_softmax(x), class_ids[..., None], axis=-1)[..., 0]


def ref_mean(per_element, weights=None, mask=None):
    per_element = np.asarray(per_element, np.float64)

    def expand(extra):
        extra = np.asarray(extra)
        return extra.reshape(extra.shape + (1,) * (per_element.ndim - extra.ndim))

    if weights is not None:
        per_element = per_element * expand(weights)
    if mask is None:
        return per_element.mean()
    mask = np.broadcast_to(expand(mask), per_element.shape)
    return per_element[mask].sum() / max(mask.sum(), 1)


# ---------------------------------------------------------------------------------------
# Inputs: (labels, predictions, weights/mask shape) for each loss.


def _regression_inputs():
    y = RNG.normal(size=(BATCH, FEATURES)).astype(np.float32)
    p = (y + RNG.normal(scale=2.0, size=y.shape)).astype(np.float32)
    return y, p, y.shape


def _binary_inputs():
    y = RNG.integers(0, 2, size=(BATCH, FEATURES)).astype(np.float32)
    p = RNG.uniform(0.01, 0.99, size=y.shape).astype(np.float32)
    return y, p, y.shape


def _binary_logits_inputs():
    y = RNG.uniform(0, 1, size=(BATCH, FEATURES)).astype(np.float32)
    x = RNG.normal(scale=3.0, size=y.shape).astype(np.float32)
    return y, x, y.shape


def _categorical_inputs():
    y = np.eye(CLASSES, dtype=np.float32)[RNG.integers(0, CLASSES, size=(BATCH, 2))]
    p = RNG.dirichlet(np.ones(CLASSES), size=(BATCH, 2)).astype(np.float32)
    return y, p, (BATCH, 2)


def _categorical_logits_inputs():
    y = RNG.dirichlet(np.ones(CLASSES), size=(BATCH, 2)).astype(np.float32)
    x = RNG.normal(scale=3.0, size=(BATCH, 2, CLASSES)).astype(np.float32)
    return y, x, (BATCH, 2)


def _sparse_inputs():
    y = RNG.integers(0, CLASSES, size=(BATCH, 2, 1)).astype(np.int32)
    x = RNG.normal(scale=3.0, size=(BATCH, 2, CLASSES)).astype(np.float32)
    return y, x, (BATCH, 2)


CASES = {
    "mean_squared_error": (losses.mean_squared_error, ref_mse, _regression_inputs),
    "mean_absolute_error": (losses.mean_absolute_error, ref_mae, _regression_inputs),
    "huber": (losses.huber(), ref_huber(1.0), _regression_inputs),
    "huber_delta_0.5": (losses.huber(delta=0.5), ref_huber(0.5), _regression_inputs),
    "binary_crossentropy": (losses.binary_crossentropy, ref_bce, _binary_inputs),
    "binary_crossentropy_logits": (
        losses.binary_crossentropy_logits,
        ref_bce_logits,
        _binary_logits_inputs,
    ),
    "categorical_crossentropy": (
        losses.categorical_crossentropy,
        ref_cce,
        _categorical_inputs,
    ),
    "categorical_crossentropy_logits": (
        losses.categorical_crossentropy_logits,
        ref_cce_logits,
        _categorical_logits_inputs,
    ),
    "sparse_categorical_crossentropy_logits": (
        losses.sparse_categorical_crossentropy_logits,
        ref_sparse,
        _sparse_inputs,
    ),
}
REGRESSION = ["mean_squared_error", "mean_absolute_error", "huber", "huber_delta_0.5"]


def _mask(shape):
    mask = RNG.uniform(size=shape) < 0.5
    mask.flat[0] = True  # at least one masked-in entry
    mask.flat[-1] = False  # at least one masked-out entry
    return mask


def _weights(shape):
    return RNG.uniform(0.0, 2.0, size=shape).astype(np.float32)


def _assert_close(actual, expected, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("extras", ["none", "mask", "weights", "mask_weights", "weights_mask"])
def test_matches_reference(case, extras):
    loss_fn, reference, make_inputs = CASES[case]
    y, p, extra_shape = make_inputs()
    mask = _mask(extra_shape) if "mask" in extras else None
    weights = _weights(extra_shape) if "weights" in extras else None
    extra_labels = {
        "none": [],
        "mask": [mask],
        "weights": [weights],
        "mask_weights": [mask, weights],
        "weights_mask": [weights, mask],
    }[extras]

    loss = loss_fn([jnp.asarray(y), *map(jnp.asarray, extra_labels)], [jnp.asarray(p)])

    assert loss.shape == () and loss.dtype == jnp.float32
    _assert_close(loss, ref_mean(reference(y, p), weights=weights, mask=mask))


@pytest.mark.parametrize("case", REGRESSION)
@pytest.mark.parametrize("extras", ["mask", "weights", "mask_weights"])
def test_regression_accepts_batch_shaped_weights_and_mask(case, extras):
    loss_fn, reference, make_inputs = CASES[case]
    y, p, _ = make_inputs()
    mask = _mask((BATCH,)) if "mask" in extras else None
    weights = _weights((BATCH,)) if "weights" in extras else None
    extra_labels = [extra for extra in (mask, weights) if extra is not None]

    loss = loss_fn([y, *extra_labels], [p])

    # The mean is over masked-in elements: each masked-in example counts FEATURES times.
    _assert_close(loss, ref_mean(reference(y, p), weights=weights, mask=mask))


@pytest.mark.parametrize("case", sorted(CASES))
def test_all_masked_out_is_zero_not_nan(case):
    loss_fn, _, make_inputs = CASES[case]
    y, p, extra_shape = make_inputs()
    loss = loss_fn([y, np.zeros(extra_shape, bool), _weights(extra_shape)], [p])
    assert float(loss) == 0.0


def test_masked_out_entries_are_dropped_even_if_not_finite():
    y = np.array([1.0, 2.0, 3.0], np.float32)
    p = np.array([1.5, np.inf, np.nan], np.float32)
    loss = losses.mean_squared_error([y, np.array([True, False, False])], [p])
    _assert_close(loss, 0.25)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("bad", ["wrong_shape", "int_dtype", "two_masks", "three_extras"])
def test_bad_extra_labels_raise(case, bad):
    loss_fn, _, make_inputs = CASES[case]
    y, p, extra_shape = make_inputs()
    wrong_shape = extra_shape[:-1] + (extra_shape[-1] + 1,)
    extra_labels = {
        "wrong_shape": [np.ones(wrong_shape, np.float32)],
        "int_dtype": [np.ones(extra_shape, np.int32)],
        "two_masks": [np.ones(extra_shape, bool), np.ones(extra_shape, bool)],
        "three_extras": [np.ones(extra_shape, bool), _weights(extra_shape), _weights(extra_shape)],
    }[bad]
    with pytest.raises(ValueError) as error:
        loss_fn([y, *extra_labels], [p])
    if bad in ("wrong_shape", "int_dtype"):
        # The message names the culprit and the expected shapes.
        assert str(extra_shape) in str(error.value)
        assert "labels[1]" in str(error.value)


@pytest.mark.parametrize(
    "case", ["binary_crossentropy", "binary_crossentropy_logits", "categorical_crossentropy"]
)
def test_batch_shaped_weights_are_rejected_where_not_documented(case):
    loss_fn, _, make_inputs = CASES[case]
    y, p, extra_shape = make_inputs()
    with pytest.raises(ValueError, match="expected a bool mask or float weights"):
        loss_fn([y, _weights(extra_shape[:-1] + (7,))], [p])


@pytest.mark.parametrize("case", sorted(CASES))
def test_labels_and_predictions_must_be_lists(case):
    loss_fn, _, make_inputs = CASES[case]
    y, p, _ = make_inputs()
    with pytest.raises(ValueError, match="must be lists"):
        loss_fn(jnp.asarray(y), [p])
    with pytest.raises(ValueError, match="at least one"):
        loss_fn([], [p])


@pytest.mark.parametrize("case", [c for c in sorted(CASES) if not c.startswith("sparse")])
def test_shape_mismatch_raises(case):
    loss_fn, _, make_inputs = CASES[case]
    y, p, _ = make_inputs()
    with pytest.raises(ValueError, match="differs from predictions shape"):
        loss_fn([y[..., :1]], [p])


def test_unflattened_images_are_named_as_an_extra_axis_of_the_predictions():
    import flax.linen as nn

    import loopax

    def model_fn(ctx, spec, inputs):  # Dense acts on the last axis: rows stay
        return nn.Dense(10)(inputs[0])

    images = np.zeros((64, 8, 8), np.float32)  # the digits, not flattened to (64, 64)
    class_ids = np.zeros((64,), np.int32)
    trainer = loopax.Trainer(
        model_fn,
        losses.sparse_categorical_crossentropy_logits,
        loopax.optimizers.sgd(0.1),
        devices=jax.devices()[:1],
    )
    with pytest.raises(ValueError) as raised:
        trainer.train_step(None, [images], [class_ids])
    message = str(raised.value)
    assert "the predictions have an extra axis: shape (64, 8, 10), where labels of shape " in (
        message
    )
    assert "(64,) call for (64, 10)" in message and "flatten the inputs" in message
    assert "does not match" not in message  # the old message, which blamed the labels
    # Class ids with a trailing axis of 1, one-hot labels and element-wise losses alike.
    logits = jnp.zeros((64, 8, 10))
    with pytest.raises(ValueError, match=r"\(64, 1\) call for \(64, 10\)\. The model likely"):
        losses.sparse_categorical_crossentropy_logits([class_ids[:, None]], [logits])
    with pytest.raises(ValueError, match=r"have an extra axis: shape \(64, 8, 10\), where"):
        losses.categorical_crossentropy_logits([jnp.zeros((64, 10))], [logits])
    with pytest.raises(ValueError, match=r"have 2 extra axes: shape \(64, 8, 8, 1\), where"):
        losses.mean_squared_error([jnp.zeros((64, 1))], [jnp.zeros((64, 8, 8, 1))])
    # Shapes that differ otherwise keep the message that names both.
    with pytest.raises(ValueError, match=r"labels shape \(64, 3\) does not match logits"):
        losses.sparse_categorical_crossentropy_logits([np.zeros((64, 3), np.int32)], [logits])


# ---------------------------------------------------------------------------------------
# Numerical stability and dtypes.

EXTREME_LOGITS = np.array([-1e4, -50.0, 0.0, 50.0, 1e4], np.float32)


def test_binary_logits_extreme_values_are_finite_and_correct():
    for target in (0.0, 0.3, 1.0):
        y = np.full_like(EXTREME_LOGITS, target)
        loss = losses.binary_crossentropy_logits([y], [EXTREME_LOGITS])
        assert np.isfinite(float(loss))
        _assert_close(loss, ref_bce_logits(y, EXTREME_LOGITS).mean(), rtol=1e-6)
    per_element = [
        float(losses.binary_crossentropy_logits([np.float32([1.0])], [np.float32([x])]))
        for x in (1e4, -1e4)
    ]
    assert per_element == [0.0, 1e4]


def test_binary_logits_gradient_is_finite_for_extreme_logits():
    y = np.array([0.0, 1.0, 0.0, 1.0, 1.0], np.float32)
    grad = jax.grad(lambda x: losses.binary_crossentropy_logits([y], [x]))(EXTREME_LOGITS)
    assert np.all(np.isfinite(grad))


@pytest.mark.parametrize("target", [0.0, 0.3, 1.0])
def test_binary_logits_gradient_is_sigmoid_minus_label_everywhere(target):
    # At logit 0 too, where a max/abs formulation has kinks (its JAX gradient was -y).
    logits = np.array([-30.0, -2.0, -1e-3, 0.0, 1e-3, 2.0, 30.0], np.float32)
    y = np.full_like(logits, target)
    grad = jax.grad(lambda x: losses.binary_crossentropy_logits([y], [x]))(logits)
    expected = (1.0 / (1.0 + np.exp(-logits.astype(np.float64))) - target) / len(logits)
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-7)


def test_categorical_logits_extreme_values_are_finite_and_correct():
    logits = np.array([[1e4, -1e4, 0.0], [-1e4, -1e4, 1e4], [1e4, 1e4, -1e4]], np.float32)
    one_hot = np.eye(3, dtype=np.float32)[[1, 2, 0]]
    loss = losses.categorical_crossentropy_logits([one_hot], [logits])
    assert np.isfinite(float(loss))
    _assert_close(loss, ref_cce_logits(one_hot, logits).mean(), rtol=1e-6)
    sparse = losses.sparse_categorical_crossentropy_logits([np.array([1, 2, 0])], [logits])
    _assert_close(sparse, ref_sparse(np.array([1, 2, 0]), logits).mean(), rtol=1e-6)
    grad = jax.grad(lambda x: losses.categorical_crossentropy_logits([one_hot], [x]))(logits)
    assert np.all(np.isfinite(grad))


def test_categorical_logits_tolerates_minus_inf_for_unused_classes():
    logits = np.array([[0.0, 0.0, -np.inf]], np.float32)
    one_hot = np.array([[1.0, 0.0, 0.0]], np.float32)
    _assert_close(losses.categorical_crossentropy_logits([one_hot], [logits]), np.log(2))


@pytest.mark.parametrize("loss_fn", [losses.binary_crossentropy, losses.categorical_crossentropy])
def test_probabilities_of_exactly_zero_and_one_are_clipped(loss_fn):
    p = np.array([[0.0, 1.0], [1.0, 0.0]], np.float32)
    y = np.array([[1.0, 0.0], [1.0, 0.0]], np.float32)
    loss = loss_fn([y], [p])
    assert np.isfinite(float(loss))
    assert float(loss) > 1.0  # a confident wrong prediction costs about -log(1e-7) / n


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_low_precision_predictions_keep_their_dtype(case, dtype):
    loss_fn, _, make_inputs = CASES[case]
    y, p, extra_shape = make_inputs()
    extras = [_mask(extra_shape), _weights(extra_shape)]
    full = loss_fn([y, *extras], [p])
    low = loss_fn([y, *extras], [jnp.asarray(p, dtype)])
    assert low.dtype == dtype
    _assert_close(low, float(full), rtol=3e-2, atol=3e-2)


def test_low_precision_computes_in_float32():
    # An error of 1000 squares to 1e6, past float16's maximum of 65504; the mean does not.
    y = jnp.zeros((100,), jnp.float16)
    p = y.at[0].set(1000.0)
    loss = losses.mean_squared_error([y], [p])
    assert loss.dtype == jnp.float16
    assert float(loss) == 10000.0


# ---------------------------------------------------------------------------------------
# huber, sparse labels, from_name.


@pytest.mark.parametrize("delta", [0.0, -1.0, float("nan")])
def test_huber_rejects_non_positive_delta(delta):
    with pytest.raises(ValueError, match="delta must be positive"):
        losses.huber(delta=delta)


def test_huber_is_quadratic_then_linear():
    loss_fn = losses.huber(delta=2.0)
    y = np.zeros(1, np.float32)
    _assert_close(loss_fn([y], [np.float32([1.0])]), 0.5)
    _assert_close(loss_fn([y], [np.float32([-5.0])]), 2.0 * (5.0 - 1.0))


def test_sparse_labels_with_and_without_trailing_axis_agree():
    _, x, _ = _sparse_inputs()
    class_ids = RNG.integers(0, CLASSES, size=(BATCH, 2))
    with_axis = losses.sparse_categorical_crossentropy_logits([class_ids[..., None]], [x])
    without_axis = losses.sparse_categorical_crossentropy_logits([class_ids], [x])
    _assert_close(with_axis, float(without_axis), rtol=0, atol=0)
    _assert_close(without_axis, ref_sparse(class_ids, x).mean())


def test_sparse_labels_must_be_integers_of_matching_shape():
    _, x, _ = _sparse_inputs()
    with pytest.raises(ValueError, match="integer class ids"):
        losses.sparse_categorical_crossentropy_logits([np.zeros((BATCH, 2), np.float32)], [x])
    with pytest.raises(ValueError, match=r"expected \(4, 2\) or \(4, 2, 1\)"):
        losses.sparse_categorical_crossentropy_logits([np.zeros((BATCH, 2, 2), np.int32)], [x])


def test_sparse_out_of_range_class_is_nan_unless_masked_out():
    x = np.zeros((3, CLASSES), np.float32)
    class_ids = np.array([0, -1, CLASSES])
    assert np.isnan(float(losses.sparse_categorical_crossentropy_logits([class_ids], [x])))
    mask = np.array([True, False, False])
    _assert_close(
        losses.sparse_categorical_crossentropy_logits([class_ids, mask], [x]), np.log(CLASSES)
    )


FULL_NAMES = {
    "mse": "mean_squared_error",
    "mae": "mean_absolute_error",
    "bin_cross": "binary_crossentropy",
    "bin_cross_logits": "binary_crossentropy_logits",
    "categorical_cross": "categorical_crossentropy",
    "categorical_cross_logits": "categorical_crossentropy_logits",
    "sparse_cross_logits": "sparse_categorical_crossentropy_logits",
}


@pytest.mark.parametrize("short_name", sorted(FULL_NAMES))
def test_from_name_round_trip(short_name):
    full_name = FULL_NAMES[short_name]
    loss_fn = getattr(losses, full_name)
    assert losses.from_name(short_name) is loss_fn
    assert losses.from_name(full_name) is loss_fn
    assert losses.from_name(loss_fn.__name__) is loss_fn


def test_from_name_huber_takes_delta():
    y, p, _ = _regression_inputs()
    _assert_close(losses.from_name("huber")([y], [p]), ref_huber(1.0)(y, p).mean())
    _assert_close(losses.from_name("huber", delta=0.3)([y], [p]), ref_huber(0.3)(y, p).mean())
    with pytest.raises(ValueError, match="delta must be positive"):
        losses.from_name("huber", delta=0)
    with pytest.raises(ValueError, match="invalid parameters"):
        losses.from_name("huber", alpha=1.0)


def test_from_name_unknown_lists_valid_names():
    with pytest.raises(ValueError, match="unknown loss name 'msee'") as error:
        losses.from_name("msee")
    for name in [*FULL_NAMES, "huber", *FULL_NAMES.values()]:
        assert repr(name) in str(error.value)


def test_from_name_rejects_parameters_for_unparameterized_loss():
    with pytest.raises(ValueError, match="takes no parameters"):
        losses.from_name("mse", delta=1.0)


# ---------------------------------------------------------------------------------------
# Compilation.


@pytest.mark.parametrize("case", sorted(CASES))
def test_jit_matches_eager_and_compiles_once(case):
    loss_fn, _, make_inputs = CASES[case]
    traces = []

    @jax.jit
    def step(labels, predictions):
        traces.append(1)
        return loss_fn(labels, predictions)

    for _ in range(2):
        y, p, extra_shape = make_inputs()
        labels = [jnp.asarray(extra) for extra in (y, _weights(extra_shape), _mask(extra_shape))]
        _assert_close(step(labels, [jnp.asarray(p)]), float(loss_fn(labels, [p])))
    assert len(traces) == 1


def test_public_api():
    assert losses.__all__ == sorted(losses.__all__)
    assert set(losses.__all__) == {
        "adaptive_power_loss",
        "binary_crossentropy",
        "binary_crossentropy_logits",
        "categorical_crossentropy",
        "categorical_crossentropy_logits",
        "from_name",
        "huber",
        "mean_absolute_error",
        "mean_squared_error",
        "sparse_categorical_crossentropy_logits",
        "triplet",
    }
    for name in losses.__all__:
        doc = getattr(losses, name).__doc__
        assert doc and all(section in doc for section in ("Args:", "Returns:", "Example:"))
