"""Host metrics in the trainer: their step values, kept pending on the device, read on demand.

A `loopax.metrics.HostMetric`'s per-step values are computed and gathered inside the
compiled step (`HostMetrics.step_values`) and returned with the other metric values, under
the metric's name.
`HostMetrics.results` puts a lazy `HostMetricValue` in the metrics dict in their place
and keeps the device arrays pending in a `_Stream`, untouched: no transfer, no wait.
Reading a `HostMetricValue` fetches the pending values up to its step and folds them into
the host states. Without readers, whenever `MAX_PENDING` steps are pending the stream
folds the oldest half, whose copies to the host it started `MAX_PENDING // 2` steps
earlier, so the arrays it holds stay bounded and the fold does not wait for a transfer.
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _warnings
from ..metrics._internal import batch_size_of
from ..metrics._internal import is_host_metric as is_host_metric

# Steps whose values may wait on the device; past it the oldest half is folded in. Twice
# the loop's largest in-flight window (32), so the steps folded without a reader are
# older than any metrics dict the loop still holds.
MAX_PENDING = 128


def split_host_metrics(
    metrics: Sequence[Any], axis: str, num_devices: int
) -> tuple[tuple, HostMetrics]:
    """Splits a trainer's metrics into the compiled ones and the host ones.

    Args:
      metrics: the train or eval metrics, both kinds, in the user's order.
      axis: the devices' axis name inside the step.
      num_devices: how many devices the step runs on.

    Returns:
      `(compiled metrics, HostMetrics of the host metrics)`, each in the given order.
    """
    host = tuple(metric for metric in metrics if is_host_metric(metric))
    compiled = tuple(metric for metric in metrics if not is_host_metric(metric))
    return compiled, HostMetrics(host, axis, num_devices)


@jax.tree_util.register_pytree_node_class
class StepValues:
    """One host metric's values for one step, as the compiled step returns them.

    Attributes:
      values: `[n, ...]`: the global batch's per-example values, or `[1]`: its mean.
      weights: float32 `[n]`, or None when every value counts: a value with weight 0 is
        left out (a padding example, a skipped step); for a mean, its example weight.
      per_example: whether `values` are per-example (static: part of the tree's
        structure).
    """

    def __init__(self, values: Any, weights: Any, per_example: bool):
        self.values = values
        self.weights = weights
        self.per_example = per_example

    def tree_flatten(self):
        return (self.values, self.weights), self.per_example

    @classmethod
    def tree_unflatten(cls, per_example, children):
        values, weights = children
        return cls(values, weights, per_example)

    def of_micro_batches(self, ok: jax.Array | None = None) -> StepValues:
        """Traced: the `StepValues` of an accumulated step from its micro-batches' ones.

        Those are stacked on a leading axis, as `lax.scan` returns them. With `ok` False (a
        skipped step) every value is left out.
        """
        values, weights = self.values, self.weights
        if self.per_example:
            values = values.reshape((-1, *values.shape[2:]))
            weights = None if weights is None else weights.reshape((-1,))
            if ok is not None:
                ones = jnp.ones(values.shape[:1], jnp.float32)
                weights = jnp.where(ok, ones if weights is None else weights, 0.0)
            return StepValues(values, weights, True)
        # Means of the micro-batches, weighted by their examples: one mean.
        weight = jnp.sum(weights)
        total = jnp.sum(jnp.where(weights > 0, values * weights, 0.0))
        if ok is not None:
            weight = jnp.where(ok, weight, 0.0)
        mean = total / jnp.where(weight > 0, weight, 1.0)
        return StepValues(mean[None], weight[None], False)

    def kept(self) -> np.ndarray:
        """Host side: the values that count, as numpy."""
        values = np.asarray(self.values)
        if self.weights is None:
            return values
        return values[np.asarray(self.weights) > 0]


def _as_real(name: str, value: Any) -> jax.Array:
    value = jnp.asarray(value)
    if value.dtype == jnp.bool_ or jnp.issubdtype(value.dtype, jnp.integer):
        return value.astype(jnp.float32)
    if not jnp.issubdtype(value.dtype, jnp.floating):
        raise ValueError(
            f"host metric {name!r}: device_values returned dtype {value.dtype}; expected real "
            "numbers (per-example values or a scalar batch mean)"
        )
    return value.astype(jnp.promote_types(value.dtype, jnp.float32))


def merge_step_values(a: StepValues, b: StepValues) -> StepValues:
    """Traced: the `StepValues` of two disjoint pieces of one batch, as one batch's."""
    if a.per_example:
        if a.weights is None and b.weights is None:
            return StepValues(jnp.concatenate([a.values, b.values]), None, True)
        weights = [
            jnp.ones(part.values.shape[:1], jnp.float32) if part.weights is None else part.weights
            for part in (a, b)
        ]
        return StepValues(jnp.concatenate([a.values, b.values]), jnp.concatenate(weights), True)
    weight = a.weights + b.weights
    # `where`, not arithmetic: a piece of weight 0 may hold NaN (a padding example's).
    total = jnp.where(a.weights > 0, a.values * a.weights, 0.0) + jnp.where(
        b.weights > 0, b.values * b.weights, 0.0
    )
    return StepValues(total / jnp.where(weight > 0, weight, 1.0), weight, False)


