"""The record of a run's metrics: one naming scheme, `History`, and evaluation records.

Every metric a hook logs, monitors or plots has one key: `"train/<metric>"` for a train
metric (`"train/loss"`) and `"eval/<dataset>/<metric>"` for an evaluation
(`"eval/test/mean_loss"`), where `<metric>` is the metric's `name`.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any

TRAIN = "train"
EVAL = "eval"


def train_key(metric: str) -> str:
    """The key of train metric `metric`: `"train/<metric>"`."""
    return f"{TRAIN}/{metric}"


def eval_key(dataset: str, metric: str) -> str:
    """The key of eval metric `metric` on `dataset`: `"eval/<dataset>/<metric>"`."""
    return f"{EVAL}/{dataset}/{metric}"


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """One evaluation of one dataset, as `Loop.evaluate` publishes it.

    Attributes:
      step: the trainer's global step when it ran.
      dataset: the dataset's name.
      values: `{eval metric name: float}` (`"mean_loss"`, then the user's eval metrics).
    """

    step: int
    dataset: str
    values: Mapping[str, float]

    def keyed(self) -> dict[str, float]:
        """The values keyed `"eval/<dataset>/<metric>"`."""
        return {eval_key(self.dataset, name): value for name, value in self.values.items()}


class History(Mapping[str, list[tuple[int, float]]]):
    """Every logged metric value of a loop, by key, in step order; see `Loop.history`.

    `history["eval/test/mean_loss"]` is a list of `(global_step, value)`. Train metrics
    appear at the steps a logging hook (TensorBoard, metrics_log, plot) read them, every
    evaluation at its step. A value recorded again at the same step replaces the old one.
    It is saved with checkpoints, so it survives a resume.

    Example:
      >>> history = History()
      >>> history.record(10, {"train/loss": 0.5})
      >>> history.record(20, {"train/loss": 0.25, "eval/test/mean_loss": 0.3})
      >>> history["train/loss"], list(history)
      ([(10, 0.5), (20, 0.25)], ['train/loss', 'eval/test/mean_loss'])
    """

    def __init__(self) -> None:
        self._series: dict[str, list[tuple[int, float]]] = {}

    def record(self, step: int, values: Mapping[str, float]) -> None:
        """Adds `values` (`{key: number}`) at global step `step`."""
        step = int(step)
        for key, value in values.items():
            series = self._series.setdefault(key, [])
            point = (step, float(value))
            if not series or series[-1][0] < step:
                series.append(point)
            elif series[-1][0] == step:
                series[-1] = point
            else:  # an earlier step, e.g. after a rollback that did not truncate first
                index = bisect.bisect_left(series, step, key=lambda item: item[0])
                if index < len(series) and series[index][0] == step:
                    series[index] = point
                else:
                    series.insert(index, point)

    def truncate_after(self, step: int) -> None:
        """Drops the values of steps after `step` (they will be computed again)."""
        for key in list(self._series):
            series = self._series[key]
            cut = bisect.bisect_right(series, step, key=lambda item: item[0])
            if cut == 0:
                del self._series[key]
            else:
                del series[cut:]

    def value_at(self, key: str, step: int) -> float | None:
        """The value of `key` recorded at exactly `step`, or None."""
        series = self._series.get(key, ())
        index = bisect.bisect_left(series, step, key=lambda item: item[0])
        if index < len(series) and series[index][0] == step:
            return series[index][1]
        return None

    def latest(self, key: str) -> tuple[int, float] | None:
        """The newest `(step, value)` of `key`, or None."""
        series = self._series.get(key)
        return series[-1] if series else None

    def __getitem__(self, key: str) -> list[tuple[int, float]]:
        try:
            return list(self._series[key])
        except KeyError:
            raise KeyError(
                f"no metric {key!r} in the history; recorded: {sorted(self._series)}. Keys are "
                "'train/<metric>' or 'eval/<dataset>/<metric>'"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._series)

    def __len__(self) -> int:
        return len(self._series)

    def to_pandas(self) -> Any:
        """A `pandas.DataFrame` with one row per step and one column per key.

        NaN where a key has no value at a step. Needs pandas.

        Raises:
          ImportError: pandas is not installed.
        """
        try:
            import pandas  # noqa: PLC0415
        except ImportError as err:
            raise ImportError(
                "History.to_pandas needs pandas, which is not installed: pip install pandas"
            ) from err
        columns = {key: dict(series) for key, series in self._series.items()}
        return pandas.DataFrame(columns).sort_index().rename_axis("step")

    def get_state(self) -> dict[str, Any]:
        """The history as JSON-serializable data (non-finite values as strings)."""
        return {
            key: [[step, value if math.isfinite(value) else repr(value)] for step, value in series]
            for key, series in self._series.items()
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Replaces the history with one from `get_state`."""
        self._series = {
            key: [(int(step), float(value)) for step, value in series]
            for key, series in state.items()
        }

    def __repr__(self) -> str:
        sizes = ", ".join(f"{key}: {len(series)}" for key, series in self._series.items())
        return f"History({sizes})"
