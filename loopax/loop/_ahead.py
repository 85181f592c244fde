"""Which fused group sizes a run has the trainer compile ahead, in the background."""

from __future__ import annotations

from ..data._internal import Dispatch, group_sizes
from ..trainer import Trainer


class AheadCompiles:
    """Asks the trainer to compile the group sizes a run's next steps take, once each.

    One per `_train_until` call: when a group starts the steps up to a new cut (the run's
    stop or the step after the next hook's), the sizes those steps split into are compiled
    in the background (`Trainer.compile_ahead`), except those compiled or asked for already
    and those of the dispatches read now (they compile as they run, beside the others).

    Args:
      trainer: compiles the programs.
      most: the loop's steps per execution (the largest group).
    """

    def __init__(self, trainer: Trainer, most: int):
        self._trainer = trainer
        self._most = most
        self._cut = -1  # the cut the sizes were last asked up to
        self._asked: set[int] = set()

    def before_group(self, dispatches: list[Dispatch], first: int, cut: int) -> None:
        """Before the group of `dispatches`, starting at step `first`, in steps up to `cut`."""
        if cut == self._cut:
            return
        self._cut = cut
        sizes = group_sizes(cut - first, self._most)
        now = {dispatch.count for dispatch in dispatches}
        wanted = sizes - self._asked - now
        self._asked |= sizes | now
        if wanted:
            self._trainer.compile_ahead(dispatches[0], sorted(wanted, reverse=True))
