"""`profile`: a `jax.profiler` trace of exactly the steps asked for, where TensorBoard finds it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax

from .. import _validate
from ..loop import Loop, Priority
from ._schedules import AtSteps


class Profiler:
    """The profiling hooks; created by `profile`.

    Attributes:
      logdir: the TensorBoard log directory; traces go to `<logdir>/plugins/profile/<run>/`.
      start, stop: the window: the steps that bring the global step to start..stop.
      traced: `(first, last)` global steps of each finished trace, in order.
      tracing: whether a trace is being recorded now.
    """

    def __init__(self, logdir: Path, start: int, stop: int):
        self.logdir = logdir
        self.start = start
        self.stop = stop
        self.traced: list[tuple[int, int]] = []
        self.tracing = False
        self._first: int | None = None

    def _begin(self, global_step: int) -> None:
        if self.tracing or self.traced or not self.start - 1 <= global_step < self.stop:
            return  # one window: a run that goes over it again is not traced twice
        jax.profiler.start_trace(os.fspath(self.logdir))
        self.tracing = True
        self._first = global_step + 1

    def _end(self, loop: Loop, metrics: Any) -> None:
        if not self.tracing:
            return
        # The steps ran asynchronously: wait for them, so their device work is in the trace.
        jax.block_until_ready(metrics)
        jax.profiler.stop_trace()
        self.tracing = False
        self.traced.append((self._first or 0, loop.trainer.global_step))

    def on_start(self, loop: Loop, dataset: Any) -> None:
        del dataset
        self._begin(loop.trainer.global_step)

    def before_window(self, loop: Loop, metrics: Any) -> None:
        jax.block_until_ready(metrics)  # step start - 1 is done: none of it in the trace
        self._begin(loop.trainer.global_step)

    def on_end(self, loop: Loop, metrics: Any) -> None:
        self._end(loop, metrics)  # a run that ended inside the window closes its trace

    def on_error(self, loop: Loop, error: BaseException) -> None:
        del error
        if self.tracing:
            jax.profiler.stop_trace()  # never leave the profiler running
            self.tracing = False

    def __repr__(self) -> str:
        return (
            f"Profiler(logdir={str(self.logdir)!r}, steps=({self.start}, {self.stop}), "
            f"traced={self.traced})"
        )


def profile(
    loop: Loop, logdir: str | os.PathLike[str], steps: tuple[int, int] = (10, 20)
) -> Profiler:
    """Records a `jax.profiler` trace of the train steps `steps=(start, stop)`.

    The trace covers exactly the steps that bring the global step to `start`, `start + 1`,
    ..., `stop` (Keras's `profile_batch=(start, stop)`): it starts after step `start - 1`'s
    hooks and stops after step `stop`'s, once those steps finished on the device. With fused
    execution (`steps_per_execution`) the groups are split at both ends, so the window is
    exact. The trace is written where TensorBoard's profile plugin finds it,
    `<logdir>/plugins/profile/<run>/` (pass the `hooks.tensorboard` logdir to see it beside
    the scalars); view it with `pip install tensorboard-plugin-profile` and
    `tensorboard --logdir <logdir>` (Profile tab), or open its `.trace.json.gz` in Perfetto.
    A run that ends inside the window ends the trace there; a window is traced once. Every
    process traces its own devices.

    Args:
      loop: the `loopax.Loop`.
      logdir: the directory (created).
      steps: `(start, stop)` global steps, `1 <= start <= stop`.

    Returns:
      The `Profiler` (`traced`: the steps of each trace written).

    Raises:
      ValueError: `steps` is not two ints with `1 <= start <= stop`, or `logdir` is empty.
    """
    logdir = Path(_validate.path("logdir", logdir, "profile: "))
    if (
        not isinstance(steps, (tuple, list))
        or len(steps) != 2
        or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps)
        or not 1 <= steps[0] <= steps[1]
    ):
        raise ValueError(
            f"profile: steps must be (start, stop) global steps with 1 <= start <= stop, e.g. "
            f"(10, 20); got {steps!r}"
        )
    start, stop = steps
    logdir.mkdir(parents=True, exist_ok=True)
    profiler = Profiler(logdir, start, stop)
    name = f"profile({start}, {stop})"
    loop.on_start(name, profiler.on_start, priority=Priority.UI)
    if start > 1:
        loop.on_step(
            name,
            profiler.before_window,
            priority=Priority.UI,
            check_finite=False,
            when=AtSteps([start - 1]),
        )
    loop.on_step(
        name, profiler.on_end, priority=Priority.UI, check_finite=False, when=AtSteps([stop])
    )
    loop.on_end(name, profiler.on_end, priority=Priority.UI, check_finite=False)
    loop.on_error(name, profiler.on_error)
    return profiler
