"""Shared plumbing for losses: input checks, optional mask/weights, and the final mean.

Every loss computes its per-element loss in float32 (or wider) and hands it to `reduce_loss`,
which applies the optional extra labels (a boolean mask and/or float weights, told apart by
dtype) and returns the mean cast back to the predictions' dtype. All shape checks run at trace
time, where shapes are static, so they cost nothing per compiled step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

Array = jax.Array

# A loss function: `loss_fn(labels, predictions) -> scalar`.
LossFn = Callable[[Sequence[Array], Sequence[Array]], Array]

# One bool mask and one float weights array.
_MAX_EXTRA_LABELS = 2


def unpack(
    loss_name: str, labels: Sequence[Array], predictions: Sequence[Array]
) -> tuple[Array, Array, list[Array]]:
    """Returns `(labels[0], predictions[0], labels[1:])` as arrays, after checking the lists.

    Raises:
        ValueError: if either argument is not a list, either list is empty, or there are
            more than two extra labels.
    """
    # Arrays are not `Sequence`s: this catches `loss(labels, predictions)` slips that would
    # otherwise silently use the first row as the labels.
    if not isinstance(labels, Sequence) or not isinstance(predictions, Sequence):
        raise ValueError(
            f"{loss_name}: labels and predictions must be lists of arrays, got "
            f"{type(labels).__name__} and {type(predictions).__name__}; "
            f"call it as {loss_name}([labels], [predictions])"
        )
    if len(labels) == 0 or len(predictions) == 0:
        raise ValueError(
            f"{loss_name}: needs at least one label and one prediction, got "
            f"{len(labels)} labels and {len(predictions)} predictions"
        )
    extras = [jnp.asarray(extra) for extra in labels[1:]]
    if len(extras) > _MAX_EXTRA_LABELS:
        raise ValueError(
            f"{loss_name}: got {len(extras)} extra labels after labels[0]; at most "
            f"{_MAX_EXTRA_LABELS} are accepted (one bool mask and/or one float weights array)"
        )
    return jnp.asarray(labels[0]), jnp.asarray(predictions[0]), extras


def compute_dtype(predictions: Array) -> jnp.dtype:
    """The dtype losses accumulate in: float32, or the predictions' dtype if wider."""
    if jnp.issubdtype(predictions.dtype, jnp.floating):
        return jnp.promote_types(predictions.dtype, jnp.float32)
    return jnp.dtype(jnp.float32)


def result_dtype(predictions: Array) -> jnp.dtype:
    """The dtype a loss returns: the predictions' float dtype (float16/bfloat16 preserved)."""
    if jnp.issubdtype(predictions.dtype, jnp.floating):
        return predictions.dtype
    return jnp.dtype(jnp.float32)


def extra_axes_message(
    loss_name: str,
    labels_shape: tuple[int, ...],
    predictions_shape: tuple[int, ...],
    expected_shape: tuple[int, ...],
) -> str | None:
    """Why predictions have more axes than their labels call for, when that is the likely cause.

    That is, the predictions are `expected_shape` (what the labels call for) with axes added
    between the batch axis and the last one: `(64, 8, 10)` where `(64, 10)` fits labels
    `(64,)`. A Dense layer acts on the last axis only, so a model given unflattened images
    `(64, 8, 8)` keeps their rows. None when the shapes differ otherwise.
    """
    extra = len(predictions_shape) - len(expected_shape)
    if (
        len(expected_shape) < 2  # a batch axis and a last axis, at least
        or extra < 1
        or predictions_shape[0] != expected_shape[0]
        or predictions_shape[-1] != expected_shape[-1]
    ):
        return None
    axes = "an extra axis" if extra == 1 else f"{extra} extra axes"
    return (
        f"{loss_name}: the predictions have {axes}: shape {predictions_shape}, where labels "
        f"of shape {labels_shape} call for {expected_shape}. The model likely kept an axis of "
        "its inputs (a Dense layer acts on the last axis only, so images of shape (N, H, W) "
        "give (N, H, units)): flatten the inputs, e.g. x.reshape(len(x), -1) before the "
        "dataset or inputs[0].reshape(inputs[0].shape[0], -1) in the model, or pool the "
        "extra axes away"
    )


