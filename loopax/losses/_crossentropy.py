"""Cross-entropy losses: binary, categorical and sparse categorical, on probabilities or logits.

The `_logits` variants are the numerically stable ones (finite for logits of +-1e4); the
probability variants clip predictions to `[EPSILON, 1 - EPSILON]` so that `log(0)` never
happens.

Masks, weights and the result's dtype: see `loopax.losses`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from ._weights import (
    check_same_shape,
    compute_dtype,
    reduce_loss,
    result_dtype,
    unpack,
)

# Same clipping as Keras and GoMLX; probabilities are clipped in float32 (or wider), where
# 1 - 1e-7 is still below 1.
EPSILON = 1e-7


def _check_class_axis(loss_name: str, predictions: jax.Array) -> None:
    if predictions.ndim == 0:
        raise ValueError(f"{loss_name}: predictions must have a trailing class axis, got a scalar")


def binary_crossentropy(labels: Sequence[jax.Array], predictions: Sequence[jax.Array]) -> jax.Array:
    """Binary cross-entropy of probabilities: `-(y log p + (1 - y) log(1 - p))`.

    `p` is clipped to `[1e-7, 1 - 1e-7]`, so a prediction of exactly 0 or 1 gives a large
    but finite loss. Prefer `binary_crossentropy_logits` when the model outputs logits.

    Args:
        labels: `[targets, *extras]`: targets in [0, 1] (float or int); `extras` may be a
            bool mask and/or float weights of the targets' shape.
        predictions: `[probabilities]`, the same shape as the targets.

    Returns:
        The scalar loss (dtype, masks and weights: see the module docs).

    Raises:
        ValueError: if shapes differ or an extra label has an unexpected shape or dtype.

    Example:
        >>> import jax.numpy as jnp
        >>> from loopax.losses import binary_crossentropy
        >>> loss = binary_crossentropy([jnp.array([1.0, 0.0])], [jnp.array([0.5, 0.5])])
        >>> round(float(loss), 4)  # log(2)
        0.6931
    """
    loss_name = "binary_crossentropy"
    target, prediction, extras = unpack(loss_name, labels, predictions)
    check_same_shape(loss_name, target, prediction)
    dtype = compute_dtype(prediction)
    target = target.astype(dtype)
    probability = jnp.clip(prediction.astype(dtype), EPSILON, 1 - EPSILON)
    per_element = -(target * jnp.log(probability) + (1 - target) * jnp.log1p(-probability))
    allowed_shapes = {target.shape: "labels' shape"}
    return reduce_loss(loss_name, per_element, extras, allowed_shapes, result_dtype(prediction))


def binary_crossentropy_logits(
    labels: Sequence[jax.Array], predictions: Sequence[jax.Array]
) -> jax.Array:
    """Binary cross-entropy of logits, computed stably: `max(x, 0) - x y + log1p(exp(-|x|))`.

    Equal to `binary_crossentropy` on `sigmoid(x)`, but without overflow or `log(0)` for
    large logits (finite and exact for +-1e4).

    Args:
        labels: `[targets, *extras]`: targets in [0, 1] (float or int); `extras` may be a
            bool mask and/or float weights of the targets' shape.
        predictions: `[logits]`, the same shape as the targets.

    Returns:
        The scalar loss (dtype, masks and weights: see the module docs).

    Raises:
        ValueError: if shapes differ or an extra label has an unexpected shape or dtype.

    Example:
        >>> import jax.numpy as jnp
        >>> from loopax.losses import binary_crossentropy_logits
        >>> loss = binary_crossentropy_logits([jnp.array([1.0])], [jnp.array([1e4])])
        >>> float(loss)
        0.0
    """
    loss_name = "binary_crossentropy_logits"
    target, prediction, extras = unpack(loss_name, labels, predictions)
    check_same_shape(loss_name, target, prediction)
    dtype = compute_dtype(prediction)
    target = target.astype(dtype)
    logits = prediction.astype(dtype)
    # softplus(x) = log(1 + e^x) = max(x, 0) + log1p(exp(-|x|)), computed stably by
    # logaddexp, and with the right gradient sigmoid(x) - y everywhere: the max/abs form
    # has the kinks of max and abs at 0, where JAX's gradient came out as -y.
    per_element = jax.nn.softplus(logits) - logits * target
    allowed_shapes = {target.shape: "labels' shape"}
    return reduce_loss(loss_name, per_element, extras, allowed_shapes, result_dtype(prediction))


def _categorical(
    loss_name: str,
    labels: Sequence[jax.Array],
    predictions: Sequence[jax.Array],
    log_probabilities_fn,
) -> jax.Array:
    """`-sum_last(y * log_probabilities_fn(predictions))`, reduced over all but the last axis."""
    target, prediction, extras = unpack(loss_name, labels, predictions)
    _check_class_axis(loss_name, prediction)
    check_same_shape(loss_name, target, prediction)
    dtype = compute_dtype(prediction)
    target = target.astype(dtype)
    log_probabilities = log_probabilities_fn(prediction.astype(dtype))
    # `where` keeps 0 * log(p) at 0 even for logits of -inf (a common way to mask classes).
    per_example = jnp.sum(jnp.where(target == 0, 0, -target * log_probabilities), axis=-1)
    allowed_shapes = {target.shape[:-1]: "labels' shape without the last (class) axis"}
    return reduce_loss(loss_name, per_example, extras, allowed_shapes, result_dtype(prediction))


def categorical_crossentropy(
    labels: Sequence[jax.Array], predictions: Sequence[jax.Array]
) -> jax.Array:
    """Categorical cross-entropy of probabilities: `-sum_last(y * log(clip(p)))`.

    `p` is clipped to `[1e-7, 1 - 1e-7]` so that `log(0)` never happens. Prefer
    `categorical_crossentropy_logits` when the model outputs logits.

    Args:
        labels: `[targets, *extras]`: targets are one-hot (or soft) distributions over the
            last axis; `extras` may be a bool mask and/or float weights of the targets'
            shape without the last axis (one per example).
        predictions: `[probabilities]`, the same shape as the targets.

    Returns:
        The scalar loss: the mean of the per-example cross-entropies (see the module docs).

    Raises:
        ValueError: if shapes differ, the predictions are a scalar, or an extra label has an
            unexpected shape or dtype.

    Example:
        >>> import jax.numpy as jnp
        >>> from loopax.losses import categorical_crossentropy
        >>> loss = categorical_crossentropy([jnp.array([[0.0, 1.0]])], [jnp.array([[0.5, 0.5]])])
        >>> round(float(loss), 4)  # log(2)
        0.6931
    """
    return _categorical(
        "categorical_crossentropy",
        labels,
        predictions,
        lambda probabilities: jnp.log(jnp.clip(probabilities, EPSILON, 1 - EPSILON)),
    )


def categorical_crossentropy_logits(
    labels: Sequence[jax.Array], predictions: Sequence[jax.Array]
) -> jax.Array:
    """Categorical cross-entropy of logits: `-sum_last(y * log_softmax(x))`, computed stably.

    Args:
        labels: `[targets, *extras]`: targets are one-hot (or soft) distributions over the
            last axis; `extras` may be a bool mask and/or float weights of the targets'
            shape without the last axis (one per example).
        predictions: `[logits]`, the same shape as the targets.

    Returns:
        The scalar loss: the mean of the per-example cross-entropies (see the module docs).

    Raises:
        ValueError: if shapes differ, the predictions are a scalar, or an extra label has an
            unexpected shape or dtype.

    Example:
        >>> import jax.numpy as jnp
        >>> from loopax.losses import categorical_crossentropy_logits
        >>> one_hot = jnp.array([[0.0, 1.0]])
        >>> float(categorical_crossentropy_logits([one_hot], [jnp.array([[-1e4, 1e4]])]))
        0.0
    """
    return _categorical(
        "categorical_crossentropy_logits",
        labels,
        predictions,
        lambda logits: jax.nn.log_softmax(logits, axis=-1),
    )


def sparse_categorical_crossentropy_logits(
    labels: Sequence[jax.Array], predictions: Sequence[jax.Array]
) -> jax.Array:
    """Categorical cross-entropy of logits against integer class labels.

    Per example, the loss is `-log_softmax(logits)[label]`, computed stably.

    Args:
        labels: `[class_ids, *extras]`: integer class ids in `[0, num_classes)`, of shape
            `[...]` or `[..., 1]` where the logits are `[..., num_classes]`; `extras` may be
            a bool mask and/or float weights of shape `[...]` (one per example).
        predictions: `[logits]` of shape `[..., num_classes]`.

    Returns:
        The scalar loss in the predictions' dtype (accumulated in float32): the mean over
        examples. With a mask, the mean is over the masked-in examples only, and 0 if none
        is. A class id outside `[0, num_classes)` makes the loss NaN rather than silently
        wrong.

    Raises:
        ValueError: if the labels are not integers, their shape does not match the logits,
            or an extra label has an unexpected shape or dtype.

    Example:
        >>> import jax.numpy as jnp
        >>> from loopax.losses import sparse_categorical_crossentropy_logits
        >>> logits = jnp.array([[0.0, 0.0], [0.0, 0.0]])
        >>> class_ids = jnp.array([[1], [0]])
        >>> loss = sparse_categorical_crossentropy_logits([class_ids], [logits])
        >>> round(float(loss), 4)  # log(2)
        0.6931
    """
    loss_name = "sparse_categorical_crossentropy_logits"
    class_ids, prediction, extras = unpack(loss_name, labels, predictions)
    _check_class_axis(loss_name, prediction)
    example_shape = prediction.shape[:-1]
    if not jnp.issubdtype(class_ids.dtype, jnp.integer):
        raise ValueError(
            f"{loss_name}: labels must be integer class ids, got dtype {class_ids.dtype}; "
            "use categorical_crossentropy_logits for one-hot or soft float labels"
        )
    if class_ids.shape == example_shape + (1,):
        class_ids = class_ids[..., 0]
    elif class_ids.shape != example_shape:
        raise ValueError(
            f"{loss_name}: labels shape {class_ids.shape} does not match logits shape "
            f"{prediction.shape}; expected {example_shape} or {example_shape + (1,)}"
        )
    log_probabilities = jax.nn.log_softmax(prediction.astype(compute_dtype(prediction)), axis=-1)
    num_classes = prediction.shape[-1]
    in_range = (class_ids >= 0) & (class_ids < num_classes)
    gathered = jnp.take_along_axis(
        log_probabilities, jnp.clip(class_ids, 0, num_classes - 1)[..., None], axis=-1
    )[..., 0]
    # An out-of-range class id is a data bug: make it a visible NaN, not a clamped class.
    per_example = jnp.where(in_range, -gathered, jnp.nan)
    allowed_shapes = {example_shape: "logits' shape without the last (class) axis"}
    return reduce_loss(loss_name, per_example, extras, allowed_shapes, result_dtype(prediction))