class HostMetrics:
    """The host metrics of one kind (train or eval) of one trainer."""

    def __init__(self, metrics: tuple, axis: str, num_devices: int):
        self.metrics = metrics
        self.names = frozenset(metric.name for metric in metrics)
        self.axis = axis
        self.single = num_devices == 1
        self.max_pending = MAX_PENDING
        self._stream = _Stream(metrics, self.max_pending)
        self._warned: set[str] = set()  # metrics whose state cannot be checkpointed

    def __bool__(self) -> bool:
        return bool(self.metrics)

    # -- inside the compiled step ----------------------------------------------------------

    def step_values(
        self, labels, predictions, valid: jax.Array | None = None
    ) -> dict[str, StepValues]:
        """Traced per device: every host metric's `StepValues` for the global batch.

        Args:
          labels: this device's shard of the labels.
          predictions: the model's outputs for the shard.
          valid: this device's bool scalar, or None: when False (a padding example, a
            skipped step) the shard's values are left out.

        Returns:
          `{name: StepValues}` of every host metric, identical on every device.
        """
        return {
            metric.name: self._metric_values(metric, labels, predictions, valid)
            for metric in self.metrics
        }

    def _metric_values(self, metric, labels, predictions, valid) -> StepValues:
        value = _as_real(metric.name, metric.device_values(labels, predictions))
        if value.ndim == 0:
            weight = jnp.asarray(batch_size_of(predictions), jnp.float32)
            if valid is not None:
                weight = jnp.where(valid, weight, 0.0)
            total = jnp.where(weight > 0, value * weight, 0.0)
            if not self.single:
                total, weight = jax.lax.psum((total, weight), self.axis)
            mean = total / jnp.where(weight > 0, weight, 1.0)
            return StepValues(mean[None], weight[None], False)
        weights = None
        if valid is not None:
            weights = jnp.broadcast_to(valid, value.shape[:1]).astype(jnp.float32)
        if not self.single:
            # Every device gathers the same values; pmax marks them replicated for
            # shard_map (its check cannot infer that of all_gather).
            value, weights = jax.tree.map(
                lambda leaf: jax.lax.pmax(
                    jax.lax.all_gather(leaf, self.axis, tiled=True), self.axis
                ),
                (value, weights),
            )
        return StepValues(value, weights, True)

    # -- on the host ---------------------------------------------------------------------

    def results(self, names: Sequence[str], values: Mapping[str, Any]) -> dict[str, Any]:
        """The metrics dict of a step, in the order of `names`; host metrics' entries are lazy.

        The host metrics' step values wait in the stream, unread, and their entries are
        `HostMetricValue`s that read them when asked.

        Args:
          names: every metric name, in the order of the dict.
          values: the step's outputs by name (a compiled program returns its dict with
            the keys sorted): the compiled metrics' values, and a host metric's
            `StepValues`.

        Returns:
          `{name: value}` in the order of `names`.
        """
        if not self.metrics:
            return {name: values[name] for name in names}
        index = self._stream.push(tuple(values[metric.name] for metric in self.metrics))
        return {
            name: (self._stream.value(index, name) if name in self.names else values[name])
            for name in names
        }

    @property
    def pending_steps(self) -> int:
        """How many steps' values wait on the device, not yet folded into the host states."""
        return len(self._stream.pending)

    @property
    def copied_through(self) -> int:
        """The last step whose values' copy to the host has started; -1 before any.

        Steps count from 0 since the states started (or were reset or set).
        """
        return self._stream.copying

    def reset(self) -> None:
        """Starts the host states afresh; values already handed out keep reading theirs."""
        self._stream = _Stream(self.metrics, self.max_pending)

    # -- what checkpoints keep -----------------------------------------------------------

    def get_state(self) -> dict[str, Any]:
        """The host states after every step pushed so far, as JSON by metric name.

        Folds the pending step values in first (it waits for those steps). A metric whose
        `host_state_dict` is missing or returns None is left out, with a warning (once):
        a resumed run starts it afresh.
        """
        saved = self._stream.saved_states()
        for metric in self.metrics:
            if metric.name not in saved and metric.name not in self._warned:
                self._warned.add(metric.name)
                _warnings.warn(
                    f"host metric {metric.name!r} ({type(metric).__name__}) gives no state to "
                    "checkpoint (its host_state_dict returns None), so a resumed run starts it "
                    "afresh and its values differ from an uninterrupted run's; implement "
                    "host_state_dict and load_host_state_dict (see loopax.metrics.HostMetric)"
                )
        return saved

    def set_state(self, saved: dict[str, Any]) -> None:
        """Goes on from the host states of `get_state()`; a metric missing from it starts afresh.

        Values already handed out keep reading the states they came from.

        Raises:
          ValueError: a saved state does not fit its metric (as its `load_host_state_dict`
            says).
        """
        self._stream = _Stream(self.metrics, self.max_pending, saved)


