"""`tensorboard`: TensorBoard event files written with the `tensorboard` package alone.

TensorFlow is never imported: events are built from the protos in `tensorboard.compat.proto`
and written to an event file (`_event_file.EventFile`) in a background thread, so the loop
never waits on disk.
`TensorBoardWriter` is a `MetricWriter`: `write_metrics` feeds it, with the keys every
writer uses (`train/loss`, `eval/test/Accuracy`, ...).
"""

from __future__ import annotations

import atexit
import os
import queue
import shlex
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _validate
from .._validate import positive_int
from ..loop import Loop, Priority
from ..trainer import Trainer
from ._event_file import EventFile
from ._metric_info import is_writer_process
from ._schedules import EveryNSteps, FirstNSteps
from ._writers import MetricWriter, Waiter, write_metrics

RUN_SUMMARY_TAG = "run/summary"
_HISTOGRAM_BUCKETS = 30


def _format_bytes(count: int) -> str:
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _path_name(path: tuple) -> str:
    return "/".join(
        str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key)))) for key in path
    )


def run_summary(trainer: Trainer, argv: list[str] | None = None) -> str:
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
_EVENT_QUEUE_SIZE = 1024  # serialized events waiting for the event file (~100 bytes each)


def _scalar_summary(values: dict[str, Any]) -> Any:
    from tensorboard.compat.proto import summary_pb2

    # A protobuf-generated module without type stubs: pyright cannot see its classes.
    summary = summary_pb2.Summary()  # pyright: ignore[reportAttributeAccessIssue]
    for tag, value in values.items():
        summary.value.add(tag=tag, simple_value=float(value))
    return summary


def _text_summary(tag: str, text: str) -> Any:
    from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
    from tensorboard.plugins.text import metadata

    # As the text plugin's `text_pb` builds it, without its `tensor_util` (whose import
    # loads TensorBoard's TensorFlow stub): a scalar string tensor.
    tensor = tensor_pb2.TensorProto(  # pyright: ignore[reportAttributeAccessIssue]
        dtype=types_pb2.DT_STRING,  # pyright: ignore[reportAttributeAccessIssue]
        tensor_shape=tensor_shape_pb2.TensorShapeProto(),  # pyright: ignore[reportAttributeAccessIssue]
        string_val=[text.encode("utf-8")],
    )
    summary = summary_pb2.Summary()  # pyright: ignore[reportAttributeAccessIssue]
    summary.value.add(
        tag=tag,
        metadata=metadata.create_summary_metadata(display_name=None, description=None),
        tensor=tensor,
    )
    return summary


def _histogram_summary(values: dict[str, Any]) -> Any:
    from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
    from tensorboard.plugins.histogram import metadata

    # A protobuf-generated module without type stubs: pyright cannot see its classes.
    summary = summary_pb2.Summary()  # pyright: ignore[reportAttributeAccessIssue]
    for tag, value in values.items():
        data = np.asarray(value, np.float64).ravel()
        data = data[np.isfinite(data)]
        if data.size == 0:
            buckets = np.zeros((_HISTOGRAM_BUCKETS, 3))
        else:
            counts, edges = np.histogram(data, bins=_HISTOGRAM_BUCKETS)
            buckets = np.stack([edges[:-1], edges[1:], counts.astype(np.float64)], axis=1)
        dims = [tensor_shape_pb2.TensorShapeProto.Dim(size=n) for n in buckets.shape]  # pyright: ignore[reportAttributeAccessIssue]
        tensor = tensor_pb2.TensorProto(  # pyright: ignore[reportAttributeAccessIssue]
            dtype=types_pb2.DT_DOUBLE,  # pyright: ignore[reportAttributeAccessIssue]
            tensor_shape=tensor_shape_pb2.TensorShapeProto(dim=dims),  # pyright: ignore[reportAttributeAccessIssue]
            tensor_content=np.ascontiguousarray(buckets, "<f8").tobytes(),
        )
        summary.value.add(
            tag=tag,
            metadata=metadata.create_summary_metadata(display_name=None, description=None),
            tensor=tensor,
        )
    return summary


