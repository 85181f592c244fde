"""What the progress bar shows: a rate without compile time, its text, finished steps' metrics."""

from __future__ import annotations

import collections
import math
from typing import Any

import jax

from .._devices import host_floats

_RATE_PREFIXES = ("", "k", "M", "G", "T")


class Throughput:
    """Steps per second and ETA that leave out the steps during which something compiled.

    The caller marks each finished step with `step_done(now)`; `compiled()` says an executable
    was compiled since the previous mark, so that interval (compile time plus a step) is not
    counted: otherwise the first step's compilation would skew every estimate.

    Example:
      >>> throughput = Throughput()
      >>> throughput.start(0.0)
      >>> throughput.compiled()
      >>> throughput.step_done(30.0)  # step 1 compiled for 30 s: not counted
      >>> for now in (30.5, 31.0, 31.5):
      ...     throughput.step_done(now)
      >>> throughput.steps_per_second(), throughput.eta_seconds(steps_left=10)
      (2.0, 5.0)
    """

    counted_steps: int
    counted_seconds: float

    def __init__(self) -> None:
        self.counted_steps = 0
        self.counted_seconds = 0.0
        self._last: float | None = None
        self._compiled = False

    def start(self, now: float) -> None:
        """Starts timing (a new run): the next interval ends at the next `step_done`."""
        self._last = now
        self._compiled = False

    def compiled(self) -> None:
        """Marks the current interval as including a compilation."""
        self._compiled = True

    def step_done(self, now: float, steps: int = 1) -> None:
        """Ends an interval of `steps` steps; counts it unless it included a compilation."""
        if self._last is not None and not self._compiled:
            self.counted_steps += steps
            self.counted_seconds += now - self._last
        self._last = now
        self._compiled = False

    def steps_per_second(self) -> float | None:
        """The mean rate over the counted steps, or None before any."""
        if self.counted_steps == 0 or self.counted_seconds <= 0:
            return None
        return self.counted_steps / self.counted_seconds

    def eta_seconds(self, steps_left: int) -> float | None:
        """Seconds for `steps_left` more steps at the current rate, or None if unknown."""
        rate = self.steps_per_second()
        return None if rate is None or steps_left < 0 else steps_left / rate


def format_interval(seconds: float) -> str:
    """`seconds` as tqdm writes a duration: `MM:SS`, or `H:MM:SS` from an hour."""
    from tqdm import tqdm  # noqa: PLC0415  (tqdm loads with the first bar, not with loopax)

    return tqdm.format_interval(seconds)


def format_rate(steps_per_second: float | None, short: bool = False) -> str:
    """A step rate as people read it: `2.84k steps/s`, `45.2 steps/s`, `2.22 s/step`.

    Three significant digits with an SI prefix (k, M, G, T) from a thousand steps a second;
    under one step a second it gives the seconds per step instead, as tqdm does (`s/it`),
    in `MM:SS` from a minute a step. The value is rounded before the prefix is picked, so
    999.5 steps/s reads `1k`, never `1e+03`.

    Args:
      steps_per_second: the rate, or None while unknown (`?`).
      short: the compact form for a narrow line: `2.84k/s`, `2.22s/step`.

    Returns:
      The text.

    Example:
      >>> format_rate(2840.0), format_rate(0.45, short=True), format_rate(None)
      ('2.84k steps/s', '2.22s/step', '? steps/s')
    """
    per_second = "/s" if short else " steps/s"
    if steps_per_second is None or not math.isfinite(steps_per_second) or steps_per_second < 0:
        return "?" + per_second
    if 0 < steps_per_second < 1:
        seconds = 1 / steps_per_second
        if seconds < 60:
            return f"{seconds:.3g}" + ("s/step" if short else " s/step")
        return format_interval(seconds) + "/step"
    value = float(f"{steps_per_second:.3g}")  # 999.5 rounds to 1000 here: `1k`
    prefix = _RATE_PREFIXES[0]
    for prefix in _RATE_PREFIXES:
        if value < 1000 or prefix == _RATE_PREFIXES[-1]:
            break
        value /= 1000
    return f"{value:.3g}{prefix}{per_second}"


def _finished(metrics: dict[str, Any]) -> bool:
    """Whether a step's metrics can be read without waiting for the device.

    A host metric's lazy value has no readiness of its own; it reads step values produced
    with the step's other outputs, so the device arrays beside it answer for it.
    """
    return all(
        value.is_ready()  # pyright: ignore[reportAttributeAccessIssue]  (missing from the stub)
        for value in metrics.values()
        if isinstance(value, jax.Array)
    )


class FinishedMetrics:
    """The newest train metrics whose step finished on the device, read without waiting.

    The bar is handed each refreshed step's metrics while that step may still be in flight
    (with fused steps, a whole group). `offer` keeps them; `advance` finds the newest kept
    one that finished (steps finish in order, so it looks from the newest back and stops at
    the first finished) and drops the older ones; `values` reads that step once, as Python
    floats. Nothing here waits: a step not finished yet is shown at a later refresh.

    Attributes:
      step: the global step of the finished metrics `values` returns, or None before any.
    """

    step: int | None

    def __init__(self) -> None:
        self._offered: collections.deque[tuple[int, dict[str, Any]]] = collections.deque()
        self._newest: dict[str, Any] = {}
        self._values: dict[str, float] | None = {}
        self.step = None

    def offer(self, step: int, metrics: dict[str, Any]) -> None:
        """Keeps global step `step`'s `metrics` (on the device) until they finish."""
        if metrics:
            self._offered.append((step, metrics))

    def forget_after(self, step: int) -> None:
        """Forgets the metrics of global steps after `step` (the run went back to it)."""
        offered = self._offered
        while offered and offered[-1][0] > step:
            offered.pop()
        if self.step is not None and self.step > step:
            self._newest, self._values, self.step = {}, {}, None

    def advance(self) -> None:
        """Moves to the newest offered metrics that finished, without waiting."""
        offered = self._offered
        for position in range(len(offered) - 1, -1, -1):
            step, metrics = offered[position]
            if _finished(metrics):
                for _ in range(position + 1):
                    offered.popleft()
                self._newest, self._values, self.step = metrics, None, step
                return

    def settle(self, step: int, metrics: dict[str, Any]) -> None:
        """Moves to global step `step`'s `metrics`, which the loop waited for (a run's end).

        Not asked of the arrays: each output of a step may turn ready a moment after
        another, and the one the loop waited for is not always the one asked first.
        """
        self._offered.clear()
        if metrics:
            self._newest, self._values, self.step = metrics, None, step

    def values(self) -> dict[str, float]:
        """The finished metrics as Python floats (empty before any), read once per step."""
        if self._values is None:
            newest = self._newest  # finished: read together, one wait on an accelerator
            self._values = dict(zip(newest, host_floats(newest.values()), strict=True))
        return self._values
