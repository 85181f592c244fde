"""Accuracy metrics (mean and moving average), with optional masks and weights.

Default names follow GoMLX's examples: `"Accuracy"` (short `"acc"`) for the mean over the
data seen, `"Moving Average Accuracy"` (short `"~acc"`) for the moving average; pass
`name=` / `short_name=` to use several in one trainer. All have metric type
`"accuracy"` and print as percentages (`93.41%`).

Masks and weights come as extra labels after `labels[0]`, in any order, recognized as in
the losses: a bool array is the mask, a floating array the weights; both have the shape
of the per-example correctness (all but the last axis of the predictions for sparse
categorical accuracy, the labels' shape for binary accuracies). The accuracy is
`sum(weight * correct) / sum(weight)` over the masked-in entries: masked-out entries
count for nothing, and weights are normalized by their sum (as in Keras and
scikit-learn), so the result stays a fraction in [0, 1].

Every accuracy takes the keywords `name` (the key in the metrics dict) and `short_name`
(for compact displays); the moving averages also `new_example_weight` (the weight of a new
batch after the first `1/new_example_weight`; a ValueError unless in (0, 1]), averaging as
in `MovingAverage`. The mean accuracies' state is `MeanState(total, weight)`; the moving
averages' is `MovingAverageState(mean, count)`, their partial a `MeanState`. `update`
raises ValueError, at trace time, when shapes or dtypes are wrong.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ._base import format_percent
from ._mean import Mean, MeanState, MovingAverage

ACCURACY_METRIC_TYPE = "accuracy"


def _mask_and_weights(
    culprit: str, extras: Sequence[Any], shape: tuple[int, ...], shape_doc: str
) -> tuple[jax.Array | None, jax.Array | None]:
    """Sorts the extra labels into (mask, weights), checking dtypes and shapes."""
    mask = weights = None
    expected = f"expected a bool mask and/or float weights of shape {shape} ({shape_doc})"
    for index, extra in enumerate(extras, start=1):
        extra = jnp.asarray(extra)
        if extra.dtype == jnp.bool_:
            kind = "mask"
        elif jnp.issubdtype(extra.dtype, jnp.floating):
            kind = "weights"
        else:
            raise ValueError(f"{culprit}: labels[{index}] has dtype {extra.dtype}; {expected}")
        if extra.shape != shape:
            raise ValueError(
                f"{culprit}: labels[{index}] ({kind}) has shape {extra.shape}; {expected}"
            )
        if kind == "mask":
            if mask is not None:
                raise ValueError(f"{culprit}: more than one bool mask in labels[1:]; {expected}")
            mask = extra
        else:
            if weights is not None:
                raise ValueError(
                    f"{culprit}: more than one float weights array in labels[1:]; {expected}"
                )
            weights = extra
    return mask, weights


def _weighted_correct(
    correct: jax.Array, mask: jax.Array | None, weights: jax.Array | None
) -> MeanState:
    """Sums the weights of the correct entries and all weights, over masked-in entries."""
    if mask is None and weights is None:
        return MeanState(
            jnp.sum(correct, dtype=jnp.float32), jnp.asarray(correct.size, jnp.float32)
        )
    weight = (
        jnp.ones(correct.shape, jnp.float32) if weights is None else weights.astype(jnp.float32)
    )
    if mask is not None:
        # `where`, not a product: weights of masked-out entries may be NaN or inf.
        weight = jnp.where(mask, weight, 0.0)
    return MeanState(jnp.sum(jnp.where(correct, weight, 0.0)), jnp.sum(weight))


def _first(culprit: str, labels: Sequence[Any], predictions: Sequence[Any]):
    if len(labels) == 0 or len(predictions) == 0:
        raise ValueError(
            f"{culprit}: needs labels[0] and predictions[0], got {len(labels)} "
            f"labels and {len(predictions)} predictions"
        )
    return jnp.asarray(labels[0]), jnp.asarray(predictions[0])


def sparse_categorical_correct(
    culprit: str, labels: Sequence[jax.Array], predictions: Sequence[jax.Array]
) -> MeanState:
    """Returns the batch's `MeanState` of `argmax(predictions[0]) == labels[0]`.

    Args:
      culprit: names the metric in error messages.
      labels: `labels[0]` integer class ids of shape `[...]` or `[..., 1]`, optionally
        followed by a bool mask and/or float weights of shape `[...]`.
      predictions: `predictions[0]` logits or probabilities of shape `[..., C]`.

    Returns:
      `MeanState(sum of weights of correct entries, sum of weights)`.

    Raises:
      ValueError: wrong shapes or dtypes, naming the expected ones.
    """
    label, logits = _first(culprit, labels, predictions)
    if logits.ndim == 0:
        raise ValueError(
            f"{culprit}: predictions[0] must have a trailing class axis [..., C], got a scalar"
        )
    example_shape = logits.shape[:-1]
    if label.shape == example_shape + (1,):
        label = label.reshape(example_shape)
    elif label.shape != example_shape:
        raise ValueError(
            f"{culprit}: labels[0] has shape {label.shape}; for predictions of shape "
            f"{logits.shape} expected {example_shape} or {example_shape + (1,)}"
        )
    if not jnp.issubdtype(label.dtype, jnp.integer):
        raise ValueError(f"{culprit}: labels[0] must be integer class ids, got dtype {label.dtype}")
    mask, weights = _mask_and_weights(
        culprit, labels[1:], example_shape, "all but the last axis of predictions[0]"
    )
    correct = jnp.argmax(logits, axis=-1) == label
    return _weighted_correct(correct, mask, weights)


def _binary_hits(
    culprit: str,
    labels: Sequence[jax.Array],
    predictions: Sequence[jax.Array],
    hit: Callable[[jax.Array, jax.Array], jax.Array],
) -> MeanState:
    """The `MeanState` of `hit(label, prediction)` over the (masked, weighted) entries."""
    label, prediction = _first(culprit, labels, predictions)
    if prediction.shape != label.shape:
        # `[batch, 1]` predictions against `[batch]` labels (or the reverse) are common.
        if prediction.shape + (1,) == label.shape or prediction.shape == label.shape + (1,):
            prediction = prediction.reshape(label.shape)
        else:
            raise ValueError(
                f"{culprit}: predictions[0] has shape {prediction.shape} and labels[0] shape "
                f"{label.shape}; expected equal shapes (or differing by a trailing axis of 1)"
            )
    label, prediction = label.astype(jnp.float32), prediction.astype(jnp.float32)
    mask, weights = _mask_and_weights(culprit, labels[1:], label.shape, "the labels' shape")
    return _weighted_correct(hit(label, prediction), mask, weights)


def binary_correct(
    culprit: str, labels: Sequence[jax.Array], predictions: Sequence[jax.Array]
) -> MeanState:
    """Returns the batch's `MeanState` of `abs(labels[0] - predictions[0]) < 0.5`.

    A probability of exactly 0.5 is always a miss (GoMLX).

    Args:
      culprit: names the metric in error messages.
      labels: `labels[0]` in {0, 1} (bool, int or float), optionally followed by a bool
        mask and/or float weights of the labels' shape.
      predictions: `predictions[0]` probabilities, of the labels' shape (or differing by a
        trailing axis of 1).

    Returns:
      `MeanState(sum of weights of correct entries, sum of weights)`.

    Raises:
      ValueError: wrong shapes or dtypes, naming the expected ones.
    """
    return _binary_hits(culprit, labels, predictions, lambda y, p: jnp.abs(y - p) < 0.5)


def binary_logits_correct(
    culprit: str, labels: Sequence[jax.Array], predictions: Sequence[jax.Array]
) -> MeanState:
    """`binary_correct` for logits: the `MeanState` of `predictions[0] * (labels[0] - 0.5) > 0`.

    A logit of exactly 0 is always a miss (GoMLX). Arguments, result and errors as
    `binary_correct`'s, with logits for probabilities.
    """
    return _binary_hits(culprit, labels, predictions, lambda y, logit: logit * (y - 0.5) > 0)


# What makes a Mean or MovingAverage an accuracy: its metric type and percentages.
_SHOWN: dict[str, Any] = {"metric_type": ACCURACY_METRIC_TYPE, "formatter": format_percent}


def _named(correct: Callable[..., Any], metric: Any, name: str) -> Callable[..., Any]:
    """`correct` with its culprit filled in: the metric's class and name, for messages."""
    return functools.partial(correct, f"{type(metric).__name__} {name!r}")


