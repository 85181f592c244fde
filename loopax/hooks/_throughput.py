"""`throughput`: steps/s, examples/s, FLOPs per step and MFU, logged through every writer."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..loop import Loop, Priority
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

    Attributes:
      peak_flops: peak FLOP/s of all the trainer's devices together, or None (no MFU).
      flops_per_step: FLOPs of one optimizer step over all devices, from XLA's cost
        analysis of the compiled train step, or None before it compiled.
      examples_per_step: examples one optimizer step reads, or None before it compiled.
      last: the values of the latest log (`{"train/steps_per_second": ..., ...}`).
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
        self._start: tuple[float, int] | None = None  # (clock, global step) of the window

    def on_exec_creation(self, info: Any) -> None:
        """A program compiled: the window restarts after it; a train step gives its costs."""
        if info.steps:
            if info.flops_per_step is not None:
                self.flops_per_step = info.flops_per_step
            self.examples_per_step = info.examples / info.steps
        self._start = (self.clock(), self.loop.trainer.global_step)

    def on_start(self, loop: Loop, dataset: Any) -> None:
        del dataset
        self._start = (self.clock(), loop.trainer.global_step)

    def __call__(self, loop: Loop, metrics: Any) -> None:
        now, step = self.clock(), loop.trainer.global_step
        start, self._start = self._start, (now, step)
        if start is None or step <= start[1] or now <= start[0]:
            return
        steps_per_second = (step - start[1]) / (now - start[0])
        values = {"train/steps_per_second": steps_per_second}
        if self.examples_per_step is not None:
            values["train/examples_per_second"] = steps_per_second * self.examples_per_step
        if self.flops_per_step is not None:
            values["train/flops_per_step"] = self.flops_per_step
            if self.peak_flops:
                values["train/mfu"] = self.flops_per_step * steps_per_second / self.peak_flops
        self.last = values
        loop.history.record(step, values)
        for writer_hooks in loop.shared_data.get(WRITERS, []):
            writer_hooks.writer.write_scalars(step, values)

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
    MLflow): attach it after them. The window between two logs leaves out what came before
    a compilation (a new shape, a fused group size met first), so compile time never
    lowers the rate. The peak is `peak_flops` (FLOP/s of all the trainer's devices
    together) or, for known TPU and GPU kinds, their dense bf16 peak times the device
    count; without one there is no MFU.

    Args:
      loop: the `loopax.Loop`.
      every_n_steps: log after step k iff `(k + 1) % every_n_steps == 0`.
      peak_flops: the devices' peak FLOP/s together, for `train/mfu`.
      clock: returns the time in seconds; inject a fake one in tests.

    Returns:
      The `Throughput` (`last`, `flops_per_step`, `examples_per_step`, `peak_flops`).

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
    loop.on_step(
        "throughput",
        meter,
        priority=Priority.LOG - 1,
        check_finite=False,
        when=EveryNSteps(every_n_steps),
    )
    return meter
