"""The streaming median: a host metric over a bounded uniform sample of the values seen."""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._base import set_names
from ._host import HostMetric
from ._mean import check_name_and_fn

MetricFn = Callable[[Sequence[jax.Array], Sequence[jax.Array]], jax.Array]

DEFAULT_SAMPLE_SIZE = 10_001  # GoMLX's: odd, so a full sample's median is one of its values


@dataclasses.dataclass
class StreamingMedianState:
    """The host state of `StreamingMedian`: a uniform sample of the values seen.

    Attributes:
      samples: float64 buffer of `sample_size` entries; the first `count` hold the sample.
      count: how many entries of `samples` are in use (`min(seen, sample_size)`).
      seen: how many values were offered since the state was made.
      rng: decides which values replace which samples once the buffer is full.
    """

    samples: np.ndarray
    count: int
    seen: int
    rng: np.random.Generator


class StreamingMedian(HostMetric):
    """The median of `fn(labels, predictions)` over a bounded sample of every value seen.

    GoMLX's `StreamingMedianMetric`: the values are kept on the host (see `HostMetric`,
    nothing is read per step) in a uniform random sample of at most `sample_size`
    values (reservoir sampling: each of the `n` values seen so far is in it with
    probability `sample_size / n`), and the reported value is the sample's median. Up to
    `sample_size` values the sample holds them all and the median is exact, `np.median`
    of them (the mean of the two middle values for an even count); past it, it is an
    estimate whose error shrinks with `sample_size`. It is NaN before any value.

    `fn` returns per-example values (each element counts once; under data parallelism
    the values of every device's shard are gathered, so every example counts once) or a
    scalar batch mean (one value per step, the mean over the whole global batch: then it
    is the median of the batch means, as in GoMLX). The device sends the values as
    float32 (float64 when `fn` returns float64).

    The sample lives on the host; checkpoints keep it, with the generator's position
    (`host_state_dict`), so a resumed run's median equals an uninterrupted run's.
    `Trainer.reset_train_metrics()` (or, for eval, each evaluation) empties it.

    Args:
      name: the metric's key in the metrics dict (unique per trainer).
      fn: `fn(labels, predictions) -> jax.Array`, traced inside the compiled step.
      sample_size: the most values kept; memory is 8 bytes per value.
      seed: seeds the choice of the values kept once the sample is full.
      short_name: compact name for progress bars; defaults to `name`.
      metric_type: plots group metrics of the same type, e.g. `"loss"`.

    Raises:
      ValueError: `name` is empty or `sample_size` is not a positive int.
      TypeError: `fn` is not callable.

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> median = StreamingMedian("median_abs_error", lambda y, p: jnp.abs(y[0] - p[0]))
      >>> state = median.init_host()
      >>> for errors in ([3.0, 1.0], [10.0, 2.0, 4.0]):
      ...     state = median.update_host(state, np.array(errors))
      >>> median.compute_host(state)
      3.0
    """

    def __init__(
        self,
        name: str,
        fn: MetricFn,
        *,
        sample_size: int = DEFAULT_SAMPLE_SIZE,
        seed: int = 0,
        short_name: str | None = None,
        metric_type: str = "",
    ):
        check_name_and_fn(name, fn)
        if isinstance(sample_size, bool) or not isinstance(sample_size, (int, np.integer)):
            raise ValueError(
                f"StreamingMedian {name!r}: sample_size must be an int, got {sample_size!r}; "
                f"{DEFAULT_SAMPLE_SIZE} (the default) keeps up to that many values"
            )
        if sample_size < 1:
            raise ValueError(
                f"StreamingMedian {name!r}: sample_size={sample_size} must be >= 1; "
                f"{DEFAULT_SAMPLE_SIZE} (the default) keeps up to that many values"
            )
        set_names(self, name, short_name, metric_type)
        self.fn = fn
        self.sample_size = int(sample_size)
        self.seed = seed

    def device_values(
        self, labels: Sequence[jax.Array], predictions: Sequence[jax.Array]
    ) -> jax.Array:
        """Returns `fn(labels, predictions)`: per-example values or a scalar batch mean."""
        return jnp.asarray(self.fn(labels, predictions))

    def init_host(self) -> StreamingMedianState:
        """Returns an empty sample, with its random generator seeded from `seed`."""
        return StreamingMedianState(
            samples=np.empty(self.sample_size, np.float64),
            count=0,
            seen=0,
            rng=np.random.default_rng(self.seed),
        )

    def update_host(self, state: StreamingMedianState, values: np.ndarray) -> StreamingMedianState:
        """Offers every element of `values` to the sample, in order (updates `state`).

        Until the buffer is full every value is kept; then the `k`-th value seen replaces
        a uniformly chosen sample with probability `sample_size / k` (Algorithm R, drawn
        for the whole array at once). Each value takes two draws of the generator, whether
        to keep it and where, so the sample does not depend on how the values came in
        chunks (when the trainer read them): a resumed run keeps the uninterrupted run's.

        Args:
          state: the running sample.
          values: the step's values; every element is one value.

        Returns:
          `state`, updated in place.
        """
        flat = np.asarray(values, np.float64).reshape(-1)
        capacity = state.samples.shape[0]
        fill = min(capacity - state.count, flat.shape[0])
        state.samples[state.count : state.count + fill] = flat[:fill]
        state.count += fill
        state.seen += fill
        rest = flat[fill:]
        if rest.shape[0]:
            positions = np.arange(state.seen + 1, state.seen + 1 + rest.shape[0])
            draws = state.rng.random((rest.shape[0], 2))  # per value: keep it? where?
            kept = draws[:, 0] * positions < capacity
            slots = (draws[kept, 1] * capacity).astype(np.int64)  # uniform in [0, capacity)
            # Sequentially a later value overwrites an earlier one in the same slot: keep
            # each slot's last value (numpy leaves repeated-index assignment unordered).
            reversed_slots, last = np.unique(slots[::-1], return_index=True)
            state.samples[reversed_slots] = rest[kept][::-1][last]
            state.seen += rest.shape[0]
        return state

    def host_state_dict(self, state: StreamingMedianState) -> dict[str, Any]:
        """Returns the sample as JSON: its values, counts and random generator's state.

        The values go exactly, as their float64 bytes in base64.
        """
        values = np.ascontiguousarray(state.samples[: state.count], "<f8")
        return {
            "samples": base64.b64encode(values.tobytes()).decode("ascii"),
            "count": int(state.count),
            "seen": int(state.seen),
            "rng": state.rng.bit_generator.state,
        }

    def load_host_state_dict(self, saved: dict[str, Any]) -> StreamingMedianState:
        """Returns the sample `host_state_dict` saved, ready to take more values.

        Raises:
          ValueError: the saved sample holds more values than `sample_size`.
        """
        values = np.frombuffer(base64.b64decode(saved["samples"]), "<f8")
        count = int(saved["count"])
        if values.shape[0] != count or count > self.sample_size:
            raise ValueError(
                f"StreamingMedian {self.name!r}: the saved sample holds {values.shape[0]} "
                f"values (count {count}) and sample_size is {self.sample_size}; use the "
                "sample_size it was saved with"
            )
        state = self.init_host()
        state.samples[:count] = values
        state.count, state.seen = count, int(saved["seen"])
        state.rng.bit_generator.state = saved["rng"]
        return state

    def compute_host(self, state: StreamingMedianState) -> float:
        """Returns the median of the sample, or NaN when it is empty."""
        if state.count == 0:
            return float("nan")
        return float(np.median(state.samples[: state.count]))