class _MeanAccuracy(Mean):
    """A `Mean` of a correctness function (`_correct`), an accuracy shown as a percentage."""

    _correct: Callable[..., Any]

    def __init__(self, *, name: str = "Accuracy", short_name: str = "acc"):
        super().__init__(name, _named(self._correct, self, name), short_name=short_name, **_SHOWN)


class _MovingAccuracy(MovingAverage):
    """A `MovingAverage` of a correctness function (`_correct`), shown as a percentage."""

    _correct: Callable[..., Any]

    def __init__(
        self,
        *,
        name: str = "Moving Average Accuracy",
        short_name: str = "~acc",
        new_example_weight: float = 0.01,
    ):
        correct = _named(self._correct, self, name)
        super().__init__(
            name, correct, new_example_weight=new_example_weight, short_name=short_name, **_SHOWN
        )


class SparseCategoricalAccuracy(_MeanAccuracy):
    """Fraction of examples whose argmax prediction is the integer label.

    `labels[0]`: integer class ids `[...]` or `[..., 1]`; `predictions[0]`: logits or
    probabilities `[..., C]` (argmax is the same for both; ties go to the lowest class).
    Optional bool mask and/or float weights of shape `[...]` in `labels[1:]` (see the
    module docs).

    Example:
      >>> import jax.numpy as jnp
      >>> acc = SparseCategoricalAccuracy()
      >>> logits = jnp.array([[2.0, 1.0], [0.0, 3.0], [1.0, 0.0], [5.0, 4.0]])
      >>> partial = acc.update([jnp.array([0, 1, 1, 0])], [logits])
      >>> acc.pretty_print(acc.compute(acc.accumulate(acc.init(), partial)))
      '75.00%'
      >>> mask = jnp.array([True, True, False, True])
      >>> partial = acc.update([jnp.array([0, 1, 1, 0]), mask], [logits])
      >>> acc.pretty_print(acc.compute(partial))
      '100.00%'
    """

    _correct = staticmethod(sparse_categorical_correct)


