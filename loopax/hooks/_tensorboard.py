"""`tensorboard`: TensorBoard event files written with the `tensorboard` package alone.

TensorFlow is never imported: events are built from the protos in `tensorboard.compat.proto`
and written by `EventFileWriter`. A background thread reads the device values and writes, so
the loop only enqueues device arrays on the steps that log and never waits on disk.
"""

from __future__ import annotations

import atexit
import os
import queue
import shlex
import sys
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..trainer._hooks import Priority
from ._evaluate import EvalWatcher
from ._metric_info import is_writer_process
from ._schedules import EveryNSteps

TRAIN_PREFIX = "train"
LEARNING_RATE_TAG = "train/learning_rate"
RUN_SUMMARY_TAG = "run/summary"
_HISTOGRAM_BUCKETS = 30


def _learning_rate(trainer: Any) -> Any | None:
    try:
        from ..optimizers import get_learning_rate
    except ImportError:  # loopax.optimizers is optional for this hook
        return None
    state = trainer.state
    return None if state is None else get_learning_rate(state.opt_state)


def _format_bytes(count: int) -> str:
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _path_name(path: tuple) -> str:
    return "/".join(str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key))))
                    for key in path)


def run_summary(trainer: Any, argv: list[str] | None = None) -> str:
    """A Markdown summary of the run: command line, devices, parameter count, bytes and shapes.

    Reads only shapes and dtypes: no device value.
    """
    argv = sys.argv if argv is None else argv
    devices = trainer.devices
    kinds = sorted({device.device_kind for device in devices})
    lines = [
        f"**command line:** `{shlex.join(argv)}`",
        "",
        f"**devices:** {len(devices)} ({', '.join(kinds)}; {trainer.parallel}, "
        f"{jax.process_count()} process(es))",
    ]
    params = trainer.params
    if params is not None:
        leaves = jax.tree_util.tree_flatten_with_path(params)[0]
        count = sum(int(np.prod(leaf.shape)) for _, leaf in leaves)
        size = sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize for _, leaf in leaves)
        lines += [
            "",
            f"**parameters:** {count:,} ({_format_bytes(size)})",
            "",
            "| parameter | shape | dtype | count |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {_path_name(path)} | {tuple(leaf.shape)} | {np.dtype(leaf.dtype).name} | "
            f"{int(np.prod(leaf.shape)):,} |"
            for path, leaf in leaves
        ]
    return "\n".join(lines)


_BURST_SECONDS = 1.0  # writes reach the writer thread in batches, at most this often

def _scalar_summary(values: dict[str, Any]) -> Any:
    from tensorboard.compat.proto import summary_pb2

    summary = summary_pb2.Summary()
    for tag, value in values.items():
        summary.value.add(tag=tag, simple_value=float(np.asarray(value)))
    return summary


def _text_summary(tag: str, text: str) -> Any:
    from tensorboard.plugins.text import summary_v2

    return summary_v2.text_pb(tag, text)


def _histogram_summary(values: dict[str, Any]) -> Any:
    from tensorboard.compat.proto import summary_pb2
    from tensorboard.plugins.histogram import metadata
    from tensorboard.util import tensor_util

    summary = summary_pb2.Summary()
    for tag, value in values.items():
        data = np.asarray(value, np.float64).ravel()
        data = data[np.isfinite(data)]
        if data.size == 0:
            buckets = np.zeros((_HISTOGRAM_BUCKETS, 3))
        else:
            counts, edges = np.histogram(data, bins=_HISTOGRAM_BUCKETS)
            buckets = np.stack([edges[:-1], edges[1:], counts.astype(np.float64)], axis=1)
        summary.value.add(
            tag=tag,
            metadata=metadata.create_summary_metadata(display_name=None, description=None),
            tensor=tensor_util.make_tensor_proto(buckets, dtype=np.float64),
        )
    return summary


