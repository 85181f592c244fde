"""`metrics_log`: train and eval metric points in a CSV or JSON-lines file, for pandas users."""

from __future__ import annotations

import os
from typing import Any

import jax

from ..trainer._hooks import Priority
from ._evaluate import EvalWatcher
from ._metric_info import is_writer_process
from ._points import PointsFile, eval_points, format_from_path, train_points
from ._schedules import EveryNSteps


class MetricsLog:
    """Appends metric points to a file; created by `metrics_log`.

    Attributes:
      path: the file written.
      file_format: `"csv"` or `"jsonl"`.
      schedule: the `EveryNSteps` schedule of the train points.
    """

    # Reads the device only on the steps it writes, so the loop must not check the loss
    # before it every step.
    checks_finite_lazily = True

    def __init__(self, path: str, file_format: str, every_n_steps: int, call_on_end: bool):
        self.schedule = EveryNSteps(every_n_steps)
        self.call_on_end = call_on_end
        self.file = PointsFile(path, file_format)
        self.path = self.file.path
        self.file_format = self.file.file_format
        self._watcher = EvalWatcher()
        self._run_index: int | None = None
        self._last_train_step = -1

    def _write_train(self, loop: Any, metrics: Any) -> None:
        step = loop.trainer.global_step
        if not metrics or step == self._last_train_step:
            return
        self._last_train_step = step
        self.file.append(train_points(loop.trainer, jax.device_get(metrics), step))

    def _write_new_evals(self, loop: Any) -> None:
        step, new = self._watcher.new_results(loop)
        points = []
        for name, results in new.items():
            points += eval_points(loop.trainer, name, results, step)
        self.file.append(points)

    def __call__(self, loop: Any, metrics: Any) -> None:
        if loop.run_index != self._run_index:
            self._run_index = loop.run_index
            # Resuming from a checkpoint: the steps after it run again, so drop their points.
            self.file.truncate_after(loop.trainer.global_step - 1)
        if self.schedule.should_fire(loop.loop_step):
            self._write_train(loop, metrics)
        self._write_new_evals(loop)

    def on_end(self, loop: Any, metrics: Any) -> None:
        """Writes the last step's train metrics (with `call_on_end`) and any new evaluation."""
        if self.call_on_end:
            self._write_train(loop, metrics)
        self._write_new_evals(loop)


def metrics_log(
    loop: Any,
    path: str | os.PathLike,
    *,
    every_n_steps: int = 100,
    format: str | None = None,  # noqa: A002 - the natural name, as in matplotlib's savefig
    call_on_end: bool = True,
    priority: int = Priority.LOG,
) -> MetricsLog:
    """Appends train and eval metric points to a CSV or JSON-lines file.

    Each point is one row `metric, short, type, step, value` (the plot hook's format: train
    series `Train: <metric>`, eval series `<metric> on <dataset>`, `step` the global step,
    non-finite values skipped), so `pandas.read_csv(path)` or `pandas.read_json(path,
    lines=True)` then `.pivot_table(index="step", columns="metric", values="value")` gives one
    column per series. Train metrics are written every `every_n_steps` (and at the end); every
    evaluation stored in `loop.shared_data` (by `evaluate` or `plot`) is written when it
    appears. Resuming into the same file drops the points of the steps that run again. Only
    process 0 writes.

    Args:
      loop: the `loopax.Loop`.
      path: the file; its directory is created. A `.csv` suffix selects CSV, anything else
        JSON lines, unless `format` says.
      every_n_steps: write the train metrics after step k iff `(k + 1) % every_n_steps == 0`.
      format: `"csv"`, `"jsonl"`, or None to pick from the suffix.
      call_on_end: also write the last step's train metrics at the end of each run.
      priority: the hooks' priority (default `Priority.LOG`: after evaluations).

    Returns:
      The `MetricsLog`.

    Raises:
      ValueError: `every_n_steps` is not a positive int or `format` is unknown.
    """
    log = MetricsLog(os.fspath(path), format_from_path(os.fspath(path), format), every_n_steps,
                     call_on_end)
    if is_writer_process():
        loop.on_step(f"metrics_log({log.path})", log, priority=priority)
        loop.on_end(f"metrics_log({log.path})", log.on_end, priority=priority)
    return log
