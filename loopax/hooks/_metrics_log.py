"""`metrics_log`: train and eval metric points in a CSV or JSON-lines file, for pandas users."""

from __future__ import annotations

import os
from collections.abc import Mapping

from .. import _validate
from ..loop import Loop, Priority
from ..trainer import Trainer
from ._points import PointsFile, format_from_path, points_of
from ._schedules import EveryNEpochs
from ._writers import MetricWriter, write_metrics


class MetricsLog(MetricWriter):
    """Appends metric points to a CSV or JSON-lines file; created by `metrics_log`.

    Args:
      path: the file; its directory is created on the first write.
      file_format: `"csv"` or `"jsonl"`.
      trainer: the trainer whose metrics are described (short names, types).

    Attributes:
      path: the file written.
      file_format: `"csv"` or `"jsonl"`.
    """

    file: PointsFile
    path: str
    file_format: str

    def __init__(self, path: str, file_format: str, trainer: Trainer):
        self.file = PointsFile(path, file_format)
        self.path = self.file.path
        self.file_format = self.file.file_format
        self.trainer = trainer

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        self.file.append(points_of(self.trainer, step, scalars))

    def truncate_after(self, step: int) -> None:
        self.file.truncate_after(step)


def metrics_log(
    loop: Loop,
    path: str | os.PathLike[str],
    *,
    every_n_steps: int = 100,
    every_n_epochs: int | None = None,
    format: str | None = None,  # noqa: A002 - the natural name, as in matplotlib's savefig
    call_on_end: bool = True,
    learning_rate: bool = True,
    priority: int = Priority.LOG,
) -> MetricsLog:
    """Appends train and eval metric points to a CSV or JSON-lines file.

    Each point is one row `metric, short, type, step, value`, where `metric` is the key every
    loopax writer, monitor and `loop.history` uses (`train/loss`, `eval/test/Accuracy`),
    `step` the global step, and non-finite values are skipped; so `pandas.read_csv(path)` (or
    `pandas.read_json(path, lines=True)`) then `.pivot_table(index="step", columns="metric",
    values="value")` gives one column per key. Train metrics (with `train/learning_rate` when
    the optimizer exposes it, as Keras's CSVLogger logs it) are written every
    `every_n_steps` (and at the end of each run); every evaluation when it is published.
    Resuming drops the points of the steps that run again, and each point is in the file
    before the checkpoint that covers it commits. Only process 0 writes.

    Args:
      loop: the `loopax.Loop`.
      path: the file; its directory is created. A `.csv` suffix selects CSV, anything else
        JSON lines, unless `format` says.
      every_n_steps: write the train metrics after step k iff `(k + 1) % every_n_steps == 0`.
      every_n_epochs: instead, write them at the end of every n-th epoch of `run_epochs` (as
        Keras's CSVLogger does each epoch).
      format: `"csv"`, `"jsonl"`, or None to pick from the suffix.
      call_on_end: also write the last step's train metrics at the end of each run (not of
        a run SIGINT or SIGTERM interrupted, see `loop.interrupted`).
      learning_rate: write `train/learning_rate` with the train metrics.
      priority: the hooks' priority (default `Priority.LOG`: after evaluations).

    Returns:
      The `MetricsLog`.

    Raises:
      ValueError: `every_n_steps` is not a positive int or `format` is unknown.
    """
    path = _validate.path("path", path, "metrics_log: ")
    log = MetricsLog(path, format_from_path(path, format), loop.trainer)
    write_metrics(
        loop,
        log,
        every_n_steps=every_n_steps,
        when=None if every_n_epochs is None else EveryNEpochs(every_n_epochs),
        call_on_end=call_on_end,
        learning_rate=learning_rate,
        name=f"metrics_log({log.path})",
        priority=priority,
    )
    return log
