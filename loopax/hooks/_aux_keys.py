"""Train metric keys of a loss function's auxiliary outputs, named before the trainer knows them.

A loss function returning `(loss, {name: value})` shows its names only when a train step is
traced (`Trainer.loss_aux_names` is None until then). A hook attached before the first step
(`monitor="train/<name>"`, `best_metric="train/<name>"`) cannot check such a key at once: it
is accepted, and checked after the run's first step, when the names are known; a key still
missing then raises the hook's own error, listing the metrics there are. Where the names are
known at attach (no `loss_fn`, or a step compiled), the hook checks at once as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..loop import Loop, Priority, RunInfo, Schedule
from ..loop._internal import NEVER
from ..trainer import Trainer

TRAIN_PREFIX = "train/"


def awaits_aux_names(trainer: Trainer, key: Any) -> bool:
    """Whether `key` is a `"train/<name>"` that may become a train metric once compiled.

    True only while the trainer's auxiliary output names are unknown, for a `<name>` that
    is not a train metric yet and could name an auxiliary output (non-empty, no `/`).
    """
    if not isinstance(key, str) or not key.startswith(TRAIN_PREFIX):
        return False
    name = key[len(TRAIN_PREFIX) :]
    return (
        bool(name)
        and "/" not in name
        and name not in trainer.train_metric_names
        and trainer.loss_aux_names is None
    )


class _OnceNamesKnown(Schedule):
    """Fires once, at the first step end (or fused group end) after the aux names are known.

    Clock-like (`time_based`): it never ends a fused group early. After firing it names no
    step again.
    """

    time_based = True

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.pending = True

    def next_step(self, run: RunInfo, step: int) -> int:
        return step if self.pending else NEVER

    def should_fire(self, run: RunInfo) -> bool:
        return self.pending and self.trainer.loss_aux_names is not None

    def fired(self, run: RunInfo) -> None:
        self.pending = False


def check_at_first_step(loop: Loop, name: str, check: Callable[[], Any]) -> None:
    """Calls `check()` once, after the first train step (when the aux names are known).

    What `check` raises fails that step as any hook's error does (a `HookError` naming
    the hook `"<name>: metric check"` and the step).
    """
    loop.on_step(
        f"{name}: metric check",
        lambda _loop, _metrics: check(),
        Priority.VALIDATE,
        when=_OnceNamesKnown(loop.trainer),
        check_finite=False,
    )
