"""Mean and moving-average metrics over any per-example or per-batch function."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ._base import Metric, set_names


class MeanState(NamedTuple):
    """Running (or one batch's) weighted sum and total weight of a mean.

    Both fields are float32 scalars. It is the state of `Mean` and the partial (per
    batch, per device) of `Mean` and `MovingAverage`; partials merge by adding fields.

    Attributes:
      total: sum of `value * weight` over the examples seen.
      weight: sum of the weights (the number of examples when unweighted).
    """

    total: jax.Array
    weight: jax.Array


# `fn(labels, predictions)`: per-example values, their mean, or a `MeanState` of its own
# weighting (masks, weights).
MetricFn = Callable[[Sequence[jax.Array], Sequence[jax.Array]], "jax.Array | MeanState"]


class MovingAverageState(NamedTuple):
    """Running state of `MovingAverage`.

    Attributes:
      mean: float32 scalar, the current moving average (0 before any batch).
      count: int32 scalar, the number of batches folded in so far.
    """

    mean: jax.Array
    # A public field name: reading `state.count` gives the batches, not tuple.count.
    count: jax.Array  # pyright: ignore[reportIncompatibleMethodOverride]


def zero_mean_state() -> MeanState:
    """Returns the empty `MeanState` (no examples seen).

    Returns:
      `MeanState(total=0.0, weight=0.0)` with float32 scalars.
    """
    return MeanState(jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))


def add_mean_states(a: MeanState, b: MeanState) -> MeanState:
    """Merges the `MeanState`s of two disjoint parts of the data.

    Args:
      a: one part's state.
      b: the other part's state.

    Returns:
      The fieldwise sum, the state of the union of both parts.
    """
    return MeanState(a.total + b.total, a.weight + b.weight)


def mean_of(state: MeanState) -> jax.Array:
    """Returns `total / weight`, or 0 where no weight was seen (instead of NaN).

    Args:
      state: a `MeanState`.

    Returns:
      A float32 scalar.
    """
    has_weight = state.weight != 0
    return jnp.where(has_weight, state.total / jnp.where(has_weight, state.weight, 1.0), 0.0)


def batch_size_of(predictions: Sequence[jax.Array]) -> int:
    """How many examples a batch counts for: the first dim of predictions[0] (1 if scalar)."""
    if len(predictions) == 0:
        raise ValueError("metrics need at least one prediction; got an empty predictions list")
    first = jnp.shape(predictions[0])
    return first[0] if len(first) > 0 else 1


def _mean_partial(name: str, fn: MetricFn, labels, predictions) -> MeanState:
    """Reduces `fn(labels, predictions)` to the batch's `MeanState`."""
    value = fn(labels, predictions)
    if isinstance(value, MeanState):  # fn did its own weighting (masks, weights)
        return MeanState(
            jnp.asarray(value.total, jnp.float32), jnp.asarray(value.weight, jnp.float32)
        )
    value = jnp.asarray(value)
    if not (
        jnp.issubdtype(value.dtype, jnp.floating)
        or jnp.issubdtype(value.dtype, jnp.integer)
        or value.dtype == jnp.bool_
    ):
        raise ValueError(
            f"metric {name!r}: fn returned dtype {value.dtype}; expected a real number"
        )
    value = value.astype(jnp.float32)  # bfloat16/float16 sums lose too much precision
    if value.ndim == 0:
        # A scalar is taken as the batch mean, so it counts once per example.
        batch_size = batch_size_of(predictions)
        if batch_size == 0:  # the mean of nothing is NaN; an empty shard adds nothing
            return zero_mean_state()
        weight = jnp.asarray(batch_size, jnp.float32)
        return MeanState(value * weight, weight)
    return MeanState(jnp.sum(value), jnp.asarray(value.size, jnp.float32))


class Mean(Metric):
    """Mean of `fn(labels, predictions)` over every example seen since `init`.

    `fn` returns either per-example values (any non-scalar array: each element counts
    once), or a scalar batch mean (it counts once per example of the batch, the first
    dimension of `predictions[0]`, or once for a scalar prediction: GoMLX's rule), or a
    `MeanState(total, weight)` of the batch for any other weighting (the accuracies use
    it for masks and weights). The reported value is 0 before any example.

    State and partial: `MeanState(total, weight)`, float32 scalars; `merge` and
    `accumulate` add them, so the result does not depend on how batches are split across
    devices. The weight is a float32 count: exact up to 2**24 (about 16.7 million)
    examples.

    Args:
      name: the metric's key in the metrics dict (unique per trainer).
      fn: `fn(labels, predictions) -> jax.Array | MeanState`, traced inside the
        compiled step.
      short_name: compact name for progress bars; defaults to `name`.
      metric_type: plots group metrics of the same type, e.g. `"loss"`.
      formatter: `formatter(value) -> str` for `pretty_print` (e.g.
        `loopax.metrics.format_percent`); default 3 significant digits.

    Raises:
      ValueError: `name` is empty.
      TypeError: `fn` is not callable.

    Example:
      >>> import jax.numpy as jnp
      >>> mae = Mean("Mean Absolute Error", lambda y, p: jnp.abs(y[0] - p[0]),
      ...            short_name="mae", metric_type="loss")
      >>> state = mae.init()
      >>> for y, p in [([1.0, 2.0], [1.5, 2.0]), ([3.0], [2.0])]:
      ...     partial = mae.update([jnp.array(y)], [jnp.array(p)])
      ...     state = mae.accumulate(state, partial)
      >>> mae.pretty_print(mae.compute(state))
      '0.5'
    """

    short_name: str

    def __init__(
        self,
        name: str,
        fn: MetricFn,
        *,
        short_name: str | None = None,
        metric_type: str = "",
        formatter: Callable[[Any], str] | None = None,
    ):
        check_name_and_fn(name, fn)
        set_names(self, name, short_name, metric_type)
        self.formatter = formatter
        self.fn = fn

    def init(self) -> MeanState:
        """Returns the empty state, `MeanState(0.0, 0.0)`."""
        return zero_mean_state()

    def update(self, labels: Sequence[jax.Array], predictions: Sequence[jax.Array]) -> MeanState:
        """Returns the batch's `MeanState`: the sum of `fn`'s values and their count.

        Args:
          labels: the batch's labels, passed to `fn`.
          predictions: the batch's predictions, passed to `fn`.

        Returns:
          A `MeanState` of float32 scalars.

        Raises:
          ValueError: `fn` returned a non-numeric array, or `predictions` is empty.
        """
        return _mean_partial(self.name, self.fn, labels, predictions)

    def merge(self, a: MeanState, b: MeanState) -> MeanState:
        """Adds two `MeanState`s of disjoint data."""
        return add_mean_states(a, b)

    def compute(self, state: MeanState) -> jax.Array:
        """Returns `total / weight` (0 when nothing was seen)."""
        return mean_of(state)


class MovingAverage(Metric):
    """Exponential moving average of the per-batch mean of `fn`, GoMLX style.

    Each batch contributes its mean `b` of `fn(labels, predictions)`, computed from the
    merged per-device `MeanState` partials (weighted as in `Mean`) so that it equals the
    mean over the whole global batch. The running state folds it in with
    `count += 1; w = max(new_example_weight, 1 / count); mean = mean * (1 - w) + b * w`:
    an exact mean of the batch means (each batch counting once) for the first
    `1 / new_example_weight` batches, then an exponential moving average. A batch with
    zero total weight (every entry masked out) leaves the state unchanged.

    State: `MovingAverageState(mean: float32, count: int32)`. Partial: `MeanState`
    (so `accumulate` is not `merge`).

    Args:
      name: the metric's key in the metrics dict (unique per trainer).
      fn: `fn(labels, predictions)`: per-example values, a scalar batch mean or a
        `MeanState`, as for `Mean`.
      new_example_weight: the weight of a new batch once past the warm-up; in (0, 1].
      short_name: compact name for progress bars; defaults to `name`.
      metric_type: plots group metrics of the same type, e.g. `"loss"`.
      formatter: `formatter(value) -> str` for `pretty_print` (e.g.
        `loopax.metrics.format_percent`); default 3 significant digits.

    Raises:
      ValueError: `name` is empty or `new_example_weight` is not in (0, 1].
      TypeError: `fn` is not callable.

    Example:
      >>> import jax.numpy as jnp
      >>> ma = MovingAverage("Moving Average Error", lambda y, p: jnp.abs(y[0] - p[0]),
      ...                    new_example_weight=0.5, short_name="~err")
      >>> state = ma.init()
      >>> for err in [4.0, 2.0, 1.0]:
      ...     state = ma.accumulate(state, ma.update([jnp.array([err])], [jnp.zeros(1)]))
      >>> float(ma.compute(state))  # (4 + 2) / 2 = 3, then 3 * 0.5 + 1 * 0.5
      2.0
    """

    short_name: str
    new_example_weight: float

    def __init__(
        self,
        name: str,
        fn: MetricFn,
        *,
        new_example_weight: float = 0.01,
        short_name: str | None = None,
        metric_type: str = "",
        formatter: Callable[[Any], str] | None = None,
    ):
        check_name_and_fn(name, fn)
        if not 0.0 < new_example_weight <= 1.0:
            raise ValueError(
                f"MovingAverage {name!r}: new_example_weight={new_example_weight} must be in "
                "(0, 1]; 0.01 (the default) averages over about the last 100 batches"
            )
        set_names(self, name, short_name, metric_type)
        self.formatter = formatter
        self.fn = fn
        self.new_example_weight = float(new_example_weight)

    def init(self) -> MovingAverageState:
        """Returns `MovingAverageState(mean=0.0, count=0)`."""
        return MovingAverageState(jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))

    def update(self, labels: Sequence[jax.Array], predictions: Sequence[jax.Array]) -> MeanState:
        """Returns the batch's `MeanState` partial, as `Mean.update` does.

        Raises:
          ValueError: `fn` returned a non-numeric array, or `predictions` is empty.
        """
        return _mean_partial(self.name, self.fn, labels, predictions)

    def merge(self, a: MeanState, b: MeanState) -> MeanState:
        """Adds two `MeanState` partials of disjoint parts of a batch."""
        return add_mean_states(a, b)

    def accumulate(self, state: MovingAverageState, partial: MeanState) -> MovingAverageState:
        """Folds one whole batch's mean into the moving average.

        Args:
          state: the running `MovingAverageState`.
          partial: the merged `MeanState` of the whole (global) batch.

        Returns:
          The new `MovingAverageState`; `state` itself when the batch has zero weight.
        """
        return moving_average_step(state, partial, self.new_example_weight)

    def compute(self, state: MovingAverageState) -> jax.Array:
        """Returns the current moving average (0 before any batch)."""
        return state.mean


def moving_average_step(
    state: MovingAverageState, partial: MeanState, new_example_weight: float
) -> MovingAverageState:
    """One GoMLX moving-average update with the batch mean held in `partial`.

    Args:
      state: the running `MovingAverageState`.
      partial: the whole batch's `MeanState`; skipped when its weight is 0.
      new_example_weight: the floor of the new batch's weight.

    Returns:
      The updated `MovingAverageState`.
    """
    count = state.count + 1
    weight = jnp.maximum(jnp.float32(new_example_weight), 1.0 / count.astype(jnp.float32))
    mean = state.mean * (1.0 - weight) + mean_of(partial) * weight
    has_data = partial.weight != 0
    return MovingAverageState(
        jnp.where(has_data, mean, state.mean), jnp.where(has_data, count, state.count)
    )


def check_name_and_fn(name: str, fn: MetricFn) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(
            f"a metric needs a non-empty name (its key in the metrics dict), got {name!r}"
        )
    if not callable(fn):
        raise TypeError(
            f"metric {name!r}: fn must be callable as fn(labels, predictions), got {fn!r}"
        )