class TensorBoardWriter(MetricWriter):
    """Writes TensorBoard events from a background thread; created by `tensorboard`.

    Writes collect on the caller's side and go to the writer thread in one batch a second
    (or every `max_pending` writes): building events is pure Python and holds the GIL, and
    one wake-up a second instead of one per write keeps a small model's loop fast.

    Args:
      logdir: the directory of the event files (created).
      flush_seconds: how often the event file is flushed while running.
      max_pending: hand the collected writes over once this many are waiting.
    """

    logdir: str

    def __init__(
        self, logdir: str | os.PathLike[str], *, flush_seconds: float = 10.0, max_pending: int = 64
    ):
        self.logdir = _validate.path("logdir", logdir)
        self._flush_seconds = flush_seconds
        self._max_pending = positive_int("max_pending", max_pending)
        self._outbox: list[tuple[str, int, Any]] = []
        self._handoff_due = 0.0
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self._open_error: BaseException | None = None
        self._open_error_reported = False
        self._thread: threading.Thread | None = None
        self._writer: EventFile | None = None
        self._closed = False

    # -- caller's side --------------------------------------------------------------------

    def _start(self) -> None:
        # The writer thread imports TensorBoard's writer and opens the event file: ~0.1 s
        # that the first step of a run (a resumed one's first write is at its start) need
        # not wait for. A failure there is raised at the next write or flush.
        self._thread = threading.Thread(target=self._work, name="loopax-tensorboard", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def _put(self, item: tuple) -> None:
        self._raise_worker_error()
        if self._closed:
            raise RuntimeError(f"the TensorBoard writer for {self.logdir!r} is closed")
        if self._thread is None:
            self._start()
        self._outbox.append(item)
        if len(self._outbox) >= self._max_pending or time.monotonic() >= self._handoff_due:
            self._hand_off()

    def _hand_off(self) -> None:
        """Gives the collected writes to the writer thread, as one batch.

        Blocks while the writer is still busy with the previous batch.
        """
        self._handoff_due = time.monotonic() + _BURST_SECONDS
        if self._outbox:
            items, self._outbox = self._outbox, []
            self._queue.put(("batch", items))

    def _raise_worker_error(self) -> None:
        # An event file that could not be opened fails every later write too.
        error = self._error or self._open_error
        if error is not None:
            self._error = None
            self._open_error_reported = error is self._open_error
            raise RuntimeError(
                f"writing TensorBoard events to {self.logdir!r} failed: "
                f"{type(error).__name__}: {error}"
            ) from error

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        """Queues scalars (host numbers)."""
        self._put(("scalars", step, dict(scalars)))

    def write_text(self, step: int, tag: str, text: str) -> None:
        """Queues a Markdown text summary."""
        self._put(("text", step, (tag, text)))

    def write_histograms(self, step: int, values: Mapping[str, Any]) -> None:
        """Queues histograms of arrays (host or device copies, read in the writer thread)."""
        self._put(("histograms", step, dict(values)))

    def truncate_after(self, step: int) -> None:
        """Writes a `SessionLog.START` at `step + 1`.

        TensorBoard then drops every event of a later step written before it (a resumed or
        rolled-back run writes them again).
        """
        self._put(("restart", step + 1, None))

    def flush_async(self) -> Waiter:
        """Hands everything queued to the writer thread and asks it to flush.

        The returned function waits until the events are on disk.
        """
        self._raise_worker_error()
        if self._thread is None or self._closed:
            return lambda: None
        self._hand_off()
        done = threading.Event()
        self._queue.put(("flush", done))
        thread = self._thread

        def wait() -> None:
            while not done.wait(0.1):
                if not thread.is_alive():
                    break
            self._raise_worker_error()

        return wait

    def flush(self) -> None:
        """Waits until everything queued is written and flushed to disk."""
        self.flush_async()()

    def close(self) -> None:
        """Flushes and closes the event file; further writes raise."""
        if self._thread is None or self._closed or self._open_error_reported:
            self._closed = True  # (a file never opened, and said so: nothing to close)
            return
        self.flush()
        self._closed = True
        self._queue.put(("close", None))
        self._thread.join()
        self._raise_worker_error()

    # -- writer thread --------------------------------------------------------------------

    def _open(self) -> tuple[Any, EventFile | None]:
        """Writer thread: TensorBoard's event protos and the event file.

        `(None, None)` when they could not be had (the error is kept for the loop).
        """
        try:
            from tensorboard.compat.proto import event_pb2

            return event_pb2, EventFile(self.logdir, event_pb2)
        except BaseException as err:  # reported to the loop at its next write, and after
            self._open_error = err
            return None, None

    def _work(self) -> None:
        event_pb2, self._writer = self._open()
        flush_due = None  # when written events are next flushed, while some are not
        while True:
            timeout = None if flush_due is None else max(0.0, flush_due - time.monotonic())
            kind: str
            payload: Any
            try:
                kind, payload = self._queue.get(timeout=timeout)
            except queue.Empty:  # the periodic flush
                kind, payload = "flush", None
            if kind == "batch":
                self._write(event_pb2, payload)
                if flush_due is None:
                    flush_due = time.monotonic() + self._flush_seconds
            elif kind == "close":
                if self._writer is not None:
                    self._writer.close()
                return
            elif kind == "flush":
                flush_due = None
                try:
                    if self._writer is not None:
                        self._writer.flush()
                except BaseException as err:
                    self._error = err
                if payload is not None:
                    payload.set()

    def _write(self, event_pb2: Any, items: list[tuple[str, int, Any]]) -> None:
        """Writer thread: reads a batch's device values at once, then writes its events."""
        if self._error is not None or self._writer is None:
            return
        builders: dict[str, Callable[[Any], Any]] = {
            "scalars": _scalar_summary,
            "text": lambda tag_text: _text_summary(*tag_text),
            "histograms": _histogram_summary,
        }
        try:
            payloads = jax.device_get([payload for _, _, payload in items])
            for (kind, step, _), payload in zip(items, payloads, strict=True):
                if kind == "restart":
                    event = event_pb2.Event(
                        wall_time=time.time(),
                        step=step,
                        session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START),
                    )
                else:
                    event = event_pb2.Event(
                        wall_time=time.time(), step=step, summary=builders[kind](payload)
                    )
                self._writer.add(event)
        except BaseException as err:  # reported to the loop at its next write
            self._error = err


