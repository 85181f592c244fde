"""The `Metric` protocol: pure state functions that the compiled steps call."""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax

State = Any  # a pytree of arrays
Partial = Any  # a pytree of arrays summarizing one batch (or one device's shard of it)


def set_names(metric: Any, name: str, short_name: str | None, metric_type: str) -> None:
    """Sets `metric`'s `name`, `short_name` (`name` when None) and `metric_type`.

    Every metric's constructor names it this way, device-side or host-side.
    """
    metric.name = name
    metric.short_name = name if short_name is None else short_name
    metric.metric_type = metric_type


def format_number(value: float) -> str:
    """Formats a scalar with 3 significant digits, GoMLX style (`0.123`, `1.23e+03`).

    Example:
      >>> format_number(0.123456)
      '0.123'
      >>> format_number(1234.5)
      '1.23e+03'
    """
    value = float(value)
    if not math.isfinite(value):
        return str(value)
    return f"{value:.3g}"


def format_percent(value: float) -> str:
    """Formats a fraction as a percentage with 2 decimals (`93.41%`).

    Example:
      >>> format_percent(0.93412)
      '93.41%'
    """
    return f"{100.0 * float(value):.2f}%"


class Metric(abc.ABC):
    """A metric computed inside the compiled train or eval step.

    A metric is described by pure functions over pytrees of arrays, so that its state
    lives in the train state (and is checkpointed with it) and it works on any number of
    devices:

    1. `update(labels, predictions) -> partial` summarizes one batch. Under data
       parallelism it runs on each device's shard of the batch.
    2. `merge(a, b) -> partial` combines the partials of two disjoint parts of a batch
       (it must be associative). The trainer merges the per-device partials, so the
       result equals `update` over the whole global batch on one device.
    3. `accumulate(state, partial) -> state` folds a whole batch's partial into the
       running state. The default is `merge(state, partial)`, which is right whenever
       the running state is just a partial over more data (means, counts, sums).
    4. `init() -> state` is the running state before any batch; `compute(state)` turns it
       into the reported value (a scalar array); `pretty_print(value)` formats it.

    Subclasses set `name` (the key in the metrics dict; unique per trainer),
    `short_name` (for compact displays) and `metric_type` (metrics with the same type
    share a plot, e.g. `"loss"` or `"accuracy"`).

    Example:
      >>> import jax.numpy as jnp
      >>> class MeanAbsoluteError(Metric):
      ...     name, short_name, metric_type = "mae", "mae", "loss"
      ...     def init(self):
      ...         return (jnp.zeros(()), jnp.zeros(()))
      ...     def update(self, labels, predictions):
      ...         err = jnp.abs(labels[0] - predictions[0])
      ...         return (jnp.sum(err), jnp.asarray(err.size, jnp.float32))
      ...     def merge(self, a, b):
      ...         return (a[0] + b[0], a[1] + b[1])
      ...     def compute(self, state):
      ...         return state[0] / jnp.maximum(state[1], 1.0)
      >>> m = MeanAbsoluteError()
      >>> s = m.accumulate(m.init(), m.update([jnp.ones(4)], [jnp.zeros(4)]))
      >>> float(m.compute(s))
      1.0
    """

    name: str
    short_name: str
    metric_type: str = ""

    @abc.abstractmethod
    def init(self) -> State:
        """Returns the running state before any batch.

        Returns:
          A pytree of arrays with the fixed shapes and dtypes every later state has.
        """

    @abc.abstractmethod
    def update(self, labels: Sequence[jax.Array], predictions: Sequence[jax.Array]) -> Partial:
        """Returns the partial state summarizing one batch (or one device's shard).

        Traced inside the compiled step; shape errors should raise at trace time.

        Args:
          labels: the batch's labels (`labels[0]` first; extra labels may be masks or
            weights).
          predictions: the model's outputs for the batch.

        Returns:
          A pytree of arrays whose shapes do not depend on the batch size.
        """

    @abc.abstractmethod
    def merge(self, a: Partial, b: Partial) -> Partial:
        """Combines the partials of two disjoint parts of the data.

        Args:
          a: one part's partial.
          b: the other part's partial.

        Returns:
          The partial of both parts together; must be associative.
        """

    @abc.abstractmethod
    def compute(self, state: State) -> jax.Array:
        """Returns the metric's value from the running state.

        Args:
          state: the running state (`init()` folded with `accumulate`).

        Returns:
          A scalar array.
        """

    def accumulate(self, state: State, partial: Partial) -> State:
        """Folds a whole batch's partial into the running state (default: `merge`).

        Args:
          state: the running state.
          partial: the merged partial of one whole (global) batch.

        Returns:
          The new running state, with the same shapes and dtypes as `state`.
        """
        return self.merge(state, partial)

    #: How `pretty_print` formats a value; None: 3 significant digits.
    formatter: Callable[[Any], str] | None = None

    def pretty_print(self, value: Any) -> str:
        """Formats a computed value for people (default: 3 significant digits).

        Args:
          value: a value returned by `compute` (an array or a Python number).

        Returns:
          A short string such as `0.123` (`formatter(value)` when the metric has one).
        """
        return format_number(value) if self.formatter is None else self.formatter(value)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
