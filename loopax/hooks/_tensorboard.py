"""`tensorboard`: TensorBoard event files written with the `tensorboard` package alone.

TensorFlow is never imported: events are built from the protos in `tensorboard.compat.proto`
and written to an event file (`_event_file.EventFile`) in a background thread, so the loop
never waits on disk.
`TensorBoardWriter` is a `MetricWriter`: `write_metrics` feeds it, with the keys every
writer uses (`train/loss`, `eval/test/Accuracy`, ...). Its layout puts each key in a run
directory: by default one per dataset (`train`, `eval/<dataset>`, the key's metric name as
the tag, so TensorBoard draws training and evaluation on one chart), or all in `logdir`.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _validate, metrics
from .._validate import positive_int
from ..loop import Evaluation, Loop, Priority
from ._event_file import EventFile
from ._metric_info import is_writer_process
from ._run_summary import RUN_SUMMARY_TAG, path_name, run_summary
from ._schedules import EveryNSteps, FirstNSteps
from ._tensorboard_layout import (
    PER_DATASET,
    RUN_TAGS,
    SINGLE,
    TRAIN_RUN,
    check_layout,
    existing_runs,
    run_and_tag,
)
from ._writers import MetricWriter, Waiter, write_metrics

_HISTOGRAM_BUCKETS = 30

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

    With the `"per_dataset"` layout each run directory (`train`, `eval/<dataset>`) has its
    own event file, opened at its first event; a truncation (`truncate_after`) goes to every
    run directory there is, so each drops the same points.

    Args:
      logdir: the directory of the event files (created).
      flush_seconds: how often the event files are flushed while running.
      max_pending: hand the collected writes over once this many are waiting.
      layout: `"per_dataset"` (a run directory per dataset, tags without the
        `train/` / `eval/<dataset>/` prefix; see `run_and_tag`) or `"single"` (every tag,
        prefix included, in `logdir` itself).

    Raises:
      ValueError: `layout` is not one of those, or `max_pending` < 1.
    """

    logdir: str
    layout: str

    def __init__(
        self,
        logdir: str | os.PathLike[str],
        *,
        flush_seconds: float = 10.0,
        max_pending: int = 64,
        layout: str = PER_DATASET,
    ):
        self.logdir = _validate.path("logdir", logdir)
        self.layout = check_layout(layout)
        self._flush_seconds = flush_seconds
        self._max_pending = positive_int("max_pending", max_pending)
        self._outbox: list[tuple[str, int, Any]] = []
        self._handoff_due = 0.0
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self._open_error: BaseException | None = None
        self._open_error_reported = False
        self._thread: threading.Thread | None = None
        self._event_pb2: Any = None
        self._files: dict[str, EventFile] = {}  # by run ("" for the logdir itself)
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
        """Writes a `SessionLog.START` at `step + 1`, into every run directory.

        TensorBoard then drops every event of a later step written before it in that run (a
        resumed or rolled-back run writes them again). With the `"per_dataset"` layout it
        goes to every run this writer opened and every one on disk (`train`, `eval/...`),
        so a resumed process truncates the evaluations of the run it resumes too.
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
        """Flushes and closes the event files; further writes raise."""
        if self._thread is None or self._closed or self._open_error_reported:
            self._closed = True  # (a file never opened, and said so: nothing to close)
            return
        self.flush()
        self._closed = True
        self._queue.put(("close", None))
        self._thread.join()
        self._raise_worker_error()

    # -- writer thread --------------------------------------------------------------------

    def _main_run(self) -> str:
        return TRAIN_RUN if self.layout == PER_DATASET else ""

    def _open(self) -> None:
        """Writer thread: TensorBoard's event protos and the main run's event file.

        Leaves no files when they could not be had (the error is kept for the loop).
        """
        try:
            from tensorboard.compat.proto import event_pb2

            self._event_pb2 = event_pb2
            self._file(self._main_run())
        except BaseException as err:  # reported to the loop at its next write, and after
            self._open_error = err
            self._files = {}

    def _file(self, run: str) -> EventFile:
        """Writer thread: the event file of `run`, opened at its first event."""
        file = self._files.get(run)
        if file is None:
            file = EventFile(os.path.join(self.logdir, run), self._event_pb2)
            self._files[run] = file
        return file

    def _runs_to_truncate(self) -> list[str]:
        if self.layout == SINGLE:
            return [""]
        runs = {self._main_run(), *self._files, *existing_runs(self.logdir)}
        return sorted(runs)

    def _work(self) -> None:
        self._open()
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
                self._write(payload)
                if flush_due is None:
                    flush_due = time.monotonic() + self._flush_seconds
            elif kind == "close":
                for file in self._files.values():
                    file.close()
                return
            elif kind == "flush":
                flush_due = None
                try:
                    for file in self._files.values():
                        file.flush()
                except BaseException as err:
                    self._error = err
                if payload is not None:
                    payload.set()

    def _by_run(self, values: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """`{key: value}` as `{run: {tag: value}}`.

        A tag two keys map to in one run (an eval metric named `loss` beside `mean_loss`)
        keeps its key's own metric name instead.
        """
        placed = [(key, *run_and_tag(self.layout, key)) for key in values]
        own = {(run, tag) for key, run, tag in placed if key == tag or key.endswith(f"/{tag}")}
        runs: dict[str, dict[str, Any]] = {}
        for key, run, tag in placed:
            name = key.rpartition("/")[2]
            if tag == RUN_TAGS.get(name) and key != tag and (run, tag) in own:
                tag = name
            runs.setdefault(run, {})[tag] = values[key]
        return runs

    def _write(self, items: list[tuple[str, int, Any]]) -> None:
        """Writer thread: reads a batch's device values at once, then writes its events."""
        if self._error is not None or not self._files:
            return
        event_pb2 = self._event_pb2
        try:
            payloads = jax.device_get([payload for _, _, payload in items])
            for (kind, step, _), payload in zip(items, payloads, strict=True):
                now = time.time()
                if kind == "restart":
                    for run in self._runs_to_truncate():
                        self._file(run).add(
                            event_pb2.Event(
                                wall_time=now,
                                step=step,
                                session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START),
                            )
                        )
                    continue
                if kind == "text":
                    tag, text = payload
                    run, tag = run_and_tag(self.layout, tag)
                    summaries = {run: _text_summary(tag, text)}
                else:
                    build = _scalar_summary if kind == "scalars" else _histogram_summary
                    summaries = {
                        run: build(values) for run, values in self._by_run(payload).items()
                    }
                for run, summary in summaries.items():
                    self._file(run).add(event_pb2.Event(wall_time=now, step=step, summary=summary))
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
    layout: str = PER_DATASET,
    flush_seconds: float = 10.0,
    max_pending: int = 64,
    priority: int = Priority.LOG,
) -> TensorBoardWriter:
    """Writes TensorBoard event files (no TensorFlow needed) for `tensorboard --logdir`.

    One run directory per dataset, as Keras writes `train/` and `validation/` (bobbin's
    `MultiDirectorySummaryWriter`), so TensorBoard draws training and evaluation curves of
    a metric on one chart (the step is the trainer's global step):
    - `<logdir>/train`: every train metric under its own name (`loss`,
      `moving_average_loss`, ...) every `every_n_steps` and at the end of each run, plus
      `learning_rate` when the optimizer exposes it (`loopax.optimizers`,
      `optax.inject_hyperparams`), and the points other hooks add (`hooks.throughput`);
    - `<logdir>/eval/<dataset>`: every evaluation's metrics under their own names, its
      `mean_loss` as `loss` (beside the train loss), e.g. `eval/test` `accuracy`.
    The loopax key of a point (`train/loss`, `eval/test/mean_loss`: those of every other
    writer and `loop.history`) is its run directory and tag; `layout="single"` writes the
    keys themselves as tags, all in `logdir` (the layout of earlier loopax releases).
    At the first step of the process, a text summary `run/summary` in the `train` run:
    command line, devices, parameter and other variable (BatchNorm statistics, ...) counts,
    bytes and shapes. With `histograms_every_n_steps`, histograms `params/<path>` of the
    parameters, in the `train` run. After each evaluation, the sample of every
    `metrics.SampledSet` eval metric as a Markdown table (tag: its name, in the dataset's
    run). On a resume or rollback a `SessionLog.START` in every
    run directory makes TensorBoard drop the points after the restored step; before each
    checkpoint commits, the events are on disk. Only process 0 writes.

    Args:
      loop: the `loopax.Loop`.
      logdir: the directory for the event files (created).
      every_n_steps: write the train scalars after step k iff `(k + 1) % every_n_steps == 0`.
      histograms_every_n_steps: write parameter histograms on that schedule; None for none.
      learning_rate: write `train/learning_rate` with the train scalars.
      summary: write the `run/summary` text at the first step.
      layout: `"per_dataset"` (the default: a run directory per dataset, as above) or
        `"single"` (every tag, with its `train/` or `eval/<dataset>/` prefix, in `logdir`).
      flush_seconds: how often the event files are flushed while running.
      max_pending: writes collect on the loop's side and go to the writer thread in one
        batch a second, or sooner once `max_pending` have collected.
      priority: the hooks' priority (default `Priority.LOG`: after evaluations).

    Returns:
      The `TensorBoardWriter` (`flush()`, `close()`).

    Raises:
      ValueError: `every_n_steps` or `histograms_every_n_steps` is not a positive int,
        `max_pending` < 1, or `layout` is not one of those.

    Example:
      >>> import os, tempfile, numpy as np, optax, flax.linen as nn, jax
      >>> import loopax
      >>> from loopax import hooks, losses
      >>> trainer = loopax.Trainer(lambda ctx, spec, x: nn.Dense(1)(x[0]),
      ...                          losses.mean_squared_error, optax.sgd(0.1),
      ...                          devices=jax.devices()[:1])
      >>> data = loopax.ArrayDataset(np.ones((8, 2), np.float32), np.ones((8, 1), np.float32),
      ...                            batch_size=4, loop_forever=True)
      >>> loop = loopax.Loop(trainer)
      >>> _ = hooks.evaluate(loop, loopax.ArrayDataset(np.ones((4, 2), np.float32),
      ...     np.ones((4, 1), np.float32), batch_size=4, name="val"), every_n_steps=2)
      >>> logdir = tempfile.mkdtemp()
      >>> writer = hooks.tensorboard(loop, logdir, every_n_steps=2)
      >>> _ = loop.run_steps(data, 2)
      >>> sorted(os.listdir(logdir)), os.listdir(os.path.join(logdir, "eval"))
      (['eval', 'train'], ['val'])
    """
    logdir = _validate.path("logdir", logdir, "tensorboard: ")
    writer = TensorBoardWriter(
        logdir, flush_seconds=flush_seconds, max_pending=max_pending, layout=layout
    )
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
    sampled = [m for m in loop.trainer.eval_metrics if isinstance(m, metrics.SampledSet)]
    if sampled:

        def write_samples(loop: Loop, evaluation: Evaluation) -> None:
            # Published right after its evaluation: each metric's latest sample is this one's.
            for metric in sampled:
                if metric.latest is not None:
                    key = f"eval/{evaluation.dataset}/{metric.name}"
                    writer.write_text(evaluation.step, key, metric.latest.table())

        loop.on_evaluation(f"{name}: samples", write_samples, priority)
    if histograms is not None:

        def write_histograms(loop: Loop, metrics: Any) -> None:
            # Copies: the state's buffers are donated to the next step before the writer
            # thread reads them.
            leaves = jax.tree_util.tree_flatten_with_path(loop.trainer.params)[0]
            writer.write_histograms(
                loop.trainer.global_step,
                {f"params/{path_name(path)}": jnp.copy(leaf) for path, leaf in leaves},
            )

        loop.on_step(
            f"{name}: histograms", write_histograms, priority, when=histograms, check_finite=False
        )
    return writer
