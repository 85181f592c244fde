"""What early stopping and the plateau hook share.

Which metric key to watch, which direction is better, when a value counts as an improvement, and
handing each new value of the key to the hook exactly once (resumes included).
"""

from __future__ import annotations

import abc
import functools
import math
import numbers
from typing import Any

from .. import _warnings
from ..loop import Evaluation, Loop
from ..loop._internal import train_key
from ..trainer import Trainer
from ._aux_keys import awaits_aux_names, check_at_first_step
from ._metric_info import describe_key, split_eval_key

MODES = ("auto", "min", "max")
_AUTO_MODES = {"loss": "min", "accuracy": "max"}  # metric_type -> mode for mode="auto"


def check_number(hook: str, argument: str, value: Any, *, minimum: float | None = 0.0) -> float:
    """`value` as a finite float (>= `minimum` unless None), or a ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{hook}: {argument} must be a finite number, got {argument}={value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{hook}: {argument} must be >= {minimum}, got {argument}={value!r}")
    return float(value)


def resolve_monitor(trainer: Trainer, monitor: Any, hook: str) -> tuple[str | None, str]:
    """`(dataset, metric)` of an `"eval/<dataset>/<metric>"` key, or of a `"train/<metric>"` key.

    A `"train/<metric>"` key gives `(None, metric)`; the metric must be one of the trainer's
    (`MetricMonitor` checks a loss's auxiliary output's after the first step, when it is known).

    Raises:
      ValueError: `monitor` names none of them; the message lists the valid keys.
    """
    train_keys = [train_key(name) for name in trainer.train_metric_names]
    if isinstance(monitor, str):
        if monitor in train_keys:
            return None, monitor[len("train/") :]
        found = split_eval_key(trainer, monitor)
        if found is not None:
            return found
    raise ValueError(
        f"{hook}: monitor={monitor!r} is not one of this trainer's metric keys. Monitor a "
        f"train metric, checked at each epoch end of run_epochs: {train_keys}; or an eval "
        f"metric, checked at each evaluation of its dataset: 'eval/<dataset>/<metric>' with "
        f"<metric> in {list(trainer.eval_metric_names)} (e.g. "
        f"'eval/test/{trainer.eval_metric_names[0]}' for a dataset named 'test', evaluated "
        "by hooks.evaluate)"
    )


def resolve_mode(trainer: Trainer, monitor: str, mode: Any, hook: str) -> str:
    """`"min"` or `"max"`: `mode`, or for `"auto"` the one the metric's type implies.

    `"loss"` -> min, `"accuracy"` -> max.

    Raises:
      ValueError: an unknown `mode`, or `"auto"` for a metric of another type.
    """
    if mode not in MODES:
        raise ValueError(f"{hook}: mode must be one of {list(MODES)}, got mode={mode!r}")
    if mode != "auto":
        return mode
    metric_type = describe_key(trainer, monitor).metric_type
    if metric_type not in _AUTO_MODES:
        raise ValueError(
            f"{hook}: mode='auto' cannot tell whether {monitor!r} (metric type "
            f"{metric_type!r}) is better lower or higher: only losses (min) and accuracies "
            "(max) are known. Pass mode='min' or mode='max'"
        )
    return _AUTO_MODES[metric_type]


class MetricMonitor(abc.ABC):
    """Watches one metric key and hands each new value of it to `on_value` once.

    An `"eval/<dataset>/<metric>"` key is read from every evaluation of that dataset
    (`loop.on_evaluation`); a `"train/<metric>"` key at every epoch end of `run_epochs`
    (the value of the epoch's last step, also recorded in `loop.history`). A value of a
    global step already seen (the same evaluation published again, e.g. after a resume)
    is not counted twice. Subclasses implement `on_value` and extend `get_state`/`set_state`.

    Attributes:
      monitor: the key watched.
      mode: `"min"` or `"max"` (resolved from `"auto"`).
      min_delta: how much better than the reference a value must be to improve on it.
      dataset: the evaluated dataset's name, or None for a train metric.
      checks: how many values were checked so far (across resumes).
      last_step: the global step of the last value checked, or None.
      best: the best value so far, or None.
      best_step: the global step of `best`, or None.
      wait: checks without an improvement (each hook says since what).
    """

    dataset: str | None
    metric: str
    mode: str
    min_delta: float
    name: str
    checks: int
    wait: int
    best: float | None
    best_step: int | None

    def __init__(self, loop: Loop, hook: str, monitor: Any, mode: Any, min_delta: float):
        if not isinstance(loop, Loop):
            raise TypeError(f"{hook} needs a loopax.Loop, got {type(loop).__name__}")
        if awaits_aux_names(loop.trainer, monitor):  # a loss's aux output, known once compiled
            self.dataset, self.metric = None, monitor[len("train/") :]
            check = functools.partial(resolve_monitor, loop.trainer, monitor, hook)
            check_at_first_step(loop, f"{hook}({monitor})", check)
        else:
            self.dataset, self.metric = resolve_monitor(loop.trainer, monitor, hook)
        self.monitor: str = monitor
        self.mode = resolve_mode(loop.trainer, monitor, mode, hook)
        self.min_delta = check_number(hook, "min_delta", min_delta)
        self.name = f"{hook}({monitor})"
        self.checks = 0
        self.last_step: int | None = None
        self.best: float | None = None
        self.best_step: int | None = None
        self.wait = 0
        self._warned_unchecked = False

    def _watch(self, loop: Loop, priority: int) -> None:
        """Registers the hooks that read the monitor, and the state; call last in __init__.

        A state restored before registration is applied at once.
        """
        if self.dataset is None:
            loop.on_epoch_end(self.name, self._on_epoch_end, priority)
        else:
            loop.on_evaluation(self.name, self._on_evaluation, priority)
        loop.add_state(self.name, self)

    def improves(self, value: float, reference: float | None) -> bool:
        """Whether `value` beats `reference` by more than `min_delta` (None: any finite value).

        NaN and infinities never improve: they measure no progress.
        """
        if not math.isfinite(value):
            return False
        if reference is None:
            return True
        if self.mode == "min":
            return value < reference - self.min_delta
        return value > reference + self.min_delta

    @abc.abstractmethod
    def on_value(self, loop: Loop, step: int, value: float) -> None:
        """Acts on a new value of the monitor, measured at global step `step`."""

    def measures_training(self, loop: Loop) -> bool:
        """Whether a value now measures the training; values that do not are ignored.

        A value does not when, e.g., parameters were put in its place between runs.
        """
        del loop
        return True

    def _offer(self, loop: Loop, step: int, value: float) -> None:
        if self.last_step is not None and step <= self.last_step:
            return
        if not self.measures_training(loop):
            return
        self.last_step = step
        self.checks += 1
        self.on_value(loop, step, float(value))

    def _on_evaluation(self, loop: Loop, evaluation: Evaluation) -> None:
        if evaluation.dataset == self.dataset:
            self._offer(loop, evaluation.step, evaluation.values[self.metric])

    def _on_epoch_end(self, loop: Loop, metrics: Any) -> None:
        del metrics
        values = loop.record_train_metrics()
        self._offer(loop, loop.trainer.global_step, values[self.monitor])

    def _warn_if_never_checked(self, loop: Loop) -> None:
        """At the end of a run that trained: nothing may fail silently."""
        if self.checks or self._warned_unchecked or loop.loop_step <= loop.start_step:
            return
        self._warned_unchecked = True
        if self.dataset is None:
            how = (
                "train metrics are checked at the epoch ends of run_epochs, and this run had "
                "none; use run_epochs, or monitor an eval metric"
            )
        else:
            how = (
                f"no evaluation of a dataset named {self.dataset!r} was published; attach "
                f"hooks.evaluate(loop, <that dataset>, every_n_steps=...) or call "
                "loop.evaluate(dataset)"
            )
        _warnings.warn(f"{self.name} never checked {self.monitor!r}: {how}")

    def get_state(self) -> dict[str, Any]:
        """The counters a checkpoint saves (JSON)."""
        return {
            "checks": self.checks,
            "last_step": self.last_step,
            "best": self.best,
            "best_step": self.best_step,
            "wait": self.wait,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores `get_state()`."""
        self.checks = int(state.get("checks", 0))
        self.last_step = state.get("last_step")
        best = state.get("best")
        self.best = None if best is None else float(best)
        self.best_step = state.get("best_step")
        self.wait = int(state.get("wait", 0))
