"""One writer path: metric points go to pluggable outputs (TensorBoard, CSV/JSONL, plots).

A `MetricWriter` is an output, like CLU's metric writers: it takes scalars keyed
`"train/<metric>"` / `"eval/<dataset>/<metric>"` at a global step. `write_metrics` attaches
one to a loop: train metrics on a schedule (read from the device once per step however many
writers ask, and without waiting for it), every evaluation as it is published, the last
step at the end of each run. It keeps the output consistent with checkpoints: on a resume
or a rollback the output drops the points after the restored step, and before a checkpoint
commits (`loop.flush()`) everything written so far is on disk. So after a crash at any
point, the logs equal an uninterrupted run's.
"""

from __future__ import annotations

import abc
import atexit
from collections.abc import Callable, Mapping
from typing import Any

from ..loop import Loop, Priority, Schedule
from ._metric_info import is_writer_process
from ._schedules import EveryNSteps

Waiter = Callable[[], None]


def _no_wait() -> None:
    return None


# loop.shared_data key: the loop's WriterHooks, which hooks with points of their own
# (hooks.throughput) write to.
WRITERS = "loopax.writers"


class MetricWriter(abc.ABC):
    """An output of metric points; subclass it to send them anywhere (a database, W&B).

    Steps are global steps; keys are `"train/<metric>"`, `"eval/<dataset>/<metric>"`, and
    `"train/learning_rate"`. Only `write_scalars` is required.
    """

    @abc.abstractmethod
    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        """Writes `scalars` (`{key: float}`) at global step `step`."""

    def write_text(self, step: int, tag: str, text: str) -> None:
        """Writes a Markdown text (e.g. the run summary); ignored by default."""
        del step, tag, text

    def truncate_after(self, step: int) -> None:
        """Drops the points written for steps after `step`.

        A resume or a rollback will write them again. Outputs that cannot drop points may ignore
        it.
        """
        del step

    def flush(self) -> None:
        """Blocks until everything written so far survives the process being killed."""
        # An output that buffers nothing has nothing to wait for.
        return None

    def flush_async(self) -> Waiter:
        """Starts a flush; returns a function that waits for it. Default: `flush()` now."""
        self.flush()
        return _no_wait

    def close(self) -> None:
        """Flushes and releases the output."""
        self.flush()


class WriterHooks:
    """The hooks that feed one `MetricWriter`; created by `write_metrics`.

    Attributes:
      writer: the output.
      schedule: when train metrics are written (besides the end of each run).
    """

    def __init__(
        self,
        writer: MetricWriter,
        schedule: Schedule,
        *,
        call_on_end: bool,
        learning_rate: bool,
    ):
        self.writer = writer
        self.schedule = schedule
        self.call_on_end = call_on_end
        self.learning_rate = learning_rate
        self._last_train_step = -1

    def _write_train(self, step: int, values: dict[str, float]) -> None:
        if step != self._last_train_step:
            self._last_train_step = step
            self.writer.write_scalars(step, values)

    def log(self, loop: Loop, metrics: Any = None) -> None:
        """Asks for the latest step's train metrics (written once they are on the host)."""
        del metrics
        if loop.trainer.global_step == self._last_train_step:
            return
        extra = {}
        if self.learning_rate:
            rate = loop.trainer.learning_rate_array()
            if rate is not None:
                extra["train/learning_rate"] = rate
        loop.log_train_metrics(self._write_train, extra)

    def on_start(self, loop: Loop, dataset: Any) -> None:
        del dataset
        self.writer.truncate_after(loop.trainer.global_step)
        self._last_train_step = -1

    def on_evaluation(self, loop: Loop, evaluation: Any) -> None:
        del loop
        self.writer.write_scalars(evaluation.step, evaluation.keyed())

    def on_restore(self, loop: Loop, step: int) -> None:
        del loop
        self.writer.truncate_after(step)
        self._last_train_step = min(self._last_train_step, step)

    def on_flush(self, loop: Loop, argument: Any) -> Waiter:
        del loop, argument
        return self.writer.flush_async()

    def on_end(self, loop: Loop, metrics: Any) -> None:
        # A run a signal interrupted is not over: its resumed run writes the end's point.
        if self.call_on_end and not loop.interrupted:
            self.log(loop, metrics)
        # After every OnEnd hook (and the last train logs) has written: on disk at the end.
        loop.call_after_hooks(self.writer.flush)


def write_metrics(
    loop: Loop,
    writer: MetricWriter,
    *,
    every_n_steps: int | None = 100,
    when: Schedule | None = None,
    call_on_end: bool = True,
    learning_rate: bool = False,
    name: str | None = None,
    priority: int = Priority.LOG,
) -> WriterHooks:
    """Feeds `writer` the loop's metric points: one line for any output.

    Train metrics (`"train/<metric>"`, plus `"train/learning_rate"` with `learning_rate`)
    are written every `every_n_steps` (or at the steps of `when`) and at the end of each
    run (not of a run SIGINT or SIGTERM interrupted: the resumed run ends it, so its output
    equals an uninterrupted run's); every evaluation (`"eval/<dataset>/<metric>"`) when it
    is published. Points after the restored step are dropped on a resume or rollback, and
    `loop.flush()` (before every checkpoint commit) flushes the writer. Only process 0
    writes.

    Args:
      loop: the `loopax.Loop`.
      writer: the output.
      every_n_steps: write the train metrics after step k iff `(k + 1) % every_n_steps ==
        0`; ignored when `when` is given.
      when: a schedule for the train metrics, e.g. `hooks.Exponential(10, 1.2)`, or
        `hooks.EveryNEpochs(1)` for the epoch ends of `run_epochs`.
      call_on_end: also write the last step's train metrics at the end of each run (not
        of an interrupted one, see `loop.interrupted`).
      learning_rate: also write the optimizer's live learning rate.
      name: the hooks' name (default: the writer's class name).
      priority: the hooks' priority (default `Priority.LOG`: after evaluations).

    Returns:
      The `WriterHooks`.

    Raises:
      ValueError: `every_n_steps` is not a positive int (and no `when`).
      TypeError: `writer` is not a `MetricWriter`.
    """
    if not isinstance(writer, MetricWriter):
        raise TypeError(
            f"write_metrics needs a loopax.hooks.MetricWriter, got {type(writer).__name__}; "
            "subclass MetricWriter and implement write_scalars(step, scalars)"
        )
    if when is None:
        if every_n_steps is None:
            raise ValueError(
                "write_metrics needs every_n_steps=... or when=... for the train metrics"
            )
        when = EveryNSteps(every_n_steps)
    hooks = WriterHooks(writer, when, call_on_end=call_on_end, learning_rate=learning_rate)
    if not is_writer_process():
        return hooks
    loop.shared_data.setdefault(WRITERS, []).append(hooks)  # e.g. for hooks.throughput
    name = name or type(writer).__name__
    loop.on_start(name, hooks.on_start, priority)
    if when.at_epoch_end:
        loop.on_epoch_end(name, hooks.log, priority, when=when, check_finite=False)
    else:
        loop.on_step(name, hooks.log, priority, when=when, check_finite=False)
    loop.on_evaluation(name, hooks.on_evaluation, priority)
    loop.on_restore(name, hooks.on_restore, priority)
    loop.on_flush(name, hooks.on_flush, priority)
    loop.on_end(name, hooks.on_end, priority, check_finite=False)
    atexit.register(writer.close)
    return hooks
