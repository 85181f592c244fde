"""Cross-entropy losses: binary, categorical and sparse categorical, on probabilities or logits.

The `_logits` variants are the numerically stable ones (finite for logits of +-1e4); the
probability variants clip predictions to `[EPSILON, 1 - EPSILON]` so that `log(0)` never
happens.

Masks, weights, the result and the errors raised: see `loopax.losses`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from ._weights import (
    check_same_shape,
    compute_dtype,
    extra_axes_message,
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


def _cross_entropy(
    loss_name: str,
    labels: Sequence[jax.Array],
    predictions: Sequence[jax.Array],
    per_element_fn,
    class_axis: bool,
) -> jax.Array:
    """Reduces `per_element_fn(targets, predictions)`, both cast to the compute dtype.

    With `class_axis`, the last axis holds the classes: it is summed first, so the mean and
    the extra labels are per example.
    """
    target, prediction, extras = unpack(loss_name, labels, predictions)
    if class_axis:
        _check_class_axis(loss_name, prediction)
    check_same_shape(loss_name, target, prediction)
    dtype = compute_dtype(prediction)
    loss = per_element_fn(target.astype(dtype), prediction.astype(dtype))
    if class_axis:
        loss = jnp.sum(loss, axis=-1)
        allowed_shapes = {target.shape[:-1]: "labels' shape without the last (class) axis"}
    else:
        allowed_shapes = {target.shape: "labels' shape"}
    return reduce_loss(loss_name, loss, extras, allowed_shapes, result_dtype(prediction))


def _per_class(log_probabilities_fn):
    """`-y * log_probabilities_fn(x)` per class, for `_cross_entropy(class_axis=True)`."""

    def per_element(target: jax.Array, prediction: jax.Array) -> jax.Array:
        # `where` keeps 0 * log(p) at 0 even for logits of -inf (a common way to mask classes).
        return jnp.where(target == 0, 0, -target * log_probabilities_fn(prediction))

    return per_element


def binary_crossentropy(labels: Sequence[jax.Array], predictions: Sequence[jax.Array]) -> jax.Array:
    """Binary cross-entropy of probabilities: `-(y log p + (1 - y) log(1 - p))`.

    `p` is clipped to `[1e-7, 1 - 1e-7]`, so a prediction of exactly 0 or 1 gives a large
    but finite loss. Prefer `binary_crossentropy_logits` when the model outputs logits.

    Args:
        labels: `[targets, *extras]`, targets in [0, 1]; extras of the targets' shape.
        predictions: `[probabilities]`, the targets' shape.

    Returns:
        The mean of the per-element cross-entropies.

    Example:
        >>> import jax.numpy as jnp
        >>> from loopax.losses import binary_crossentropy
        >>> loss = binary_crossentropy([jnp.array([1.0, 0.0])], [jnp.array([0.5, 0.5])])
        >>> round(float(loss), 4)  # log(2)
        0.6931
    """

    def per_element(target: jax.Array, prediction: jax.Array) -> jax.Array:
        probability = jnp.clip(prediction, EPSILON, 1 - EPSILON)
        return -(target * jnp.log(probability) + (1 - target) * jnp.log1p(-probability))

    return _cross_entropy("binary_crossentropy", labels, predictions, per_element, class_axis=False)


def binary_crossentropy_logits(
    labels: Sequence[jax.Array], predictions: Sequence[jax.Array]
) -> jax.Array:
    """Binary cross-entropy of logits, computed stably: `max(x, 0) - x y + log1p(exp(-|x|))`.

    Equal to `binary_crossentropy` on `sigmoid(x)`, but without overflow or `log(0)` for
    large logits (finite and exact for +-1e4).

    Args:
        labels: as for `binary_crossentropy`.
        predictions: `[logits]`, the targets' shape.

    Returns:
        The `binary_crossentropy` of `sigmoid(logits)`, without its clipping.

    Example:
        >>> import jax.numpy as jnp
        >>> from loopax.losses import binary_crossentropy_logits
        >>> loss = binary_crossentropy_logits([jnp.array([1.0])], [jnp.array([1e4])])
        >>> float(loss)
        0.0
    """
    # softplus(x) = log(1 + e^x) = max(x, 0) + log1p(exp(-|x|)), computed stably by
    # logaddexp, and with the right gradient sigmoid(x) - y everywhere: the max/abs form
    # has the kinks of max and abs at 0, where JAX's gradient came out as -y.
    return _cross_entropy(
        "binary_crossentropy_logits",
        labels,
        predictions,
        lambda target, logits: jax.nn.softplus(logits) - logits * target,
        class_axis=False,
    )


def categorical_crossentropy(
    labels: Sequence[jax.Array], predictions: Sequence[jax.Array]
) -> jax.Array:
    """Categorical cross-entropy of probabilities: `-sum_last(y * log(clip(p)))`.

    `p` is clipped to `[1e-7, 1 - 1e-7]` so that `log(0)` never happens. Prefer
    `categorical_crossentropy_logits` when the model outputs logits.

    Args:
        labels: `[targets, *extras]`, targets one-hot (or soft) over the last (class) axis;
            extras of the targets' shape without that axis (one per example).
        predictions: `[probabilities]`, the targets' shape, not a scalar.

    Returns:
        The mean of the per-example cross-entropies.

    Example:
        >>> import jax.numpy as jnp
        >>> from loopax.losses import categorical_crossentropy
        >>> loss = categorical_crossentropy([jnp.array([[0.0, 1.0]])], [jnp.array([[0.5, 0.5]])])
        >>> round(float(loss), 4)  # log(2)
        0.6931
    """
    return _cross_entropy(
        "categorical_crossentropy",
        labels,
        predictions,
        _per_class(lambda probabilities: jnp.log(jnp.clip(probabilities, EPSILON, 1 - EPSILON))),
        class_axis=True,
    )


def categorical_crossentropy_logits(
    labels: Sequence[jax.Array], predictions: Sequence[jax.Array]
) -> jax.Array:
    """Categorical cross-entropy of logits: `-sum_last(y * log_softmax(x))`, computed stably.

    Args:
        labels: as for `categorical_crossentropy`.
        predictions: `[logits]`, the targets' shape, not a scalar.

    Returns:
        The `categorical_crossentropy` of `softmax(logits)`, without its clipping.

    Example:
        >>> import jax.numpy as jnp
        >>> from loopax.losses import categorical_crossentropy_logits
        >>> one_hot = jnp.array([[0.0, 1.0]])
        >>> float(categorical_crossentropy_logits([one_hot], [jnp.array([[-1e4, 1e4]])]))
        0.0
    """
    return _cross_entropy(
        "categorical_crossentropy_logits",
        labels,
        predictions,
        _per_class(lambda logits: jax.nn.log_softmax(logits, axis=-1)),
        class_axis=True,
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
        The mean over examples; NaN if a class id is outside `[0, num_classes)`, rather
        than a silently wrong loss.

    Raises:
        ValueError: if the labels are not integer class ids.

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
        ids_shape = class_ids.shape[:-1] if class_ids.shape[-1:] == (1,) else class_ids.shape
        expected = ids_shape + prediction.shape[-1:]  # one vector of logits per class id
        raise ValueError(
            extra_axes_message(loss_name, class_ids.shape, prediction.shape, expected)
            or f"{loss_name}: labels shape {class_ids.shape} does not match logits shape "
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