def check_same_shape(loss_name: str, labels: Array, predictions: Array) -> None:
    """Raises ValueError unless labels and predictions have the same shape.

    Silently broadcasting `[batch, 1]` against `[batch]` into `[batch, batch]` is a classic
    bug, so element-wise losses insist on equal shapes.
    """
    if labels.shape != predictions.shape:
        message = extra_axes_message(loss_name, labels.shape, predictions.shape, labels.shape)
        raise ValueError(
            message
            or f"{loss_name}: labels shape {labels.shape} differs from predictions shape "
            f"{predictions.shape}; reshape one of them so they match"
        )


def split_extras(
    loss_name: str,
    extras: Sequence[Array],
    allowed_shapes: dict[tuple[int, ...], str],
) -> tuple[Array | None, Array | None]:
    """Returns `(mask, weights)` from the extra labels, each None when not given.

    Args:
        loss_name: name used in error messages.
        extras: `labels[1:]`: at most one bool mask and one float weights array, any order.
        allowed_shapes: the shapes an extra label may have, each mapped to a short
            description for error messages.

    Returns:
        The bool mask and the float weights, as given (no broadcasting).

    Raises:
        ValueError: if an extra label has an unexpected dtype or shape, or if two masks or
            two weights arrays are given.
    """
    mask = None
    weights = None
    for position, extra in enumerate(extras, start=1):
        is_mask = extra.dtype == jnp.bool_
        is_weights = jnp.issubdtype(extra.dtype, jnp.floating)
        if not (is_mask or is_weights) or extra.shape not in allowed_shapes:
            expected = " or ".join(
                f"{shape} ({description})" for shape, description in allowed_shapes.items()
            )
            raise ValueError(
                f"{loss_name}: extra label labels[{position}] has shape {extra.shape} and "
                f"dtype {extra.dtype}; expected a bool mask or float weights of shape "
                f"{expected}"
            )
        if (mask if is_mask else weights) is not None:
            kind = "bool mask" if is_mask else "float weights array"
            raise ValueError(
                f"{loss_name}: labels[{position}] is a second {kind}; pass at most one bool "
                "mask and one float weights array"
            )
        if is_mask:
            mask = extra
        else:
            weights = extra
    return mask, weights


def masked_mean(values: Array, mask: Array | None, out_dtype: jnp.dtype) -> Array:
    """The mean of `values` over the entries where `mask` (broadcast to them) is True.

    Without a mask, the plain mean. Masked-out entries are dropped with `where` rather than
    a product, so they may hold inf or NaN (padding); everything masked out gives 0.
    """
    if mask is None:
        return jnp.mean(values).astype(out_dtype)
    mask = jnp.broadcast_to(mask, values.shape)
    total = jnp.sum(jnp.where(mask, values, 0))
    count = jnp.sum(mask, dtype=values.dtype)
    return (total / jnp.maximum(count, 1)).astype(out_dtype)


def reduce_loss(
    loss_name: str,
    per_element: Array,
    extras: Sequence[Array],
    allowed_shapes: dict[tuple[int, ...], str],
    out_dtype: jnp.dtype,
) -> Array:
    """Applies optional weights and mask to a per-element loss and returns its mean.

    Args:
        loss_name: name used in error messages.
        per_element: the per-element loss, already in the accumulation dtype.
        extras: `labels[1:]`: at most one bool mask and one float weights array, any order.
        allowed_shapes: the shapes an extra label may have, each mapped to a short
            description for error messages. Each must be a prefix of `per_element.shape`;
            a shorter one is broadcast over the trailing axes.
        out_dtype: dtype of the returned scalar.

    Returns:
        The scalar mean: over all elements without a mask, over the masked-in elements with
        one (0 when everything is masked out).

    Raises:
        ValueError: if an extra label has an unexpected dtype or shape, or if two masks or
            two weights arrays are given.
    """
    mask, weights = split_extras(loss_name, extras, allowed_shapes)
    if weights is not None:
        per_element = per_element * expand_trailing(weights, per_element.ndim).astype(
            per_element.dtype
        )
    if mask is not None:
        mask = expand_trailing(mask, per_element.ndim)
    return masked_mean(per_element, mask, out_dtype)


def expand_trailing(array: Array, ndim: int) -> Array:
    """Adds trailing singleton axes up to `ndim`, so `[batch]` broadcasts over `[batch, ...]`."""
    return array.reshape(array.shape + (1,) * (ndim - array.ndim))
