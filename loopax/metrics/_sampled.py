"""`SampledSet`: a host metric keeping a fixed-size uniform sample of per-example values.

bobbin's `SampledSet`: e.g. 20 random predictions with their labels after each evaluation.
The sample is defined by the examples themselves, not by the order they arrive in: each
example's position in the evaluation (its global index: examples are counted in dataset
order, every device's shard and every process's share gathered as on one device) gets a
key from a seeded hash, and the sample is the `size` examples with the smallest keys. So it
is uniform (every subset of `size` examples equally likely over seeds), deterministic for a
seed, the same on any number of devices and processes, and two samples merge exactly.
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._base import format_number, set_names
from ._host import HostMetric

MetricFn = Callable[[Sequence[jax.Array], Sequence[jax.Array]], jax.Array]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(values: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer of `values + golden`: a bijection of uint64, well mixed."""
    with np.errstate(over="ignore"):
        z = values.astype(np.uint64) + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX_1
        z = (z ^ (z >> np.uint64(27))) * _MIX_2
        return z ^ (z >> np.uint64(31))


def sample_keys(seed: int, indices: np.ndarray) -> np.ndarray:
    """The seeded keys (uint64) of examples at global `indices`: distinct for distinct ones.

    Example:
      >>> import numpy as np
      >>> keys = sample_keys(0, np.arange(4))
      >>> keys.dtype, len(set(keys.tolist()))
      (dtype('uint64'), 4)
    """
    mix = _splitmix64(np.array([seed % 2**64], np.uint64))[0]
    return _splitmix64(np.asarray(indices, np.uint64) ^ mix)


@dataclasses.dataclass
class SampledSetState:
    """The host state of `SampledSet`.

    Attributes:
      indices: int64 `[k]`, the global indices of the sampled examples (k <= size),
        ascending.
      rows: float64 `[k, width]`, their values (one row per example), or None before any.
      seen: how many examples were offered since the state was made.
    """

    indices: np.ndarray
    rows: np.ndarray | None
    seen: int


@dataclasses.dataclass(frozen=True)
class Sample:
    """A `SampledSet`'s sample: examples by global index, with their values.

    Attributes:
      indices: int64 `[k]`, each example's index in the evaluation (0-based), ascending.
      rows: float64 `[k, width]`, each example's values.
      columns: the name of each of the `width` columns.
      seen: how many examples the sample was drawn from.
    """

    indices: np.ndarray
    rows: np.ndarray
    columns: tuple[str, ...]
    seen: int

    def table(self) -> str:
        """The sample as a Markdown table (TensorBoard's TEXT tab renders it).

        Example:
          >>> import numpy as np
          >>> print(Sample(np.array([3]), np.array([[1.0, 0.25]]), ("label", "p"), 10).table())
          1 of 10 examples
          <BLANKLINE>
          | example | label | p |
          |---|---|---|
          | 3 | 1 | 0.25 |
        """
        lines = [
            f"{len(self.indices)} of {self.seen} examples",
            "",
            "| " + " | ".join(("example", *self.columns)) + " |",
            "|" + "---|" * (len(self.columns) + 1),
        ]
        for index, row in zip(self.indices, self.rows, strict=True):
            cells = [str(int(index)), *(_cell(value) for value in row)]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)


def _cell(value: float) -> str:
    if np.isfinite(value) and float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return f"{value:.6g}"


