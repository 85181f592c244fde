"""The checkpoint hook: Orbax-backed, asynchronous, atomic, verified saves that resume exactly.

One Orbax `CheckpointManager` directory (its layout: `_format`; step = `trainer.global_step`).
The state is saved in its plain form (the names of `Trainer.state_dict()`), so it reads back
into host arrays without knowing the model, onto any device count and process count. A
checkpoint is restored only if its arrays match the fingerprints written with them and are
all finite; otherwise it is moved aside with a warning and the next newest is tried. No
pickle is used anywhere.

With several processes (`jax.distributed`) every process attaches the hook and saves its own
shards; they agree through the coordination service (barriers with `barrier_timeout`), never
through a device collective off the training thread, and a process that stops answering
makes the others raise a `CoordinationError` naming it.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from ... import _validate, _warnings
from ...loop import Loop
from ...loop._internal import note_checkpoint_directory
from ...trainer import Trainer
from ._active import take_over
from ._checks import best_metric_value
from ._checks import check_best_metric as _check_best_metric
from ._commit import commit
from ._coordination import DEFAULT_TIMEOUT_SECONDS, Coordination, CoordinationError
from ._format import check_directory as _check_directory
from ._format import incomplete_saves as _incomplete_saves
from ._format import make_bundle, named_train_metrics, positions_for
from ._io import (
    abandon_after,
    open_manager,
    read_agreed,
    read_metric_values,
    read_newest_good,
    set_aside_entries,
)
from ._positions import apply_positions, dataset_states
from ._signal_guard import guard
from ._snapshot import Snapshot, take
from ._writer import BackgroundSaveError, BackgroundWriter

_logger = logging.getLogger(__name__)

CHECKPOINTERS = "checkpointers"  # `loop.shared_data` key: the Checkpointers attached to it
# Numbers the Checkpointers of this process; every process attaches the same hooks in the
# same order, so the number names one Checkpointer's exchanges on every process.
_INSTANCES = itertools.count()


class NoGoodCheckpointError(RuntimeError):
    """Every checkpoint in the directory is damaged: loopax will not silently start over."""


class Checkpointer:
    """Saves and restores a `Loop`'s whole training state with Orbax; see `checkpoint`.

    `checkpoint` attaches one: it registers `on_start`, `save_on_trigger` (on each save
    schedule), `on_end` and `on_error` on the loop, which a custom setup may register itself
    the same way.

    Attributes:
      directory: the absolute checkpoint directory.
      restored_step: the step restored when attached (or by `restore`), or None.
      coordination: the exchanges between processes (barriers, dataset positions), each
        waiting at most `barrier_timeout` seconds.
    """

    trainer: Trainer
    keep: int | None
    keep_best: int
    keep_period: int | None
    directory: Path

    def __init__(
        self,
        loop: Loop,
        directory: str | os.PathLike[str],
        *,
        keep: int | None = 3,
        best_metric: str | None = None,
        best_mode: str = "min",
        keep_best: int = 1,
        keep_period: int | None = None,
        async_save: bool = True,
        barrier_timeout: float = DEFAULT_TIMEOUT_SECONDS,
    ):
        import orbax.checkpoint as ocp  # noqa: PLC0415  (heavy: imported only when used)

        self._ocp = ocp
        self.loop = loop
        self.trainer = loop.trainer
        self.keep = _validate.optional_positive_int("keep", keep)
        self.keep_best = _validate.positive_int("keep_best", keep_best)
        self.keep_period = _validate.optional_positive_int("keep_period", keep_period)
        _check_best_metric(best_metric, best_mode, loop)
        self.best_metric = best_metric
        self.best_mode = best_mode
        self.directory = Path(_validate.path("directory", directory, "checkpoint: ")).absolute()
        _check_directory(self.directory)
        note_checkpoint_directory(loop, self.directory)  # named if a process is lost
        leftovers = _incomplete_saves(self.directory)
        self.restored_step: int | None = None
        self._pending_datasets: dict | None = None  # dataset positions for the next OnStart
        self._pending_save: tuple | None = None
        self._dataset: Any = None
        digest = hashlib.sha1(str(self.directory).encode()).hexdigest()[:12]
        namespace = f"checkpoint-{digest}-{next(_INSTANCES)}"
        self.coordination = Coordination(namespace, barrier_timeout)
        self._exchanges = itertools.count()  # names the training thread's exchanges
        self._saves = itertools.count()  # names the writer thread's
        if not self.coordination.single:  # Orbax creates no directory on several processes
            self.directory.mkdir(parents=True, exist_ok=True)
        self._last_saved_step: int | None = None
        self._best_values: dict[int, float] | None = None  # step -> best_metric, read lazily
        self._writer = BackgroundWriter(
            str(self.directory), in_background=async_save, on_failure=loop.report_error
        )
        if take_over(self.directory, self):
            leftovers = _incomplete_saves(self.directory)  # the previous one's saves are done
        if leftovers and jax.process_index() == 0:
            _warnings.warn(
                f"{str(self.directory)!r} holds {len(leftovers)} incomplete save(s) {leftovers}: "
                "cut off before their commit (a crash or a second interrupt), they never "
                "became checkpoints and are removed; the newest complete checkpoint is used"
            )

        self._manager = open_manager(
            ocp,
            self.directory,
            keep=self.keep,
            best_metric=best_metric,
            best_mode=best_mode,
            keep_best=self.keep_best,
            keep_period=self.keep_period,
            barrier_prefix=namespace,
            # Orbax removes leftovers in a thread of its own, which a program ending at once
            # would cut off with a traceback at exit: only when there are some.
            cleanup=bool(leftovers),
        )
        guard(self)  # the interpreter's exit, and a signal, wait for the saves in flight
        # Other hooks (nan_guard's rollback) find the loop's checkpointers here.
        checkpointers = loop.shared_data.setdefault(CHECKPOINTERS, [])
        if not checkpointers and self.trainer.host_metric_states:
            # Saved with the loop's state, so a resumed run goes on with its medians.
            loop.add_state("trainer: host metrics", self.trainer.host_metric_states)
        checkpointers.append(self)

    # -- queries ------------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """The steps of the checkpoints on disk, ascending, once the saves in flight are done.

        Raises:
          BackgroundSaveError: a save in flight failed (as `wait`).
        """
        self.wait()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest checkpoint's step, or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        """The step of the best checkpoint on disk by `best_metric`, or None.

        None when there is no `best_metric`, or no checkpoint holds its value.

        Raises:
          ValueError: the hook was attached without `best_metric`.
        """
        if self.best_metric is None:
            raise ValueError(
                "best_step() needs the hook attached with best_metric=... (e.g. "
                "'eval/test/mean_loss')"
            )
        self.wait()
        values = self._read_best_values(self.best_metric)
        if not values:
            return None
        pick = min if self.best_mode == "min" else max
        return pick(sorted(values), key=lambda step: values[step])

    def _read_best_values(self, best_metric: str) -> dict[int, float]:
        if self._best_values is None:
            self._best_values = read_metric_values(self._manager, self._ocp, best_metric)
        on_disk = set(self.all_steps())
        return {step: v for step, v in self._best_values.items() if step in on_disk}

    def wait(self) -> None:
        """Blocks until every asynchronous save is written and committed.

        Raises:
          BackgroundSaveError: a background save failed (the original error is chained).
        """
        self._writer.wait()
        self._manager.wait_until_finished()

    def saving(self) -> bool:
        """Whether a save is in flight (taken, not yet committed or failed)."""
        return self._writer.busy()

    def settle(self) -> None:
        """Waits for the saves in flight, raising nothing (a failure raises at `wait`)."""
        self._writer.settle()

    def wait_quietly(self) -> None:
        """`wait`, logging a failed save instead of raising it (it was reported already)."""
        try:
            self.wait()
        except BackgroundSaveError as err:
            _logger.warning("%s", err)

    def close(self) -> None:
        """Waits for in-flight saves and releases Orbax's resources."""
        self.wait()
        self._writer.close()
        self._manager.close()

    # -- saving -------------------------------------------------------------------------------

    def save(self, metrics: dict[str, Any] | None = None) -> int | None:
        """Saves the current state at `trainer.global_step`, asynchronously.

        The arrays are copied off the device now (with several processes: copied on their
        devices, and their fingerprints started there); once the hooks of the current step
        have run (at once outside a run) the logs are flushed and a background thread
        verifies the arrays (all finite), fingerprints them, gathers every process's
        dataset position and commits the checkpoint; `wait()` blocks until then. A step
        already saved is not saved again. With several processes every process must save
        the same steps.

        Args:
          metrics: unused (the best metric is read from `loop.history`); kept so the
            method can be a hook.

        Returns:
          The saved step, or None when it was already saved.

        Raises:
          RuntimeError: the trainer has no state yet (before its first batch).
          NonFiniteLossError: a loss so far is NaN or infinite.
          FileNotFoundError: the directory was deleted after a save.
        """
        del metrics
        if self.trainer.state is None:
            raise RuntimeError(
                "nothing to checkpoint before the trainer's first step: the variables are "
                "created from the first batch"
            )
        # First: the check may hand skipped steps to a nan_guard, which may roll back.
        self.loop.check_finite()
        step = self.trainer.global_step
        if self._last_saved_step is not None and not self.directory.exists():
            raise FileNotFoundError(  # never re-created quietly, holding only later steps
                f"the checkpoint directory {str(self.directory)!r} was deleted or moved "
                f"while training (checkpoints up to step {self._last_saved_step} were there)"
            )
        if step == self._last_saved_step or step in self._manager.all_steps():
            return None
        snapshot = take(self.trainer)
        self._pending_save = (step, snapshot, dataset_states(self._dataset))
        self._last_saved_step = step
        self.loop.call_after_hooks(self._commit)
        return step

    def _commit(self) -> None:
        """After the step's hooks: the logs of the step go to disk before the checkpoint."""
        pending, self._pending_save = self._pending_save, None
        if pending is None:
            return
        step, snapshot, datasets = pending
        flushed = self.loop.flush()
        best_value = best_metric_value(self.loop, self.best_metric, step)
        bundle = make_bundle(
            step,
            num_devices=self.trainer.num_devices,
            loop_state=self.loop.get_state(),
            datasets=[datasets],
            best_metric=None if best_value is None else {self.best_metric: best_value},
        )
        save = next(self._saves)
        self._writer.submit(self._write, step, snapshot, bundle, best_value, save, flushed)

    def _write(
        self,
        step: int,
        snapshot: Snapshot,
        bundle: dict,
        best_value: float | None,
        save: int,
        flushed: Callable[[], None],
    ) -> None:
        """The background thread: waits for the logs, verifies, fingerprints and commits."""
        metric = self.best_metric
        best = None if best_value is None or metric is None else {metric: best_value}
        commit(self._manager, self._ocp, self.coordination, save, step, snapshot, bundle, best,
               flushed)  # fmt: skip
        if self._best_values is not None and best_value is not None:
            self._best_values[step] = best_value
        self.loop.checkpointed_step = step

    # -- restoring ----------------------------------------------------------------------------

    def restore(self, step: int | None = None) -> int | None:
        """Restores checkpoint `step` (default the newest good one) into the trainer.

        The trainer's state (`params`, `state`, `global_step`) is set at once, even before
        its first batch, and the loop continues from the step (`loop.resume_from`: its
        history and hook states come back; inside a run, the run goes on from there). The
        dataset position is applied at the start of the next run. With `step=None`, a
        damaged checkpoint (unreadable, not matching its fingerprints, or holding NaN or
        infinite values) is moved to `<directory>/damaged/` with a warning naming it and
        why, and the next newest is tried.

        Returns:
          The restored step, or None when there is no checkpoint.

        Raises:
          NoGoodCheckpointError: checkpoints exist (or were set aside) but none is good.
          ValueError: `step` is not on disk, or its arrays do not fit the model, or it was
            saved by another number of processes whose data positions differ (both counts
            named; raised on every process).
          DamagedCheckpointError: checkpoint `step` (given) is damaged (on any process).
          CoordinationError: another process did not answer within `barrier_timeout`.
        """
        self.wait()
        if step is None:
            found = read_newest_good(
                self._manager,
                self._ocp,
                self.directory,
                coordination=self.coordination,
                key=f"restore{next(self._exchanges)}",
            )
            if found is None:
                damaged = set_aside_entries(self.directory)
                if damaged:
                    raise NoGoodCheckpointError(
                        f"no good checkpoint in {str(self.directory)!r}: the damaged ones were "
                        f"moved to {str(self.directory / 'damaged')!r} ({', '.join(damaged)}). "
                        "Training will not start over silently: to start fresh, attach with "
                        "restore='never' or use a new directory (or delete the damaged ones)"
                    )
                return None
            step, state, bundle = found
        else:
            if step not in self._manager.all_steps():
                raise ValueError(
                    f"no checkpoint of step {step} in {str(self.directory)!r}; "
                    f"there are {self.all_steps()}"
                )
            state, bundle = read_agreed(
                self._manager,
                self._ocp,
                step,
                self.coordination,
                f"restore{next(self._exchanges)}",
            )
        where = f"checkpoint {str(self.directory / str(step))!r}"
        coordination = self.coordination
        # Checked on every process alike, before anything changes: a count that does not map
        # raises everywhere.
        positions = positions_for(
            bundle, coordination.process_index, coordination.process_count, where
        )
        state = named_train_metrics(state, bundle["version"], self.trainer.train_metric_state_names)
        self.trainer.load_state_dict(state, where=where)
        # loopax 0.1 kept only the trigger states, under "triggers".
        loop_state = bundle.get("loop", {"hooks": bundle.get("triggers", {})})
        if not self.loop.running:
            self._pending_datasets = positions
        self._last_saved_step = step
        self.restored_step = step
        self.loop.checkpointed_step = step
        self.loop.resume_from(step, loop_state)
        _logger.info("restored checkpoint %s (step %d)", self.directory / str(step), step)
        if self.loop.running:  # a rollback: training goes on from `step` at once
            self._abandon_after(step)
        return step

    def read(self, step: int) -> dict:
        """Checkpoint `step`'s train state in plain form (as `state_dict()`), changing nothing.

        Verified as a restore is, and agreed on every process. Raises as `restore(step)`.
        """
        self.wait()
        state, bundle = read_agreed(
            self._manager, self._ocp, step, self.coordination, f"read{next(self._exchanges)}"
        )
        return named_train_metrics(state, bundle["version"], self.trainer.train_metric_state_names)

    def restore_best(self) -> int | None:
        """Restores the best checkpoint by `best_metric` (see `best_step`).

        Like `restore(best_step())`; returns its step, or None when none holds the metric.

        Raises:
          ValueError: the hook was attached without `best_metric`.
        """
        step = self.best_step()
        return None if step is None else self.restore(step)

    # -- hooks: what `checkpoint` registers on the loop ------------------------------------------

    def on_start(self, loop: Loop, dataset: Any) -> None:
        """OnStart: restores the dataset position of the restored checkpoint, if any.

        Registered at `Priority.VALIDATE`, before the other OnStart hooks, so that they see
        the restored position. Warns (and leaves the dataset where it is) when the
        checkpoint holds the position of another dataset or the dataset has no `set_state`.
        With several processes each takes its own position, and if any process's dataset
        refuses its position, every process raises.
        """
        self._dataset = dataset
        self._abandon_after(loop.trainer.global_step)
        saved, self._pending_datasets = self._pending_datasets, None
        if saved is None:
            return
        apply_positions(
            dataset,
            saved,
            self.restored_step,
            self.coordination,
            f"positions{next(self._exchanges)}",
        )

    def _abandon_after(self, step: int) -> None:
        """Training goes on from `step`: the newer checkpoints are moved aside (`_io`)."""
        key = f"abandon{next(self._exchanges)}"
        if abandon_after(self._manager, self.directory, self.coordination, step, key):
            self._best_values = None  # read again from the checkpoints left

    def save_on_trigger(self, loop: Loop, metrics: Any) -> None:
        """OnStep (or OnEpochEnd) at the steps of a save schedule: `save()`.

        Registered with `check_finite=False`: `save` checks the losses itself, first (a
        `nan_guard` may roll back there).
        """
        self.save()

    def on_end(self, loop: Loop, metrics: Any) -> None:
        """OnEnd: saves the last step; the run returns while the save finishes in the background.

        The arrays are copied off the device here, and the commit starts once every OnEnd
        hook wrote its last points, so the run returns with the state safe in memory and its
        save under way; the next save, a restore, `wait()`, a new hook on the directory,
        `loopax.load_params` and the interpreter's exit wait for it, and a failure raises at
        the next step or run. A run stopped early (`request_stop`: a signal, a time limit,
        early stopping) waits for the save, since the program usually ends there (and the
        line an interrupted run ends with names the saved step); so does a run on several
        processes, whose save every process must reach before they part (one that died is
        named at once).
        """
        if self.trainer.state is not None:
            self.save()
        if loop.stop_reason is not None or not self.coordination.single:
            loop.call_after_hooks(self.wait)  # after the commit, which the save deferred

    def on_error(self, loop: Loop, error: BaseException) -> None:
        """OnError: commits a save the failing step took, then waits for the saves in flight.

        A save is taken once its step's state is complete and every loss so far was checked
        finite, so a later hook of that step raising does not lose it (nor does an OnEnd
        hook raising lose the end-of-run save): it commits as it would have, after the logs
        of its step, unless the run is being torn down (KeyboardInterrupt, SystemExit) or
        another process stopped answering. A commit that fails here is logged; the run's
        error is the one raised.
        """
        pending = self._pending_save
        if pending is not None and isinstance(error, Exception):
            if isinstance(error, CoordinationError):
                self._pending_save = None  # the other processes would never join its commit
            else:
                try:
                    self._commit()
                except Exception as failure:  # noqa: BLE001 - the run's error is the one raised
                    self._pending_save = None
                    _logger.warning(
                        "the save of checkpoint %d, taken before the error, could not be "
                        "committed: %s: %s",
                        pending[0],
                        type(failure).__name__,
                        failure,
                    )
        self._pending_save = None
        self.wait_quietly()

    def __repr__(self) -> str:
        # The steps on disk now: a repr never waits (nor raises a save's failure).
        return f"Checkpointer({str(self.directory)!r}, steps={sorted(self._manager.all_steps())})"