class TensorBoardWriter:
    """Writes TensorBoard events from a background thread; created by `tensorboard`.

    Attributes:
      logdir: the directory of the event files.
      schedule: the `EveryNSteps` schedule of the train scalars.
    """

    # Reads the device only on the steps it logs (and then in its own thread), so the loop
    # must not check the loss before it every step.
    checks_finite_lazily = True

    def __init__(
        self,
        logdir: str,
        every_n_steps: int,
        histograms_every_n_steps: int | None,
        learning_rate: bool,
        summary: bool,
        flush_seconds: float,
        max_pending: int,
    ):
        self.logdir = logdir
        self.schedule = EveryNSteps(every_n_steps)
        self.histogram_schedule = (
            None if histograms_every_n_steps is None else EveryNSteps(histograms_every_n_steps)
        )
        self.write_learning_rate = learning_rate
        self.write_summary = summary
        self._flush_seconds = flush_seconds
        self._max_pending = max_pending
        # Writes wait here, on the loop's side, and go to the writer thread as one batch
        # at most once a second (or every `max_pending` writes).
        self._outbox: list[tuple[str, int, Any]] = []
        self._handoff_due = 0.0
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._watcher = EvalWatcher()
        self._summary_written = False
        self._last_scalar_step = -1
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._writer: Any = None
        self._closed = False

    # -- main thread ----------------------------------------------------------------------

    def _start(self) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._writer = EventFileWriter(self.logdir, flush_secs=self._flush_seconds)
        self._thread = threading.Thread(target=self._work, name="loopax-tensorboard", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def _put(self, item: tuple) -> None:
        self._raise_worker_error()
        if self._closed:
            raise RuntimeError(f"the TensorBoard writer for {self.logdir!r} is closed")
        self._outbox.append(item)
        if len(self._outbox) >= self._max_pending or time.monotonic() >= self._handoff_due:
            self._hand_off()

    def _hand_off(self) -> None:
        """Gives the writes waiting in the outbox to the writer thread, as one batch.

        Building events is pure Python (TensorBoard's CRC32C included) and holds the GIL,
        and every wake-up of the writer thread can stall the training thread: one batch a
        second instead of one wake-up per write took a small model's cost from ~20 µs to
        a few µs per step. Blocks while the writer is still busy with the previous batch.
        """
        self._handoff_due = time.monotonic() + _BURST_SECONDS
        if self._outbox:
            items, self._outbox = self._outbox, []
            self._queue.put(("batch", -1, items))

    def _raise_worker_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(
                f"writing TensorBoard events to {self.logdir!r} failed: "
                f"{type(error).__name__}: {error}"
            ) from error

    def add_scalars(self, step: int, values: dict[str, Any]) -> None:
        """Queues scalars (host numbers or device arrays, read in the writer thread)."""
        self._put(("scalars", step, values))

    def add_text(self, step: int, tag: str, text: str) -> None:
        """Queues a Markdown text summary."""
        self._put(("text", step, (tag, text)))

    def add_histograms(self, step: int, values: dict[str, Any]) -> None:
        """Queues histograms of arrays (host or device, read in the writer thread)."""
        self._put(("histograms", step, values))

    def flush(self) -> None:
        """Waits until everything queued is written and flushed to disk."""
        if self._thread is None or self._closed:
            self._raise_worker_error()
            return
        self._raise_worker_error()
        self._hand_off()
        done = threading.Event()
        self._queue.put(("flush", -1, done))
        while not done.wait(0.1):
            if not self._thread.is_alive():
                break
        self._raise_worker_error()

    def close(self) -> None:
        """Flushes and closes the event file; further writes raise."""
        if self._thread is None or self._closed:
            return
        self.flush()
        self._closed = True
        self._queue.put(("close", -1, None))
        self._thread.join()
        self._raise_worker_error()

    def _write_train(self, loop: Any, metrics: Any) -> None:
        step = loop.trainer.global_step
        if not metrics or step == self._last_scalar_step:
            return
        self._last_scalar_step = step
        values = {f"{TRAIN_PREFIX}/{key}": value for key, value in metrics.items()}
        if self.write_learning_rate:
            learning_rate = _learning_rate(loop.trainer)
            if learning_rate is not None:
                # A copy: the state's buffers are donated to the next step before the writer
                # thread reads them.
                values[LEARNING_RATE_TAG] = jnp.copy(learning_rate)
        self.add_scalars(step, values)

    def _write_new_evals(self, loop: Any) -> None:
        step, new = self._watcher.new_results(loop)
        if new:
            self.add_scalars(step, {
                f"{name}/{key}": value for name, results in new.items() for key, value in results.items()
            })

    def __call__(self, loop: Any, metrics: Any) -> None:
        # Runs every step: the common case (nothing to write) is a few attribute reads.
        if self._error is not None:
            self._raise_worker_error()
        step = loop.loop_step
        if not self._summary_written and self.write_summary:
            # At the first step, not at OnStart: the variables exist only after the first batch.
            self._summary_written = True
            self.add_text(loop.trainer.global_step, RUN_SUMMARY_TAG, run_summary(loop.trainer))
        if self.schedule.should_fire(step):
            self._write_train(loop, metrics)
        if self.histogram_schedule is not None and self.histogram_schedule.should_fire(step):
            params = loop.trainer.params
            leaves = jax.tree_util.tree_flatten_with_path(params)[0]
            self.add_histograms(loop.trainer.global_step, {
                f"params/{_path_name(path)}": jnp.copy(leaf) for path, leaf in leaves
            })
        self._write_new_evals(loop)

    def on_end(self, loop: Any, metrics: Any) -> None:
        """Writes the last step's train scalars and new evaluations, then flushes."""
        self._write_train(loop, metrics)
        self._write_new_evals(loop)
        self.flush()

    # -- writer thread --------------------------------------------------------------------

    def _work(self) -> None:
        from tensorboard.compat.proto import event_pb2

        builders: dict[str, Callable[[Any], Any]] = {  # payloads arrive as host values
            "scalars": _scalar_summary,
            "text": lambda tag_text: _text_summary(*tag_text),
            "histograms": _histogram_summary,
        }
        while True:
            kind, _, payload = self._queue.get()
            try:
                if kind == "batch":
                    self._write(builders, event_pb2, payload)
                elif kind == "close":
                    self._writer.close()
                    return
                elif kind == "flush":
                    try:
                        self._writer.flush()
                    except BaseException as err:
                        self._error = err
                    payload.set()
            finally:
                self._queue.task_done()

    def _write(self, builders: dict, event_pb2: Any, items: list[tuple[str, int, Any]]) -> None:
        """Writer thread: reads a batch's device values at once, then writes its events."""
        if self._error is not None:
            return
        try:
            payloads = jax.device_get([payload for _, _, payload in items])
            for (kind, step, _), payload in zip(items, payloads):
                summary = builders[kind](payload)
                self._writer.add_event(
                    event_pb2.Event(wall_time=time.time(), step=step, summary=summary)
                )
        except BaseException as err:  # reported to the loop at its next hook call
            self._error = err


def tensorboard(
    loop: Any,
    logdir: str | os.PathLike,
    *,
    every_n_steps: int = 100,
    histograms_every_n_steps: int | None = None,
    learning_rate: bool = True,
    summary: bool = True,
    flush_seconds: float = 10.0,
    max_pending: int = 64,
    priority: int = Priority.LOG,
) -> TensorBoardWriter:
    """Writes TensorBoard event files (no TensorFlow needed) for `tensorboard --logdir`.

    Scalars (the step is the trainer's global step):
    - `train/<metric>` for every train metric (`train/loss`, `train/moving_average_loss`, ...)
      every `every_n_steps` and at the end of each run, plus `train/learning_rate` when the
      optimizer exposes it (`loopax.optimizers`);
    - `<dataset>/<metric>` (e.g. `test/mean_loss`) for every evaluation stored in
      `loop.shared_data` by `evaluate` or `plot`, when it appears.
    At the first step, a text summary `run/summary`: command line, devices, parameter count,
    bytes and shapes. With `histograms_every_n_steps`, histograms `params/<path>` of the
    parameters. A background thread reads the device values and writes, so the loop only
    enqueues on the steps it logs; the end of each run waits until everything is on disk. Only
    process 0 writes.

    Args:
      loop: the `loopax.Loop`.
      logdir: the directory for the event files (created).
      every_n_steps: write the train scalars after step k iff `(k + 1) % every_n_steps == 0`.
      histograms_every_n_steps: write parameter histograms on that schedule; None for none.
      learning_rate: write `train/learning_rate` with the train scalars.
      summary: write the `run/summary` text at the first step.
      flush_seconds: how often the event file is flushed while running.
      max_pending: writes collect on the loop's side and go to the writer thread in one
        batch a second, or sooner once `max_pending` have collected; the loop waits only
        when the writer thread falls two batches behind.
      priority: the hooks' priority (default `Priority.LOG`: after evaluations).

    Returns:
      The `TensorBoardWriter` (`flush()`, `close()`).

    Raises:
      ValueError: `every_n_steps` or `histograms_every_n_steps` is not a positive int, or
        `max_pending` < 1.
    """
    if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
        raise ValueError(f"max_pending must be an int >= 1, got {max_pending!r}")
    logdir = os.fspath(logdir)
    writer = TensorBoardWriter(
        logdir, every_n_steps, histograms_every_n_steps, learning_rate, summary, flush_seconds,
        max_pending,
    )
    if is_writer_process():
        writer._start()
        loop.on_step(f"tensorboard({logdir})", writer, priority=priority)
        loop.on_end(f"tensorboard({logdir})", writer.on_end, priority=priority)
    return writer
