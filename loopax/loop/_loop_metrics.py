"""The Loop's metrics for hooks.

Read once per step, logged without waiting; evaluations published once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..data._datasets import Dataset, dataset_name
from ._history import Evaluation, History, train_key
from ._hook import NEVER, HookError
from ._hook_registry import HookRegistry

if TYPE_CHECKING:
    from ..trainer._trainer import Trainer

Metrics = dict[str, Any]
LogFn = Callable[[int, dict[str, float]], Any]


class MetricsAccess(HookRegistry):
    """The part of `Loop` that gives hooks the metrics; see `Loop`."""

    # Set by `Loop`.
    trainer: Trainer
    metrics: Metrics
    history: History
    _metrics_step: int

    def __init__(self) -> None:
        super().__init__()
        self._host_metrics: dict[str, float] = {}
        self._host_metrics_step = -1
        self._evaluations: dict[str, Evaluation] = {}
        self._evaluations_step = -1
        # Train metrics asked for by `log_train_metrics`, read once their step finished:
        # (loop step, its metrics, extra device values, [(callback, its extra keys)]).
        self._pending_logs: list[
            tuple[int, Metrics, dict[str, Any], list[tuple[LogFn, tuple]]]
        ] = []

    def host_metrics(self) -> dict[str, float]:
        """The latest step's metrics as Python floats (it waits for that step).

        Read from the device at most once per step, however many hooks ask.
        """
        if self._host_metrics_step != self._metrics_step:
            self._host_metrics = {key: float(np.asarray(v)) for key, v in self.metrics.items()}
            self._host_metrics_step = self._metrics_step
        return dict(self._host_metrics)

    def record_train_metrics(self) -> dict[str, float]:
        """Records the latest step's metrics in `history`; returns them keyed `"train/<metric>"`.

        Reads them as `host_metrics` does and records them at their global step. Writers
        call it on the steps they log.
        """
        keyed = {train_key(name): value for name, value in self.host_metrics().items()}
        if keyed:
            self.history.record(self._metrics_step + 1, keyed)
        return keyed

    def log_train_metrics(self, fn: LogFn, extra: dict[str, Any] | None = None) -> None:
        """Logs the latest step's train metrics without waiting for the device.

        Once the step has finished (when the loop next waits for it anyway: at most one
        in-flight window later, or at the latest at `check_finite`, `flush` or the end of
        the run) its metrics are read (once, however many writers asked), recorded in
        `history` at their global step, and `fn(global_step, values)` is called with
        `values` keyed `"train/<metric>"`, plus this caller's `extra` (`{key: device
        scalar}`, e.g. the learning rate), read at the same time and recorded too.
        """
        step = self._metrics_step
        if not self.metrics:
            return
        extra = dict(extra or {})
        pending = self._pending_logs
        if pending and pending[-1][0] == step:
            pending[-1][2].update(extra)
            pending[-1][3].append((fn, tuple(extra)))
        else:
            pending.append((step, self.metrics, extra, [(fn, tuple(extra))]))
        if not self._running:
            self._resolve_logs(NEVER)

    def _resolve_logs(self, through_step: int) -> None:
        """Reads and hands out the pending train logs of steps `<= through_step`."""
        pending = self._pending_logs
        ready = 0
        while ready < len(pending) and pending[ready][0] <= through_step:
            ready += 1
        if not ready:
            return
        entries, self._pending_logs = pending[:ready], pending[ready:]
        for step, metrics, extra, callbacks in entries:
            # Those steps are done: reading each scalar is a copy, ~1 µs (jax.device_get of
            # the same dict costs tens of µs in tree handling).
            keyed = {train_key(name): float(np.asarray(v)) for name, v in metrics.items()}
            extra = {key: float(np.asarray(v)) for key, v in extra.items()}
            self.history.record(step + 1, {**keyed, **extra})
            for callback, extra_keys in callbacks:
                callback(step + 1, {**keyed, **{key: extra[key] for key in extra_keys}})

    def flush(self) -> Callable[[], None]:
        """Hands the pending train logs to their writers and asks every output to write out.

        The outputs are the OnFlush hooks. Returns a function that waits until all of it is
        on disk.

        A checkpoint calls it after the hooks of the step it saves and waits before it
        commits, so that a resumed run's logs hold every point up to the checkpoint.
        """
        self._resolve_logs(NEVER)
        waiters = []
        for hook in self._hooks["OnFlush"]:
            try:
                waiter = hook.fn(self, None)
            except Exception as err:
                raise HookError("OnFlush", hook.name, self.loop_step, err) from err
            if callable(waiter):
                waiters.append(waiter)

        def wait() -> None:
            for waiter in waiters:
                waiter()

        return wait

    def evaluate(self, dataset: Dataset) -> Evaluation:
        """Evaluates `dataset` at the current global step, once.

        A second call at the same step returns the same `Evaluation`. A new evaluation is
        recorded in `history` (`"eval/<dataset>/<metric>"`) and published to the
        OnEvaluation hooks.

        Raises:
          ValueError: the dataset has no non-empty str `name`.
        """
        name = dataset_name(dataset)
        step = self.trainer.global_step
        if self._evaluations_step != step:
            self._evaluations, self._evaluations_step = {}, step
        evaluation = self._evaluations.get(name)
        if evaluation is None:
            evaluation = Evaluation(step, name, self.trainer.evaluate(dataset))
            self._evaluations[name] = evaluation
            self.history.record(step, evaluation.keyed())
            self._run_phase("OnEvaluation", evaluation)
        return evaluation

    def evaluation(self, dataset: str) -> Evaluation | None:
        """The evaluation of dataset `dataset` (a name) at the current global step, if any."""
        if self._evaluations_step != self.trainer.global_step:
            return None
        return self._evaluations.get(dataset)
