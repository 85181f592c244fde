"""Which fused group sizes a run has the trainer compile ahead, in the background."""

from __future__ import annotations

from ..data._internal import Dispatch, group_sizes
from ..trainer import Trainer


class AheadCompiles:
    """Asks the trainer to compile the group sizes a run's next steps take, once each.

    One per `_train_until` call: when a group starts the steps up to a new group stop (the
    run's stop or the step after the next hook's), the sizes those steps split into are compiled
    in the background (`Trainer.compile_ahead`), except those compiled or asked for already
    and those of the dispatches read now (they compile as they run, beside the others).

    Args:
      trainer: compiles the programs.
      steps_per_execution: the loop's steps per execution (the largest group).
    """

    def __init__(self, trainer: Trainer, steps_per_execution: int):
        self._trainer = trainer
        self._steps_per_execution = steps_per_execution
        self._group_stop = -1  # the group stop the sizes were last asked up to
        self._asked: set[int] = set()

    def before_group(self, dispatches: list[Dispatch], first: int, group_stop: int) -> None:
        """Before the group of `dispatches`, from step `first`, in steps before `group_stop`."""
        if group_stop == self._group_stop:
            return
        self._group_stop = group_stop
        sizes = group_sizes(group_stop - first, self._steps_per_execution)
        now = {dispatch.count for dispatch in dispatches}
        wanted = sizes - self._asked - now
        self._asked |= sizes | now
        if wanted:
            self._trainer.compile_ahead(dispatches[0], sorted(wanted, reverse=True))
