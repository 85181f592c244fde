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

    The first group asks for nothing: before the first step only the program that step
    runs is traced and compiled, as in a run of one step a call (the other sizes' tracing
    and lowering on the training thread, and their compiling on cores the first program's
    compiling needs, made a fused run's first step slower: issue 33 item 4). The second
    group asks for the sizes of the steps from its own on, its own included when it is of
    a size not compiled yet (the training thread then waits for it, compiled beside the
    others), so that no group after the first compiles on the training thread.

    Args:
      trainer: compiles the programs.
      steps_per_execution: the loop's steps per execution (the largest group).
    """

    def __init__(self, trainer: Trainer, steps_per_execution: int):
        self._trainer = trainer
        self._steps_per_execution = steps_per_execution
        self._group_stop = -1  # the group stop the sizes were last asked up to
        self._asked: set[int] = set()
        self._requests = 0  # groups that started a stretch, the first included

    def before_group(self, dispatches: list[Dispatch], first: int, group_stop: int) -> None:
        """Before the group of `dispatches`, from step `first`, in steps before `group_stop`."""
        if group_stop == self._group_stop:  # every group but a stretch's first: nothing to ask
            return
        now = {dispatch.count for dispatch in dispatches}
        self._requests += 1
        if self._requests == 1:  # the first group: its own program alone (it compiles it)
            self._asked |= now
            return
        self._group_stop = group_stop
        sizes = group_sizes(group_stop - first, self._steps_per_execution)
        # The second group's own size, when new, is compiled beside the others (it waits).
        wanted = sizes - self._asked - (set() if self._requests == 2 else now)
        self._asked |= sizes | now
        if wanted:
            self._trainer.compile_ahead(dispatches[0], sorted(wanted, reverse=True))