def median_loss(
    loss_fn: MetricFn,
    *,
    name: str = "median_loss",
    short_name: str = "median",
    sample_size: int = DEFAULT_SAMPLE_SIZE,
    seed: int = 0,
) -> StreamingMedian:
    """A `StreamingMedian` of the per-example values of a loss function.

    Losses return the batch mean; this applies `loss_fn` to each example on its own (a
    batch of one, vectorized with `jax.vmap`), so the median is over examples. It
    includes only `loss_fn`, not terms the model adds with `ctx.add_loss`; an example
    that a mask in the labels leaves out counts with whatever `loss_fn` returns for an
    all-masked batch.

    Args:
      loss_fn: `loss_fn(labels, predictions) -> loss`, e.g.
        `loopax.losses.mean_squared_error`; every label and prediction must have the
        batch as its first axis.
      name: the metric's key in the metrics dict.
      short_name: compact name for progress bars.
      sample_size: the most values kept (see `StreamingMedian`).
      seed: seeds the sampling (see `StreamingMedian`).

    Returns:
      A `StreamingMedian` with metric type `"loss"`.

    Raises:
      TypeError: `loss_fn` is not callable.
      ValueError: `name` is empty or `sample_size` is not a positive int.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, flax.linen as nn
      >>> import loopax
      >>> from loopax import losses
      >>> metric = median_loss(losses.mean_absolute_error)
      >>> metric.device_values([jnp.array([[1.0], [5.0]])], [jnp.zeros((2, 1))])
      Array([1., 5.], dtype=float32)
      >>> def model_fn(ctx, spec, inputs):  # predicts 0 (and learns nothing at rate 0)
      ...     return nn.Dense(1, kernel_init=nn.initializers.zeros)(inputs[0])
      >>> trainer = loopax.Trainer(model_fn, losses.mean_absolute_error, optax.sgd(0.0),
      ...                          train_metrics=[metric], devices=jax.devices()[:1])
      >>> x = np.ones((3, 1), np.float32)
      >>> for y in ([[1.0], [2.0], [9.0]], [[4.0], [5.0], [6.0]]):
      ...     values = trainer.train_step(None, [x], [np.array(y, np.float32)])
      >>> float(values["median_loss"])  # of 1, 2, 9, 4, 5, 6, read only now
      4.5
    """
    if not callable(loss_fn):
        raise TypeError(
            f"median_loss: loss_fn must be callable as loss_fn(labels, predictions), "
            f"got {loss_fn!r}"
        )

    def one_example(labels, predictions):
        return loss_fn([x[None] for x in labels], [x[None] for x in predictions])

    def per_example_loss(labels, predictions):
        return jax.vmap(one_example)(list(labels), list(predictions))

    return StreamingMedian(
        name,
        per_example_loss,
        sample_size=sample_size,
        seed=seed,
        short_name=short_name,
        metric_type="loss",
    )
