"""The loop's metrics for hooks: read once per step, logged without waiting, evaluated once."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import jax

from .._devices import host_floats, start_host_copies
from ..data import Dataset
from ..data._internal import dataset_name
from ._history import Evaluation, History, train_key
from ._hook import Metrics

if TYPE_CHECKING:
    from ..trainer import Trainer

LogFn = Callable[[int, dict[str, float]], Any]


class PendingLog(NamedTuple):
    """Train metrics asked for by `LoopMetrics.log`, kept until their step has finished."""

    step: int  # the loop step
    metrics: Metrics
    extra: dict[str, Any]  # device values added by the callers, by key
    callbacks: list[tuple[LogFn, tuple]]  # (callback, the extra keys it asked for)


class Chunk(NamedTuple):
    """One compiled call of a group of fused steps."""

    first_step: int
    steps: int
    stacked: Any  # the call's metrics with a leading steps axis; None for a call of one step
    last: Any  # the metrics of its last step


class GroupMetrics(dict):
    """The metrics of the last step of a group of fused steps (`steps_per_execution`).

    A dict like any step's metrics, which also carries every step's: `chunks` lists
    `(first loop step, step count, stacked metrics or None, last metrics)` per compiled
    call of the group (a call of one step has no stacked metrics: its last are its own).
    """

    def __init__(self, last: dict[str, Any], chunks: list[Chunk]):
        super().__init__(last)
        self.chunks = chunks

    def stacked(self, key: str) -> list[tuple[int, Any]]:
        """`(first step, values with a leading steps axis)` of `key`, per chunk, on device."""
        return [
            (
                chunk.first_step,
                chunk.last[key][None] if chunk.stacked is None else chunk.stacked[key],
            )
            for chunk in self.chunks
        ]

    def every_step(self) -> dict[str, Any]:
        """`{name: every step's values on a leading axis}`; a host metric's after the group."""
        import jax.numpy as jnp  # noqa: PLC0415

        result = {}
        for key, value in self.items():
            if isinstance(value, jax.Array):
                parts = [values for _, values in self.stacked(key)]
                result[key] = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
            else:
                result[key] = value
        return result


def every_step(group: GroupMetrics | None, metrics: Metrics) -> dict[str, Any]:
    """`group.every_step()`, or the latest step's `metrics` on an axis of one (no group)."""
    if group is None:
        import jax.numpy as jnp  # noqa: PLC0415

        return {key: jnp.asarray(value)[None] for key, value in metrics.items()}
    return group.every_step()


class LoopMetrics:
    """Reads a loop's train metrics for its hooks, and evaluates once per step and dataset.

    Args:
      trainer: the trainer that evaluates.
      history: where what is read is recorded.
      publish: called with each new `Evaluation` (the loop's OnEvaluation hooks).

    Attributes:
      pending_logs: the train metrics asked for by `log`, not read yet, oldest first.
    """

    def __init__(
        self, trainer: Trainer, history: History, publish: Callable[[Evaluation], None]
    ) -> None:
        self._trainer = trainer
        self._history = history
        self._publish = publish
        self._host: dict[str, float] = {}
        self._host_step = -1
        self._evaluations: dict[str, Evaluation] = {}
        self._evaluations_step = -1
        self.pending_logs: list[PendingLog] = []

    def host(self, metrics: Metrics, step: int) -> dict[str, float]:
        """Loop step `step`'s `metrics` as Python floats, read at most once per step."""
        if self._host_step != step:
            self._host = dict(zip(metrics, host_floats(metrics.values()), strict=True))
            self._host_step = step
        return dict(self._host)

    def record(self, metrics: Metrics, step: int) -> dict[str, float]:
        """Records loop step `step`'s `metrics` in the history; returns them keyed."""
        keyed = {train_key(name): value for name, value in self.host(metrics, step).items()}
        if keyed:
            self._history.record(step + 1, keyed)
        return keyed

    def log(self, metrics: Metrics, step: int, fn: LogFn, extra: dict[str, Any] | None) -> None:
        """Keeps loop step `step`'s `metrics` for `fn`, to be read by `resolve_logs`."""
        if not metrics:
            return
        extra = dict(extra or {})
        pending = self.pending_logs
        if pending and pending[-1].step == step:
            pending[-1].extra.update(extra)
            pending[-1].callbacks.append((fn, tuple(extra)))
        else:
            pending.append(PendingLog(step, metrics, extra, [(fn, tuple(extra))]))

    def _due(self, through_step: int) -> int:
        """How many pending logs, oldest first, are of steps `<= through_step`."""
        pending = self.pending_logs
        due = 0
        while due < len(pending) and pending[due].step <= through_step:
            due += 1
        return due

    def start_reads(self, through_step: int, *also: Any) -> None:
        """Starts copying the logs due through `through_step`, and `also`, to the host.

        The loop calls it before it reads a waited-for window's check (`also`), so that the
        check and the window's logs wait once for the device (`start_host_copies`), not once
        per value.
        """
        values = list(also)
        for entry in self.pending_logs[: self._due(through_step)]:
            values += [*entry.metrics.values(), *entry.extra.values()]
        if len(values) > 1:
            start_host_copies(values)

    def resolve_logs(self, through_step: int) -> None:
        """Reads and hands out the pending train logs of steps `<= through_step`.

        Their steps are done: every value of every log due is read in one go (one wait for
        the device on an accelerator, `host_floats`), then each writer is called.
        """
        ready = self._due(through_step)
        if not ready:
            return
        entries, self.pending_logs = self.pending_logs[:ready], self.pending_logs[ready:]
        values = iter(
            host_floats(
                value
                for entry in entries
                for value in [*entry.metrics.values(), *entry.extra.values()]
            )
        )
        for step, metrics, extra, callbacks in entries:
            keyed = {train_key(name): next(values) for name in metrics}
            extra = {key: next(values) for key in extra}
            self._history.record(step + 1, {**keyed, **extra})
            for callback, extra_keys in callbacks:
                callback(step + 1, {**keyed, **{key: extra[key] for key in extra_keys}})

    def drop_logs(self) -> None:
        """Forgets every pending log, unread (a run that raised)."""
        self.pending_logs.clear()

    def forget_from(self, step: int) -> None:
        """Forgets the pending logs of loop steps `>= step` and the evaluations held."""
        self._evaluations_step = -1
        self.pending_logs = [entry for entry in self.pending_logs if entry.step < step]

    def evaluate(self, dataset: Dataset) -> Evaluation:
        """`dataset`'s evaluation at the trainer's global step, evaluated once; see `Loop`."""
        name = dataset_name(dataset)
        step = self._trainer.global_step
        if self._evaluations_step != step:
            self._evaluations, self._evaluations_step = {}, step
        evaluation = self._evaluations.get(name)
        if evaluation is None:
            evaluation = Evaluation(step, name, self._trainer.evaluate(dataset))
            self._evaluations[name] = evaluation
            self._history.record(step, evaluation.keyed())
            self._publish(evaluation)
        return evaluation

    def evaluation(self, dataset: str) -> Evaluation | None:
        """The evaluation of the dataset named `dataset` at the current global step, if any."""
        if self._evaluations_step != self._trainer.global_step:
            return None
        return self._evaluations.get(dataset)
