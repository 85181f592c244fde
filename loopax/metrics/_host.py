"""The `HostMetric` protocol: metrics whose state lives on the host, read only on demand."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from ._base import format_number

HostState = Any  # any Python object; only the trainer that owns it touches it

_HOST_METHODS = ("device_values", "init_host", "update_host", "compute_host")


class HostMetric(abc.ABC):
    """A metric computed on the host from values the compiled step returns.

    Some metrics cannot live in the compiled step: a streaming median keeps a sample of
    thousands of values and sorts it, which no fixed-shape device state does well. A host
    metric splits in two (GoMLX's `UpdateGraph`/`UpdateGo`/`ReadGo`):

    1. `device_values(labels, predictions)` is traced inside the compiled train or eval
       step on each device's shard. It returns per-example values (any array with at
       least one axis, its first axis the shard's examples: every element is one value)
       or a scalar (the shard's batch mean). The trainer gathers them from all devices
       inside the step, so the host sees the global batch's values as on one device:
       per-example values concatenated in device order (padding examples left out), a
       scalar combined into the example-weighted mean of the whole batch.
    2. The step only returns those values; the trainer keeps them on the device, unread.
       When something reads the metric (a hook's `loop.host_metrics()`, `float()` or
       `np.asarray` of its entry in the metrics dict, the end of `Trainer.evaluate`),
       the values of the steps up to the one read are fetched and folded in, oldest
       first, with `update_host(state, values)`; `compute_host(state)` gives the value.
       So nothing is read per step; on long runs without readers the oldest pending
       values are copied asynchronously and folded in every 64 steps, which bounds the
       memory they hold.
    3. `init_host()` is the state before any value; the trainer starts afresh with it on
       `Trainer.reset_train_metrics()` (train) or `reset_eval_metrics()`/`evaluate()`
       (eval). The host state is not part of the train state: a train metric's goes into
       checkpoints as JSON through `host_state_dict(state)`, and a resumed run that goes on
       with the checkpoint's run continues it from `load_host_state_dict(saved)`, so its
       values equal an uninterrupted run's. Without them (they return None and raise by
       default) a checkpoint warns and a resumed run starts the metric afresh.

    In the metrics dict (what `Trainer.train_step`/`eval_step` return and hooks get) a
    host metric's entry is a lazy scalar: `float(value)`, `np.asarray(value)` and
    `jax.device_get` read it, each for the step it came from, whenever they are called.

    Subclasses set `name` (the key in the metrics dict; unique per trainer),
    `short_name` and `metric_type`, as for `loopax.metrics.Metric`. Train and eval
    metric lists take both kinds: `Trainer(train_metrics=[Mean(...), StreamingMedian(...)])`.

    Example:
      >>> import numpy as np
      >>> class MaxAbsoluteError(HostMetric):
      ...     name, short_name, metric_type = "max_abs_error", "max_err", "loss"
      ...     def device_values(self, labels, predictions):
      ...         return abs(labels[0] - predictions[0])  # per example
      ...     def init_host(self):
      ...         return float("-inf")
      ...     def update_host(self, state, values):
      ...         return max(state, float(np.max(values)))
      ...     def compute_host(self, state):
      ...         return state
      >>> metric = MaxAbsoluteError()
      >>> state = metric.update_host(metric.init_host(), np.array([0.5, 2.0]))
      >>> metric.compute_host(metric.update_host(state, np.array([1.0])))
      2.0
    """

    name: str
    short_name: str
    metric_type: str = ""

    @abc.abstractmethod
    def device_values(
        self, labels: Sequence[jax.Array], predictions: Sequence[jax.Array]
    ) -> jax.Array:
        """Returns this shard's values, traced inside the compiled step.

        Args:
          labels: the shard's labels (`labels[0]` first).
          predictions: the model's outputs for the shard.

        Returns:
          A real-valued array: per-example values (first axis: the shard's examples) or
          a scalar (the shard's mean). Integer, bool and 16-bit float values are sent as
          float32.
        """

    @abc.abstractmethod
    def init_host(self) -> HostState:
        """Returns the host state before any value."""

    @abc.abstractmethod
    def update_host(self, state: HostState, values: np.ndarray) -> HostState:
        """Folds values into the host state (it may update `state` in place).

        Args:
          state: the host state.
          values: the values of one or more consecutive steps, each step's those of its
            whole global batch, concatenated along the first axis in step order: a numpy
            array with at least one element, `[examples, ...]` for per-example values,
            `[steps]` for scalars (one batch mean per step).

        Returns:
          The new host state.
        """

    @abc.abstractmethod
    def compute_host(self, state: HostState) -> float:
        """Returns the metric's value from the host state (NaN when it holds no value)."""

    def host_state_dict(self, state: HostState) -> dict[str, Any] | None:
        """Returns `state` as JSON (dicts, lists, str, int, float), for checkpoints.

        Called when a checkpoint is saved, with every step so far folded in; it must not
        change `state`. Default: None, the state cannot be saved (a checkpoint then warns,
        and a resumed run starts the metric afresh).

        Args:
          state: the host state.

        Returns:
          A JSON dict from which `load_host_state_dict` rebuilds `state`, or None.
        """
        del state
        return None

    def load_host_state_dict(self, saved: dict[str, Any]) -> HostState:
        """Returns the host state that `host_state_dict` saved as `saved`.

        Args:
          saved: what `host_state_dict` returned (read back from JSON).

        Returns:
          The host state to go on from.

        Raises:
          ValueError: `saved` does not fit this metric (e.g. saved with other settings).
          NotImplementedError: the default; implement it with `host_state_dict`.
        """
        del saved
        raise NotImplementedError(
            f"{type(self).__name__} saved a host state but does not implement "
            "load_host_state_dict to read it back"
        )

    def pretty_print(self, value: Any) -> str:
        """Formats a computed value for people (default: 3 significant digits).

        Args:
          value: a value returned by `compute_host`.

        Returns:
          A short string such as `0.123`.
        """
        return format_number(value)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def is_host_metric(metric: Any) -> bool:
    """Whether `metric` follows the `HostMetric` protocol (a subclass or a duck type).

    An object with `device_values` but without all of the host methods raises instead of
    being taken for a `Metric`, so its error names what it lacks.

    Args:
      metric: a train or eval metric given to the trainer.

    Returns:
      True for a host metric, False for anything without `device_values`.

    Raises:
      TypeError: `metric` has `device_values` but misses another host method or a str
        `name`.

    Example:
      >>> from loopax.metrics import Mean, StreamingMedian
      >>> is_host_metric(StreamingMedian("median", lambda y, p: p[0]))
      True
      >>> is_host_metric(Mean("mean", lambda y, p: p[0]))
      False
    """
    if not callable(getattr(metric, "device_values", None)):
        return False
    missing = [method for method in _HOST_METHODS if not callable(getattr(metric, method, None))]
    if not isinstance(getattr(metric, "name", None), str):
        missing.append("name")
    if missing:
        raise TypeError(
            f"metric {metric!r} has device_values but does not follow the "
            f"loopax.metrics.HostMetric protocol (missing {missing}); subclass "
            "loopax.metrics.HostMetric"
        )
    return True