def tensorboard(
    loop: Loop,
    logdir: str | os.PathLike[str],
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

    Scalars (the step is the trainer's global step), with the keys every loopax writer,
    monitor and `loop.history` use:
    - `train/<metric>` for every train metric (`train/loss`, `train/moving_average_loss`, ...)
      every `every_n_steps` and at the end of each run, plus `train/learning_rate` when the
      optimizer exposes it (`loopax.optimizers`, `optax.inject_hyperparams`);
    - `eval/<dataset>/<metric>` (e.g. `eval/test/mean_loss`) for every evaluation.
    At the first step of the process, a text summary `run/summary`: command line, devices,
    parameter count, bytes and shapes. With `histograms_every_n_steps`, histograms
    `params/<path>` of the parameters. On a resume or rollback a `SessionLog.START` makes
    TensorBoard drop the points after the restored step; before each checkpoint commits,
    the events are on disk. Only process 0 writes.

    Args:
      loop: the `loopax.Loop`.
      logdir: the directory for the event files (created).
      every_n_steps: write the train scalars after step k iff `(k + 1) % every_n_steps == 0`.
      histograms_every_n_steps: write parameter histograms on that schedule; None for none.
      learning_rate: write `train/learning_rate` with the train scalars.
      summary: write the `run/summary` text at the first step.
      flush_seconds: how often the event file is flushed while running.
      max_pending: writes collect on the loop's side and go to the writer thread in one
        batch a second, or sooner once `max_pending` have collected.
      priority: the hooks' priority (default `Priority.LOG`: after evaluations).

    Returns:
      The `TensorBoardWriter` (`flush()`, `close()`).

    Raises:
      ValueError: `every_n_steps` or `histograms_every_n_steps` is not a positive int, or
        `max_pending` < 1.
    """
    logdir = _validate.path("logdir", logdir, "tensorboard: ")
    writer = TensorBoardWriter(logdir, flush_seconds=flush_seconds, max_pending=max_pending)
    histograms = None if histograms_every_n_steps is None else EveryNSteps(histograms_every_n_steps)
    name = f"tensorboard({logdir})"
    write_metrics(
        loop,
        writer,
        every_n_steps=every_n_steps,
        learning_rate=learning_rate,
        name=name,
        priority=priority,
    )
    if not is_writer_process():
        return writer
    if summary:
        # At the first step, not at OnStart: the variables exist only after the first batch.
        loop.on_step(
            f"{name}: summary",
            lambda loop, metrics: writer.write_text(
                loop.trainer.global_step, RUN_SUMMARY_TAG, run_summary(loop.trainer)
            ),
            priority,
            when=FirstNSteps(1, of_process=True),
            check_finite=False,
        )
    if histograms is not None:

        def write_histograms(loop: Loop, metrics: Any) -> None:
            # Copies: the state's buffers are donated to the next step before the writer
            # thread reads them.
            leaves = jax.tree_util.tree_flatten_with_path(loop.trainer.params)[0]
            writer.write_histograms(
                loop.trainer.global_step,
                {f"params/{_path_name(path)}": jnp.copy(leaf) for path, leaf in leaves},
            )

        loop.on_step(
            f"{name}: histograms", write_histograms, priority, when=histograms, check_finite=False
        )
    return writer
