"""`throughput`: steps/s, examples/s, FLOPs per step and MFU, logged through every writer."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..loop import Loop, Priority
from ..loop._internal import FINISHED
from ._schedules import EveryNSteps
from ._writers import WRITERS

# Peak dense bf16 FLOP/s per device, by `device_kind`, for MFU without `peak_flops`.
PEAK_FLOPS = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H100": 989e12,
    "NVIDIA H200": 989e12,
}


class Throughput:
    """The throughput hooks; created by `hooks.throughput`.

    Each rate is timed between steps the loop saw finished (it waits for its steps in
    flight in batches, and tells this hook when), never between dispatches: JAX dispatches
    ahead, so a step handed to the device at time t may finish much later, and a window
    timed from dispatches reads a queue filling up, not training.

    Attributes:
      peak_flops: peak FLOP/s of all the trainer's devices together, or None (no MFU).
      flops_per_step: FLOPs of one optimizer step over all devices, from XLA's cost
        analysis of the compiled train step, or None before it compiled.
      examples_per_step: examples one optimizer step reads, or None before it compiled.
      last: the values of the latest log (`{"train/steps_per_second": ..., ...}`).
      windows: `(first, last, seconds)` of each rate logged: the global steps finished
        at the window's start and end, and the seconds between (the rate is
        `(last - first) / seconds`).
    """

    def __init__(self, loop: Loop, clock: Callable[[], float], peak_flops: float | None):
        self.loop = loop
        self.clock = clock
        devices = loop.trainer.devices
        if peak_flops is None:
            per_device = PEAK_FLOPS.get(devices[0].device_kind)
            peak_flops = None if per_device is None else per_device * len(devices)
        self.peak_flops = peak_flops
        self.flops_per_step: float | None = None
        self.examples_per_step: float | None = None
        self.last: dict[str, float] = {}
        self.windows: list[tuple[int, int, float]] = []
        self._start: tuple[float, int] | None = None  # (clock, global steps finished)
        self._asked: list[int] = []  # global steps whose log waits for their window's end
        self._values: dict[str, float] | None = None  # the current run's latest window's
        self._run_start = -1  # the global step the current run started at

    def on_exec_creation(self, info: Any) -> None:
        """A program compiled: the window restarts after it; a train step gives its costs."""
        if info.steps:
            if info.flops_per_step is not None:
                self.flops_per_step = info.flops_per_step
            self.examples_per_step = info.examples / info.steps
        step = self.loop.trainer.global_step
        if step == self._run_start:  # before the run's first step: none is in flight
            self._start, self._values = (self.clock(), step), None
        else:  # steps in flight ran during it: the next window starts at the next finished
            self._start = None

    def on_start(self, loop: Loop, dataset: Any) -> None:
        """A run starts: no step is in flight, so the window starts now."""
        del dataset
        self._run_start = loop.trainer.global_step
        self._start, self._values = (self.clock(), self._run_start), None
        self._asked.clear()

    def on_restore(self, loop: Loop, step: int) -> None:
        """The run goes on from an earlier step: the window restarts at the next finished steps."""
        del loop, step
        self._start = None
        self._asked.clear()

    def __call__(self, loop: Loop, metrics: Any) -> None:
        """OnStep at a log step: the log is written once the loop sees this step finished."""
        del metrics
        self._asked.append(loop.trainer.global_step)

    def finished(self, loop_step: int) -> None:
        """The loop waited for its steps through `loop_step`: the logs asked up to it go out.

        A log asked at a step that was finished already when the window began (the loop saw
        it finished with newer ones) takes the window that holds it: the previous one.
        """
        now, done = self.clock(), loop_step + 1
        if self._start is None:
            self._start, self._values = (now, done), None
            return
        asked = [step for step in self._asked if step <= done]
        if not asked:
            return  # the window goes on to a step asked for
        self._asked = [step for step in self._asked if step > done]
        started, first = self._start
        if done > first and now > started:
            self._start = (now, done)
            self.windows.append((first, done, now - started))
            self._values = self._rates((done - first) / (now - started))
        if self._values is None:
            return
        self.last = self._values
        for step in asked:
            self.loop.history.record(step, self._values)
            for writer_hooks in self.loop.shared_data.get(WRITERS, []):
                writer_hooks.writer.write_scalars(step, self._values)

    def _rates(self, steps_per_second: float) -> dict[str, float]:
        values = {"train/steps_per_second": steps_per_second}
        if self.examples_per_step is not None:
            values["train/examples_per_second"] = steps_per_second * self.examples_per_step
        if self.flops_per_step is not None:
            values["train/flops_per_step"] = self.flops_per_step
            if self.peak_flops:
                values["train/mfu"] = self.flops_per_step * steps_per_second / self.peak_flops
        return values

    def __repr__(self) -> str:
        return f"Throughput(last={self.last}, peak_flops={self.peak_flops})"


def throughput(
    loop: Loop,
    every_n_steps: int = 100,
    *,
    peak_flops: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Throughput:
    """Logs the training's speed and, where the peak is known, its FLOPs utilization.

    Every `every_n_steps` steps (and only between two such logs): `train/steps_per_second`,
    `train/examples_per_second`, `train/flops_per_step` (XLA's cost analysis of the
    compiled train step, summed over the devices: no extra compilation) and `train/mfu`
    (model FLOPs utilization: FLOPs per second over the devices' peak). They go to
    `loop.history` and to every writer of the loop (TensorBoard, `metrics_log`, plots,
    MLflow): attach it after them. Each window is timed between steps the loop saw finished
    on the device (it waits for its steps in flight in batches, with no wait added here),
    not between dispatches, which run ahead of the device: so the first window of a run is
    right too. A log asked at step k is written, at step k, once the loop next sees step k
    finished (at the latest at the run's end), over the window up to the steps finished
    then; a run shorter than the loop's steps in flight (32 on one device) whose first
    step compiled logs no rate. The window between two logs leaves out what came before a
    compilation (a new shape, a fused group size met first), so compile time never lowers
    the rate. The peak is `peak_flops` (FLOP/s of all the trainer's devices
    together) or, for known TPU and GPU kinds, their dense bf16 peak times the device
    count; without one there is no MFU.

    Args:
      loop: the `loopax.Loop`.
      every_n_steps: log after step k iff `(k + 1) % every_n_steps == 0`.
      peak_flops: the devices' peak FLOP/s together, for `train/mfu`.
      clock: returns the time in seconds, read when the loop sees steps finished; inject
        a fake one in tests.

    Returns:
      The `Throughput` (`last`, `windows`, `flops_per_step`, `examples_per_step`,
      `peak_flops`).

    Raises:
      ValueError: `every_n_steps` is not a positive int, or `peak_flops` is not positive.
    """
    if peak_flops is not None and (isinstance(peak_flops, bool) or not peak_flops > 0):
        raise ValueError(f"throughput: peak_flops must be > 0 FLOP/s, got {peak_flops!r}")
    if not callable(clock):
        raise TypeError(f"throughput: clock must be a callable returning seconds, got {clock!r}")
    meter = Throughput(loop, clock, None if peak_flops is None else float(peak_flops))
    loop.trainer.on_exec_creation(meter.on_exec_creation)
    loop.on_start("throughput", meter.on_start, priority=Priority.LOG - 1)
    loop.on_restore("throughput", meter.on_restore, priority=Priority.LOG - 1)
    loop.shared_data.setdefault(FINISHED, []).append(meter.finished)
    loop.on_step(
        "throughput",
        meter,
        priority=Priority.LOG - 1,
        check_finite=False,
        when=EveryNSteps(every_n_steps),
    )
    return meter
