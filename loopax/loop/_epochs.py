"""The epochs a `Loop` has completed in total, for `run_to_epoch` and checkpoints.

`run_epochs(ds, n)` runs n more epochs (GoMLX's `RunEpochs`); `run_to_epoch(ds, n)` runs
until n are done in total, counting those a restored checkpoint holds, as Keras's
`fit(epochs=n)` with `BackupAndRestore`. The count, where the current epoch began (so that
a run resumed inside an epoch extrapolates its end from a whole epoch) and the target of the
run in progress travel in the loop's state (`Loop.get_state()["epochs"]`).
"""

from __future__ import annotations

from typing import Any

from .. import _warnings


class EpochCount:
    """The epochs completed in total and where the current one began; a `Runner` holds one.

    Attributes:
      done: the epochs completed by `run_epochs` and `run_to_epoch`, restored ones included.
      start_step: the global step the current epoch of an epoch run began at; None outside.
      end_epoch: the target of the `run_to_epoch` in progress; None otherwise.
    """

    def __init__(self) -> None:
        self.done = 0
        self.start_step: int | None = None
        self.end_epoch: int | None = None
        # Of a restored state: where its epoch began, and its run_to_epoch's target.
        self._restored: dict[str, Any] = {}

    def state(self, running: bool) -> dict[str, int | None]:
        """The count, where the current epoch began and the run's target, for a checkpoint."""
        return {
            "done": self.done,
            "epoch_start_step": self.start_step if running else None,
            "end_epoch": self.end_epoch if running else None,
        }

    def remember(self, state: dict[str, Any] | None) -> None:
        """Takes a restored `state()`; None (a checkpoint from before epochs were counted): 0."""
        self._restored = dict(state or {})
        self.done = int(self._restored.get("done", 0))

    def begin(self, end_epoch: int | None) -> int:
        """Starts a run (`end_epoch`: the target of a `run_to_epoch`); its first epoch's number.

        0 for other runs; a `run_to_epoch` counts in total: from the epochs done.
        """
        self.end_epoch = end_epoch
        return 0 if end_epoch is None else self.done

    def continues(self, resumed: dict[str, int] | None, global_step: int, end_step: int) -> bool:
        """Whether the run starting now goes on with the restored run `resumed`.

        A step run does when it has the same end and the global step is inside it; a
        `run_to_epoch` when it has the same target. It then keeps the train metrics'
        averages the checkpoint holds, as the uninterrupted run did.
        """
        if resumed is None:
            return False
        if self.end_epoch is None:
            started = 0 <= resumed["start_step"] <= global_step < end_step
            return started and resumed["end_step"] == end_step
        return self._restored.get("end_epoch") == self.end_epoch and 0 <= resumed["start_step"]

    def end_step(self, resumed: dict[str, int] | None, continuing: bool, end_step: int) -> int:
        """The run's end step: a continued `run_to_epoch`'s as the interrupted run had it."""
        if continuing and self.end_epoch is not None and resumed is not None:
            return resumed["end_step"]
        return end_step

    def left(self, epochs: int) -> bool:
        """Whether `run_to_epoch(ds, epochs)` has epochs to run; warns when past them."""
        if epochs < self.done:
            _warnings.warn(
                f"run_to_epoch({epochs}): {self.done} epochs are already done, past the "
                "target; nothing to run"
            )
        return epochs > self.done

    def first_start(self, loop_step: int) -> None:
        """The run's first epoch began at a restored checkpoint's epoch start, or here."""
        restored = self._restored.pop("epoch_start_step", None)
        self.start_step = loop_step if restored is None else min(int(restored), loop_step)

    def finish(self, loop_step: int, epochs_after: int) -> int:
        """Counts the epoch that ended at `loop_step`; the run's end step, extrapolated.

        Counted before the OnEpochEnd hooks run, so that a save there holds it. The end is
        extrapolated from this epoch's steps, from its start even when the run began inside
        it (a resume), over `epochs_after` more epochs.
        """
        end = loop_step + (loop_step - (self.start_step or 0)) * epochs_after
        self.done += 1
        self.start_step = loop_step  # where the next epoch begins
        return end

    def end_run(self) -> None:
        """The run is over: no target, no current epoch."""
        self.end_epoch = self.start_step = None