class SampledSet(HostMetric):
    """A fixed-size uniform sample of per-example values over an evaluation (bobbin's).

    A host metric (see `HostMetric`: nothing is read per step): each example's values
    (`fn(labels, predictions)`, by default its labels and predictions) are offered to a
    sample of at most `size` examples. The sample is the `size` examples whose seeded keys
    (a hash of `seed` and the example's global index in the evaluation) are the smallest:
    uniform, deterministic for a seed, and the same on any number of devices and
    processes (the trainer gathers every shard in dataset order, so an example's index
    does not depend on where it ran). Each evaluation starts a fresh one.

    After each evaluation `hooks.tensorboard` writes it as a Markdown table (the TEXT tab,
    run `eval/<dataset>`, tag `name`); `latest` holds the sample as of the metric's latest
    computed value (e.g. the end of `Trainer.evaluate`). The metric's value (in the
    evaluation's results and the scalar writers) is the number of examples it sampled from.

    Args:
      name: the metric's key in the metrics dict (unique per trainer).
      size: the most examples kept.
      seed: chooses the sample; the same seed samples the same examples.
      fn: `fn(labels, predictions) -> [examples, ...]`, traced inside the compiled step:
        each example's values (an example's row is its values flattened). Default: the
        first label and the first prediction of each example, flattened, side by side.
      columns: a name for each value of an example's row; default `label`, `prediction`
        (numbered `prediction[0]`, ... when there are several), or `value[i]` for `fn`.
      short_name: compact name for progress bars; defaults to `name`.
      metric_type: plots group metrics of the same type.

    Raises:
      ValueError: `name` is empty, `size` is not a positive int, or `seed` not an int.
      TypeError: `fn` is not callable or `columns` not a sequence of str.

    Example:
      >>> import jax, numpy as np, optax, flax.linen as nn
      >>> import loopax
      >>> from loopax import losses, metrics
      >>> sampled = metrics.SampledSet("samples", 3, seed=1)  # labels beside predictions
      >>> def model_fn(ctx, spec, inputs):  # predicts 2 x
      ...     return nn.Dense(1, kernel_init=nn.initializers.constant(2.0))(inputs[0])
      >>> trainer = loopax.Trainer(model_fn, losses.mean_squared_error, optax.sgd(0.0),
      ...                          eval_metrics=[sampled], devices=jax.devices()[:1])
      >>> x = np.arange(10, dtype=np.float32)[:, None]
      >>> data = loopax.ArrayDataset(x, x, batch_size=5, shuffle=False)
      >>> trainer.evaluate(data)["samples"]  # sampled from 10 examples
      10.0
      >>> print(sampled.latest.table())
      3 of 10 examples
      <BLANKLINE>
      | example | label | prediction |
      |---|---|---|
      | 6 | 6 | 12 |
      | 8 | 8 | 16 |
      | 9 | 9 | 18 |
    """

    latest: Sample | None

    def __init__(
        self,
        name: str,
        size: int,
        seed: int = 0,
        *,
        fn: MetricFn | None = None,
        columns: Sequence[str] | None = None,
        short_name: str | None = None,
        metric_type: str = "",
    ):
        if not isinstance(name, str) or not name:
            raise ValueError(
                f"a metric needs a non-empty name (its key in the metrics dict), got {name!r}"
            )
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(
                f"SampledSet {name!r}: size must be a positive int (the most examples kept), "
                f"got {size!r}; e.g. SampledSet({name!r}, 20)"
            )
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise ValueError(f"SampledSet {name!r}: seed must be an int, got {seed!r}")
        if fn is not None and not callable(fn):
            raise TypeError(
                f"SampledSet {name!r}: fn must be callable as fn(labels, predictions), got {fn!r}"
            )
        if columns is not None and (
            isinstance(columns, str) or not all(isinstance(c, str) for c in columns)
        ):
            raise TypeError(
                f"SampledSet {name!r}: columns must be a sequence of str (one per value of "
                f"an example's row), got {columns!r}"
            )
        set_names(self, name, short_name, metric_type)
        self.size = int(size)
        self.seed = int(seed)
        self.fn = fn
        self.columns = None if columns is None else tuple(columns)
        self.latest = None
        self._default_widths: tuple[int, int] | None = None  # (labels, predictions)

    def device_values(
        self, labels: Sequence[jax.Array], predictions: Sequence[jax.Array]
    ) -> jax.Array:
        """Returns each example's row: `fn(labels, predictions)`, or its label and prediction."""
        if self.fn is not None:
            values = jnp.asarray(self.fn(labels, predictions))
            if values.ndim == 0:
                raise ValueError(
                    f"SampledSet {self.name!r}: fn returned a scalar; it must return per-example "
                    "values, an array whose first axis is the batch's examples"
                )
            return values
        prediction = jnp.asarray(predictions[0])
        count = prediction.shape[0]
        parts = [jnp.asarray(labels[0]).reshape(count, -1)] if labels else []
        parts.append(prediction.reshape(count, -1))
        self._default_widths = (parts[0].shape[1] if labels else 0, parts[-1].shape[1])
        return jnp.concatenate([part.astype(jnp.float32) for part in parts], axis=1)

    def init_host(self) -> SampledSetState:
        """Returns an empty sample."""
        return SampledSetState(indices=np.zeros(0, np.int64), rows=None, seen=0)

    def update_host(self, state: SampledSetState, values: np.ndarray) -> SampledSetState:
        """Offers the next examples (global indices `seen`, `seen + 1`, ...) to the sample.

        Keeps the `size` examples with the smallest keys among those kept and these, so
        the sample does not depend on how the values came in chunks.

        Raises:
          ValueError: an example's row has another number of values than earlier ones.
        """
        values = np.asarray(values, np.float64)
        rows = values.reshape(values.shape[0], -1)
        if state.rows is not None and rows.shape[1] != state.rows.shape[1]:
            raise ValueError(
                f"SampledSet {self.name!r}: an example has {rows.shape[1]} values where "
                f"earlier ones had {state.rows.shape[1]}; fn must give every example a row "
                "of the same size"
            )
        indices = np.arange(state.seen, state.seen + rows.shape[0], dtype=np.int64)
        all_indices = np.concatenate([state.indices, indices])
        all_rows = rows if state.rows is None else np.concatenate([state.rows, rows])
        if all_indices.shape[0] > self.size:
            keys = sample_keys(self.seed, all_indices)
            kept = np.sort(np.argpartition(keys, self.size - 1)[: self.size])
            all_indices, all_rows = all_indices[kept], all_rows[kept]
        return SampledSetState(all_indices, all_rows, state.seen + rows.shape[0])

    def sample(self, state: SampledSetState) -> Sample:
        """Returns the state's sample with its column names."""
        rows = np.zeros((0, 0)) if state.rows is None else state.rows
        return Sample(
            state.indices.copy(), rows.copy(), self._column_names(rows.shape[1]), state.seen
        )

    def _column_names(self, width: int) -> tuple[str, ...]:
        if self.columns is not None:
            if len(self.columns) != width and width:
                raise ValueError(
                    f"SampledSet {self.name!r}: {len(self.columns)} columns "
                    f"{list(self.columns)} for rows of {width} values; name each value"
                )
            return self.columns
        if self.fn is None and self._default_widths is not None:
            label_width, prediction_width = self._default_widths
            if label_width + prediction_width == width:
                return (
                    *_numbered("label", label_width),
                    *_numbered("prediction", prediction_width),
                )
        return _numbered("value", width)

    def compute_host(self, state: SampledSetState) -> float:
        """Returns how many examples the sample was drawn from; keeps the sample in `latest`."""
        self.latest = self.sample(state)
        return float(state.seen)

    def pretty_print(self, value: Any) -> str:
        """The number of examples sampled from, as an int."""
        return format_number(value)

    def host_state_dict(self, state: SampledSetState) -> dict[str, Any]:
        """Returns the sample as JSON: indices, rows (float64 bytes in base64) and count."""
        rows = np.zeros((0, 0)) if state.rows is None else state.rows
        return {
            "indices": state.indices.tolist(),
            "rows": base64.b64encode(np.ascontiguousarray(rows, "<f8").tobytes()).decode("ascii"),
            "width": int(rows.shape[1]) if state.rows is not None else None,
            "seen": int(state.seen),
        }

    def load_host_state_dict(self, saved: dict[str, Any]) -> SampledSetState:
        """Returns the sample `host_state_dict` saved.

        Raises:
          ValueError: it holds more examples than `size`.
        """
        indices = np.asarray(saved["indices"], np.int64)
        if indices.shape[0] > self.size:
            raise ValueError(
                f"SampledSet {self.name!r}: the saved sample holds {indices.shape[0]} examples "
                f"and size is {self.size}; use the size it was saved with"
            )
        width = saved["width"]
        rows = None
        if width is not None:
            flat = np.frombuffer(base64.b64decode(saved["rows"]), "<f8")
            rows = flat.reshape(indices.shape[0], int(width)).copy()
        return SampledSetState(indices, rows, int(saved["seen"]))


def _numbered(name: str, width: int) -> tuple[str, ...]:
    return (name,) if width == 1 else tuple(f"{name}[{i}]" for i in range(width))