def _loaded(metric: Any, data: Any) -> Any:
    """`metric`'s host state from its saved `data`.

    Raises:
      ValueError: the metric cannot load it (naming the metric).
    """
    load = getattr(metric, "load_host_state_dict", None)
    if not callable(load):
        raise ValueError(
            f"host metric {metric.name!r} ({type(metric).__name__}) has a saved state but no "
            "load_host_state_dict to read it; implement it (see loopax.metrics.HostMetric)"
        )
    try:
        return load(data)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(
            f"the saved state of host metric {metric.name!r} does not fit it "
            f"({type(err).__name__}: {err}); was it saved with other settings? Attach the "
            "checkpoint with restore='never' to start afresh"
        ) from err


def fetch(entries: list) -> list:
    """Reads step values from the device whose copies to the host were started."""
    # Leaf by leaf: jax.device_get would start each copy again, ~8 µs per array.
    return jax.tree.map(np.asarray, entries)


class _Stream:
    """The host states of a run of steps and the step values not yet folded into them.

    Step values are folded in step order. A `HostMetricValue` reports its metric as of
    its own step: if the states move past that step before it is read (another reader
    read a later step, or the pending values were folded to bound them) while it is still
    referenced, its value is computed just before they do. A lock keeps a read from
    another thread (a writer's) from folding while the loop pushes.
    """

    def __init__(self, metrics: tuple, max_pending: int, saved: dict[str, Any] | None = None):
        self.metrics = metrics
        self.positions = {metric.name: position for position, metric in enumerate(metrics)}
        saved = saved or {}
        self.states = [
            _loaded(metric, saved[metric.name]) if metric.name in saved else metric.init_host()
            for metric in metrics
        ]
        self.pending: collections.deque[tuple[int, tuple]] = collections.deque()
        self.max_pending = max_pending
        self.pushed = 0  # steps pushed; the next step's index
        self.copying = -1  # the last step whose copy to the host was started
        # (step index, position) -> the still-referenced, not yet computed value.
        self.unread: weakref.WeakValueDictionary[tuple[int, int], HostMetricValue] = (
            weakref.WeakValueDictionary()
        )
        self.lock = threading.Lock()

    def push(self, step_values: tuple) -> int:
        with self.lock:
            index = self.pushed
            self.pushed += 1
            self.pending.append((index, step_values))
            count = len(self.pending)
            if count >= self.max_pending:
                self._fold_through(self.pending[count - self.max_pending // 2 - 1][0])
                self._copy_async(self.pushed - 1)
            elif count == self.max_pending // 2:
                self._copy_async(index)
            return index

    def value(self, index: int, name: str) -> HostMetricValue:
        value = HostMetricValue(self, index, self.positions[name])
        self.unread[index, value.position] = value
        return value

    def copy_async(self, through: int) -> None:
        """Starts copying the pending values of steps `<= through` to the host."""
        with self.lock:
            self._copy_async(through)

    def _copy_async(self, through: int) -> None:
        """Starts the copies of the pending steps `<= through` not started yet."""
        for index, step_values in self.pending:
            if index > through:
                break
            if index > self.copying:
                for leaf in jax.tree.leaves(step_values):
                    leaf.copy_to_host_async()
        self.copying = max(self.copying, through)

    def _fold_through(self, through: int) -> None:
        """Fetches the pending values of steps `<= through` and folds them in.

        Each metric gets the values of consecutive steps in one `update_host` call,
        split only at the steps whose values are still referenced unread, which are
        computed there.
        """
        entries = []
        while self.pending and self.pending[0][0] <= through:
            entries.append(self.pending.popleft())
        if not entries:
            return
        self._copy_async(through)
        host_entries = fetch([step_values for _, step_values in entries])
        for position in range(len(self.metrics)):
            run: list[np.ndarray] = []
            for (index, _), step_values in zip(entries, host_entries, strict=True):
                kept = step_values[position].kept()
                if kept.size:
                    run.append(kept)
                waiting = self.unread.pop((index, position), None)
                if waiting is not None:
                    self._update(position, run)
                    run = []
                    waiting.computed = self.compute(position)
            self._update(position, run)

    def _update(self, position: int, run: list[np.ndarray]) -> None:
        """Folds the values of consecutive steps into one metric's state."""
        if not run:
            return
        metric = self.metrics[position]
        if len({(values.shape[1:], values.dtype) for values in run}) == 1:
            self.states[position] = metric.update_host(self.states[position], np.concatenate(run))
            return
        for values in run:  # per-example values whose shapes vary from step to step
            self.states[position] = metric.update_host(self.states[position], values)

    def compute(self, position: int) -> float:
        return float(self.metrics[position].compute_host(self.states[position]))

    def saved_states(self) -> dict[str, Any]:
        """Every pending step folded in, the states that can be saved, by metric name."""
        with self.lock:
            if self.pending:
                self._fold_through(self.pending[-1][0])
            saved = {}
            for metric, state in zip(self.metrics, self.states, strict=True):
                to_dict = getattr(metric, "host_state_dict", None)
                data = to_dict(state) if callable(to_dict) else None
                if data is not None:
                    saved[metric.name] = data
            return saved

    def read(self, value: HostMetricValue) -> float:
        with self.lock:
            if value.computed is not None:  # computed by a fold on another thread
                return value.computed
            self._fold_through(value.index)
            # Folding past a referenced value computes it, so the states are at its step.
            self.unread.pop((value.index, value.position), None)
            return self.compute(value.position)


class HostMetricValue:
    """A host metric's value at one step, read from the device only when asked for.

    `float(value)`, `np.asarray(value)`, `value.item()`, formatting and
    `jax.device_get(value)` read it (once; later reads return the same number).
    `copy_to_host_async()` starts the transfer of its pending step values without waiting.
    """

    __slots__ = ("__weakref__", "computed", "index", "position", "stream")
    shape = ()
    ndim = 0
    dtype = np.dtype(np.float64)

    def __init__(self, stream: _Stream, index: int, position: int):
        self.stream: _Stream | None = stream
        self.index = index
        self.position = position
        self.computed: float | None = None

    def item(self) -> float:
        """Reads the value: the metric as of this step (a Python float)."""
        if self.computed is None:
            assert self.stream is not None
            self.computed = self.stream.read(self)
        self.stream = None  # the stream's pending values and states may be freed
        return self.computed

    def copy_to_host_async(self) -> None:
        """Starts copying the step values this value needs to the host; does not wait."""
        if self.computed is None and self.stream is not None:
            self.stream.copy_async(self.index)

    def __float__(self) -> float:
        return self.item()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.asarray(self.item(), dtype=dtype)

    def __format__(self, spec: str) -> str:
        return format(self.item(), spec)

    def __repr__(self) -> str:
        return f"HostMetricValue({self.item()!r})"
