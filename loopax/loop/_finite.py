"""Checks every step's loss without a per-step host sync, naming the first bad step."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from .. import _warnings
from ..trainer._internal import (
    MOVING_AVERAGE_LOSS,
    OVERFLOW_STEPS,
    SKIPPED_STEPS,
    overflow_steps,
    skipped_steps,
)
from ._batch_check import batch_advice
from ._loop_metrics import GroupMetrics
from ._rate_check import rate_problem


class StepToken(NamedTuple):
    """What the loop keeps of a dispatch while its steps are in flight."""

    last_step: int  # the loop step of its last step
    metrics: dict[str, jax.Array]  # a `GroupMetrics` for a group of fused steps
    dispatches: list[Any]  # the batches it ran, held for the non-finite diagnosis


Window = list[StepToken]
NonFiniteHandler = Callable[[Any, list[int]], None]


class NonFiniteLossError(FloatingPointError):
    """The loss of a step was NaN or infinite; the message names the first such step.

    Attributes:
      step: the loop step (0-based) of the first non-finite loss, or None.
    """

    def __init__(self, message: str, step: int | None = None):
        super().__init__(message)
        self.step = step


def _as_float(value: Any) -> float:
    return float(np.asarray(value))


def per_step(window: Window, key: str) -> list[tuple[int, float]]:
    """`(loop step, value of key)` for every step of `window`, groups expanded; one read."""
    parts = []
    for token in window:
        if isinstance(token.metrics, GroupMetrics):
            parts.extend(token.metrics.stacked(key))
        else:
            parts.append((token.last_step, token.metrics[key]))
    values = jax.device_get([value for _, value in parts])
    result = []
    for (first, _), value in zip(parts, values, strict=True):
        array = np.asarray(value)
        if array.ndim == 0:
            result.append((first, float(array)))
        else:
            result.extend((first + i, float(v)) for i, v in enumerate(array))
    return result


class FiniteChecker:
    """Reads one value per in-flight window, when the loop already waits for it.

    The loss's moving average is sticky: once a step's loss is NaN or infinite, every
    later average is too (until the train metrics are reset at a run's start). So the
    average of the newest step of a window tells whether any step of the window went bad,
    and only then are the window's losses read to find the first. While the trainer skips
    non-finite steps (`Trainer.skip_non_finite_steps`), the average stays finite and the
    running count of skipped steps plays that part; the skipped steps go to the handler.
    With a dynamic loss scale, the skips it counts as overflows (a finite loss, the scale
    above its smallest) are routine and go to no handler: the scale halves and training goes
    on.
    """

    def __init__(self) -> None:
        self.checked_through = -1  # the newest loop step known to be finite (or handled)
        self.handler: NonFiniteHandler | None = None
        self._sentinel_metric = MOVING_AVERAGE_LOSS
        self._skipped_seen = 0.0
        self._overflows = False  # whether the steps report `overflow_steps`
        self._overflows_seen = 0.0
        # A failure stays raised: a hook that catches it cannot make the run go on quietly.
        self.failure: NonFiniteLossError | None = None

    def raise_failure(self) -> None:
        """Raises the non-finite loss found earlier in this run, if any."""
        if self.failure is not None:
            raise self.failure

    def start_run(self, trainer: Any, start_step: int) -> None:
        """A run starts at `start_step` with freshly reset train metrics."""
        self._sentinel_metric = (
            SKIPPED_STEPS if trainer.skipping_non_finite_steps else MOVING_AVERAGE_LOSS
        )
        self._skipped_seen = 0.0
        self._overflows = self._sentinel_metric == SKIPPED_STEPS and trainer.loss_scale == "dynamic"
        # Counted since training began (kept with the loss scale), not since this run.
        self._overflows_seen = self._overflows_in(trainer.state)
        self.checked_through = start_step - 1
        self.failure = None

    def _overflows_in(self, state: Any) -> float:
        if not self._overflows or state is None:
            return 0.0
        return _as_float(jax.device_get(overflow_steps(state)))

    def restart(self, trainer: Any, step: int) -> None:
        """The run continues from `step` with the trainer's (restored) state."""
        self.checked_through = step - 1
        state = trainer.state
        if state is not None:
            self._skipped_seen = _as_float(jax.device_get(skipped_steps(state)))
            self._overflows_seen = self._overflows_in(state)

    @property
    def sentinel_metric(self) -> str:
        """The metric whose newest value tells whether a window needs a closer look.

        The loss's moving average, or while the trainer skips non-finite steps the count
        of skipped steps (see the class).
        """
        return self._sentinel_metric

    def sentinel_of(self, window: Window) -> Any:
        """The value `verify` reads of `window`: its newest step's `sentinel_metric`."""
        return window[-1].metrics[self._sentinel_metric]

    def set_handler(self, handler: NonFiniteHandler | None) -> None:
        """Hands the skipped steps to `handler(loop, steps)` instead of a warning; None: warn."""
        self.handler = handler

    def verify(self, loop: Any, window: Window) -> None:
        """Checks the steps of `window` (all finished); raises or calls the handler.

        Raises:
          NonFiniteLossError: a step's loss is not finite (naming the first) and no
            non-finite handler takes it.
        """
        self.raise_failure()
        newest_step = window[-1].last_step
        value = _as_float(self.sentinel_of(window))
        if self._sentinel_metric == MOVING_AVERAGE_LOSS:
            if not math.isfinite(value):
                self._raise_first(loop, window, value)
        elif value != self._skipped_seen:
            skipped = self._skipped_in(window)
            self._skipped_seen = value
            self.checked_through = newest_step
            if skipped:
                self._handle(loop, skipped)
            return
        self.checked_through = newest_step

    def _skipped_in(self, window: Window) -> list[int]:
        """The steps of `window` skipped for a non-finite loss or gradient (not an overflow)."""
        counts = per_step(window, SKIPPED_STEPS)
        overflows = per_step(window, OVERFLOW_STEPS) if self._overflows else None
        previous, previous_overflows, skipped = self._skipped_seen, self._overflows_seen, []
        for index, (step, count) in enumerate(counts):
            overflowed = False
            if overflows is not None:
                overflowed = overflows[index][1] > previous_overflows
                previous_overflows = overflows[index][1]
            if count > previous and not overflowed:
                skipped.append(step)
            previous = count
        self._overflows_seen = previous_overflows
        return skipped

    def _raise_first(self, loop: Any, window: Window, average: float) -> None:
        for step, loss in per_step(window, "loss"):
            if not math.isfinite(loss):
                # A learning rate that is not finite is said first: the loss only follows it.
                message = rate_problem(loop.trainer, step, loss) or (
                    f"the loss is {loss} at step {step} (global step {step + 1}), the first "
                    "non-finite step; stopped before any checkpoint could save it. "
                    + _advice(loop, window, step)
                )
                self.failure = NonFiniteLossError(message, step)
                raise self.failure
        step = window[-1].last_step
        self.failure = NonFiniteLossError(
            f"the moving average of the loss is {average} at step {step} (global step "
            f"{step + 1}) although every loss "
            "was finite: the losses are too large for float32; scale the loss down",
            step,
        )
        raise self.failure

    def _handle(self, loop: Any, skipped: list[int]) -> None:
        if self.handler is not None:
            self.handler(loop, skipped)
            return
        _warnings.warn(
            f"skipped {len(skipped)} train step(s) with a non-finite loss or gradient: steps "
            f"{skipped[:10]}{' ...' if len(skipped) > 10 else ''} (Trainer.skip_non_finite_steps "
            "is on); attach hooks.nan_guard to roll back or stop when it persists"
        )


def _advice(loop: Any, window: Window, step: int) -> str:
    """`batch_advice` for loop step `step` of `window`: what its batch holds, what to do."""
    for token in window:
        if step <= token.last_step:
            first = token.last_step - sum(dispatch.count for dispatch in token.dispatches) + 1
            return batch_advice(loop.trainer, token.dispatches, first, step)
    raise AssertionError(f"step {step} is past the window's last step {window[-1].last_step}")
