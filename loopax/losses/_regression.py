"""Regression losses: mean squared error, mean absolute error and Huber.

Masks, weights, the result and the errors raised: see `loopax.losses`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from ._weights import (
    LossFn,
    check_same_shape,
    compute_dtype,
    reduce_loss,
    result_dtype,
    unpack,
)


def _elementwise_loss(
    loss_name: str,
    labels: Sequence[jax.Array],
    predictions: Sequence[jax.Array],
    per_element_fn,
) -> jax.Array:
    """Runs `per_element_fn(error)` on `predictions - labels` and reduces it.

    Weights and masks may have the labels' shape or `[batch]`.
    """
    target, prediction, extras = unpack(loss_name, labels, predictions)
    check_same_shape(loss_name, target, prediction)
    dtype = compute_dtype(prediction)
    error = prediction.astype(dtype) - target.astype(dtype)
    allowed_shapes = {target.shape: "labels' shape", target.shape[:1]: "[batch]"}
    return reduce_loss(
        loss_name, per_element_fn(error), extras, allowed_shapes, result_dtype(prediction)
    )


def mean_squared_error(labels: Sequence[jax.Array], predictions: Sequence[jax.Array]) -> jax.Array:
    """Mean of the squared error `(labels[0] - predictions[0]) ** 2`.

    Args:
        labels: `[targets, *extras]`, extras of the targets' shape or `[batch]`.
        predictions: `[predictions]`, the targets' shape.

    Returns:
        The mean squared error.

    Example:
        >>> import jax.numpy as jnp
        >>> from loopax.losses import mean_squared_error
        >>> float(mean_squared_error([jnp.array([1.0, 2.0])], [jnp.array([1.0, 4.0])]))
        2.0
    """
    return _elementwise_loss("mean_squared_error", labels, predictions, jnp.square)


def mean_absolute_error(labels: Sequence[jax.Array], predictions: Sequence[jax.Array]) -> jax.Array:
    """Mean of the absolute error `abs(labels[0] - predictions[0])`.

    Args:
        labels: as for `mean_squared_error`.
        predictions: `[predictions]`, the targets' shape.

    Returns:
        The mean absolute error; outliers weigh less than in `mean_squared_error`.

    Example:
        >>> import jax.numpy as jnp
        >>> from loopax.losses import mean_absolute_error
        >>> mask = jnp.array([True, False])
        >>> float(mean_absolute_error([jnp.array([1.0, 2.0]), mask], [jnp.array([4.0, 0.0])]))
        3.0
    """
    return _elementwise_loss("mean_absolute_error", labels, predictions, jnp.abs)


def huber(delta: float = 1.0) -> LossFn:
    """Returns the Huber loss: quadratic for errors up to `delta`, linear beyond.

    Per element, with `e = labels[0] - predictions[0]` and `q = min(abs(e), delta)`, the
    loss is `0.5 * q**2 + delta * (abs(e) - q)`: smooth like the squared error near zero,
    robust to outliers like the absolute error.

    Args:
        delta: where the loss turns from quadratic to linear; must be positive.

    Returns:
        A LossFn `loss_fn(labels, predictions) -> scalar`. Extra labels may be a bool mask
        and/or float weights of the labels' shape or `[batch]`.

    Raises:
        ValueError: if `delta` is not positive (raised here, not when the loss runs).

    Example:
        >>> import jax.numpy as jnp
        >>> from loopax.losses import huber
        >>> loss_fn = huber(delta=1.0)
        >>> float(loss_fn([jnp.array([0.0, 0.0])], [jnp.array([0.5, 3.0])]))
        1.3125
    """
    # `not delta > 0` also rejects NaN.
    if not delta > 0:
        raise ValueError(
            f"huber: delta must be positive, got delta={delta!r}; use e.g. huber(delta=1.0)"
        )
    delta = float(delta)

    def per_element(error: jax.Array) -> jax.Array:
        abs_error = jnp.abs(error)
        quadratic = jnp.minimum(abs_error, delta)
        return 0.5 * quadratic**2 + delta * (abs_error - quadratic)

    def huber_loss(labels: Sequence[jax.Array], predictions: Sequence[jax.Array]) -> jax.Array:
        return _elementwise_loss("huber", labels, predictions, per_element)

    huber_loss.__name__ = huber_loss.__qualname__ = "huber"
    huber_loss.__doc__ = f"Huber loss with delta={delta:g} (see `loopax.losses.huber`)."
    return huber_loss