class BinaryAccuracy(_MeanAccuracy):
    """Fraction of binary labels predicted within 0.5 by a probability.

    Correct iff `abs(labels[0] - predictions[0]) < 0.5`. Optional bool mask and/or float
    weights of the labels' shape in `labels[1:]`.

    Example:
      >>> import jax.numpy as jnp
      >>> acc = BinaryAccuracy()
      >>> partial = acc.update([jnp.array([1.0, 0.0, 1.0, 0.0])],
      ...                      [jnp.array([0.9, 0.2, 0.5, 0.7])])
      >>> acc.pretty_print(acc.compute(partial))
      '50.00%'
    """

    _correct = staticmethod(binary_correct)


class BinaryLogitsAccuracy(_MeanAccuracy):
    """Fraction of binary labels whose logit has the right sign.

    Correct iff `predictions[0] * (labels[0] - 0.5) > 0`. Optional bool mask and/or float
    weights of the labels' shape in `labels[1:]`.

    Example:
      >>> import jax.numpy as jnp
      >>> acc = BinaryLogitsAccuracy()
      >>> labels = [jnp.array([1, 0, 1]), jnp.array([1.0, 1.0, 2.0])]  # weights
      >>> partial = acc.update(labels, [jnp.array([3.0, -1.0, -2.0])])
      >>> acc.pretty_print(acc.compute(partial))
      '50.00%'
    """

    _correct = staticmethod(binary_logits_correct)


class MovingAverageSparseCategoricalAccuracy(_MovingAccuracy):
    """Moving average of the per-batch `SparseCategoricalAccuracy`.

    Same inputs as `SparseCategoricalAccuracy`.

    Example:
      >>> import jax.numpy as jnp
      >>> acc = MovingAverageSparseCategoricalAccuracy()
      >>> state = acc.init()
      >>> for labels in ([0, 0], [0, 1]):  # batch accuracies 100% then 50%
      ...     partial = acc.update([jnp.array(labels)], [jnp.array([[1.0, 0.0], [1.0, 0.0]])])
      ...     state = acc.accumulate(state, partial)
      >>> acc.pretty_print(acc.compute(state))
      '75.00%'
    """

    _correct = staticmethod(sparse_categorical_correct)


class MovingAverageBinaryAccuracy(_MovingAccuracy):
    """Moving average of the per-batch `BinaryAccuracy` (probability predictions).

    Example:
      >>> import jax.numpy as jnp
      >>> acc = MovingAverageBinaryAccuracy(new_example_weight=0.5)
      >>> state = acc.init()
      >>> for p in (0.9, 0.1, 0.1):  # the label is 1: hit, miss, miss
      ...     state = acc.accumulate(state, acc.update([jnp.ones(1)], [jnp.array([p])]))
      >>> acc.pretty_print(acc.compute(state))  # (1 + 0) / 2, then halved
      '25.00%'
    """

    _correct = staticmethod(binary_correct)


class MovingAverageBinaryLogitsAccuracy(_MovingAccuracy):
    """Moving average of the per-batch `BinaryLogitsAccuracy` (logit predictions).

    Example:
      >>> import jax.numpy as jnp
      >>> acc = MovingAverageBinaryLogitsAccuracy()
      >>> partial = acc.update([jnp.array([1, 0])], [jnp.array([2.0, 0.0])])
      >>> acc.pretty_print(acc.compute(acc.accumulate(acc.init(), partial)))
      '50.00%'
    """

    _correct = staticmethod(binary_logits_correct)
