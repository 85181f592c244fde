"""The checkpoint hook: Orbax-backed, asynchronous, atomic saves that resume exactly.

On-disk layout (one Orbax `CheckpointManager` directory; step = `trainer.global_step`)::

    <directory>/<step>/state/    the TrainState as a plain tree of arrays (Orbax StandardSave)
    <directory>/<step>/loopax/   JSON: format marker, steps, trigger and dataset states, metrics
    <directory>/damaged/<step>/  checkpoints that could not be read, moved aside (never deleted)

The state is saved as a plain tree (see `_checkpoint_format`), so it reads back into host
arrays without knowing the model, onto any device count, and an unreadable checkpoint is found
when the hook is attached, before the run starts. No pickle is used anywhere.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from ..trainer._hooks import Priority
from ..trainer._state import TrainState
from ._checkpoint_format import BUNDLE_ITEM as _BUNDLE_ITEM
from ._checkpoint_format import DAMAGED_DIR as _DAMAGED_DIR
from ._checkpoint_format import FORMAT as _FORMAT
from ._checkpoint_format import STATE_ITEM as _STATE_ITEM
from ._checkpoint_format import VERSION as _VERSION
from ._checkpoint_format import check_directory as _check_directory
from ._checkpoint_format import from_plain as _from_plain
from ._checkpoint_format import to_plain as _to_plain
from ._checkpoint_checks import check_best_metric as _check_best_metric
from ._checkpoint_checks import check_count as _check_count
from ._checkpoint_writer import BackgroundWriter, wait_at_exit
from ._triggers import every_n_steps as _every_n_steps
from ._triggers import periodic_callback as _periodic_callback


_logger = logging.getLogger(__name__)


# -- the hook -------------------------------------------------------------------------------


class Checkpointer:
    """Saves and restores a `Loop`'s whole training state with Orbax; see `checkpoint`.

    Attributes:
      directory: the absolute checkpoint directory.
      restored_step: the step restored when attached (or by `restore`), or None.
    """

    def __init__(
        self,
        loop: Any,
        directory: str | os.PathLike,
        *,
        keep: int | None = 3,
        best_metric: str | None = None,
        best_mode: str = "min",
        keep_best: int = 1,
        keep_period: int | None = None,
        async_save: bool = True,
    ):
        import orbax.checkpoint as ocp  # noqa: PLC0415  (heavy: imported only when used)
        from orbax.checkpoint import checkpoint_managers as policies  # noqa: PLC0415

        self._ocp = ocp
        self.loop = loop
        self.trainer = loop.trainer
        self.keep = _check_count("keep", keep, allow_none=True)
        self.keep_best = _check_count("keep_best", keep_best, allow_none=False)
        self.keep_period = _check_count("keep_period", keep_period, allow_none=True)
        _check_best_metric(best_metric, best_mode, self.trainer)
        self.best_metric = best_metric
        self.best_mode = best_mode
        self.directory = Path(directory).expanduser().absolute()
        _check_directory(self.directory)
        self.restored_step: int | None = None
        self._pending_bundle: dict | None = None  # non-array state, applied at the next OnStart
        self._pending_state: dict | None = None  # arrays waiting for the trainer's first batch
        self._pending_where = ""
        self._dataset: Any = None
        self._last_saved_step: int | None = None
        self._writer = BackgroundWriter(str(self.directory), in_background=async_save)

        preserve = [policies.LatestN(self.keep)]
        if best_metric is not None:
            preserve.append(policies.BestN(
                get_metric_fn=lambda metrics: metrics[self.best_metric],
                reverse=best_mode == "min",  # BestN keeps the largest after sorting
                n=self.keep_best,
                keep_checkpoints_without_metrics=False,
            ))
        if self.keep_period is not None:
            preserve.append(policies.EveryNSteps(interval_steps=self.keep_period))
        options = ocp.CheckpointManagerOptions(
            preservation_policy=policies.AnyPreservationPolicy(preserve),
            # Our writer thread makes the whole save, so Orbax itself saves synchronously.
            enable_async_checkpointing=False,
            # Leftovers of saves cut off by a crash: never committed, so never checkpoints.
            cleanup_tmp_directories=True,
            create=True,
        )
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                _STATE_ITEM: ocp.StandardCheckpointHandler(),
                _BUNDLE_ITEM: ocp.JsonCheckpointHandler(),
            },
        )
        wait_at_exit(self.wait)

    # -- queries ------------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """The steps of the checkpoints on disk, ascending (in-flight saves included)."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest checkpoint's step, or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def wait(self) -> None:
        """Blocks until every asynchronous save is written and committed.

        Raises:
          RuntimeError: a background save failed (the original error is chained).
        """
        self._writer.wait()
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for in-flight saves and releases Orbax's resources."""
        self.wait()
        self._writer.close()
        self._manager.close()

    # -- saving -------------------------------------------------------------------------------

    def _best_value(self, metrics: dict | None) -> float | None:
        if self.best_metric is None:
            return None
        kind, *names = self.best_metric.split("/")
        if kind == "train":
            value = (metrics or {}).get(names[0])
        else:
            shared = self.loop.shared_data
            evaluated_at = shared.get("eval_step", self.trainer.global_step)
            # An evaluation of other parameters says nothing about this checkpoint's.
            stale = evaluated_at != self.trainer.global_step
            value = None if stale else shared.get("eval", {}).get(names[0], {}).get(names[1])
        if value is None:
            return None
        value = float(np.asarray(jax.device_get(value)))
        return value if math.isfinite(value) else None

    def _trigger_states(self) -> dict[str, Any]:
        states: dict[str, Any] = {}
        for trigger in self.loop._triggers:
            name, count = trigger.name, 2
            while name in states:
                name, count = f"{trigger.name}#{count}", count + 1
            states[name] = trigger.get_state()
        return states

    def _bundle(self, step: int, best_value: float | None) -> dict:
        datasets = {}
        dataset = self._dataset
        if dataset is not None and callable(getattr(dataset, "get_state", None)):
            name = getattr(dataset, "name", "dataset")
            datasets[name] = dataset.get_state()
        bundle = {
            "format": _FORMAT,
            "version": _VERSION,
            "global_step": step,
            "loop_step": step,
            "num_devices": self.trainer.num_devices,
            "triggers": self._trigger_states(),
            "datasets": datasets,
            "best_metric": None if best_value is None else {self.best_metric: best_value},
            "saved_at": time.time(),
        }
        try:
            json.dumps(bundle)
        except (TypeError, ValueError) as err:
            raise TypeError(
                f"the checkpoint of step {step} must be JSON: a dataset's get_state() or a "
                f"trigger's get_state() returned something else ({err}); return ints, floats, "
                "strings, lists and dicts"
            ) from err
        return bundle

    def save(self, metrics: dict | None = None) -> int | None:
        """Saves the current state at `trainer.global_step`, asynchronously.

        Returns at once after the arrays are copied off the device; `wait()` blocks until
        the checkpoint is committed. A step already saved is not saved again.

        Args:
          metrics: the train metrics to read a `"train/..."` best metric from; default the
            loop's latest.

        Returns:
          The saved step, or None when it was already saved.

        Raises:
          RuntimeError: the trainer has no state yet (before its first batch).
          NonFiniteLossError: the current loss is NaN or infinite.
        """
        state = self.trainer.state
        if state is None:
            raise RuntimeError(
                "nothing to checkpoint before the trainer's first step: the variables are "
                "created from the first batch"
            )
        step = self.trainer.global_step
        if step == self._last_saved_step or step in self._manager.all_steps():
            return None
        self.loop._check_finite()
        best_value = self._best_value(self.loop._metrics if metrics is None else metrics)
        # A real host copy: the next train step donates (reuses) the device buffers, and on
        # CPU `device_get` may return a view of them rather than a copy.
        host_state = jax.tree.map(np.array, _to_plain(state))
        bundle = self._bundle(step, best_value)
        self._writer.submit(self._write, step, host_state, bundle, best_value)
        self._last_saved_step = step
        return step

    def _write(self, step: int, host_state: dict, bundle: dict, best_value: float | None) -> None:
        ocp = self._ocp
        self._manager.save(
            step,
            args=ocp.args.Composite(**{
                _STATE_ITEM: ocp.args.StandardSave(host_state),
                _BUNDLE_ITEM: ocp.args.JsonSave(bundle),
            }),
            metrics=None if best_value is None else {self.best_metric: best_value},
            force=True,
        )
        self._manager.wait_until_finished()

    # -- restoring ----------------------------------------------------------------------------

    def _read(self, step: int) -> tuple[dict, dict]:
        """Reads checkpoint `step` into host arrays; raises if anything is missing or damaged."""
        ocp = self._ocp
        bundle = self._manager.restore(
            step, args=ocp.args.Composite(**{_BUNDLE_ITEM: ocp.args.JsonRestore()})
        )[_BUNDLE_ITEM]
        if not isinstance(bundle, dict) or bundle.get("format") != _FORMAT:
            raise ValueError(f"its {_BUNDLE_ITEM!r} item is not a loopax checkpoint description")
        if bundle.get("version") != _VERSION or bundle.get("global_step") != step:
            raise ValueError(
                f"version {bundle.get('version')} / step {bundle.get('global_step')} in its "
                f"description, expected version {_VERSION} / step {step}"
            )
        metadata = self._manager.item_metadata(step)[_STATE_ITEM]
        tree = getattr(metadata, "tree", metadata)
        if not isinstance(tree, dict) or not tree:
            raise ValueError("its state item has no arrays")
        target = jax.tree.map(lambda array: np.zeros(array.shape, array.dtype), tree)
        state = self._manager.restore(
            step, args=ocp.args.Composite(**{_STATE_ITEM: ocp.args.StandardRestore(target)})
        )[_STATE_ITEM]
        return state, bundle

    def _set_aside(self, step: int) -> Path | None:
        if jax.process_index() != 0:
            return None
        damaged = self.directory / _DAMAGED_DIR
        damaged.mkdir(exist_ok=True)
        destination, count = damaged / str(step), 2
        while destination.exists():
            destination, count = damaged / f"{step}.{count}", count + 1
        shutil.move(str(self.directory / str(step)), str(destination))
        return destination

    def _read_newest_good(self) -> tuple[int, dict, dict] | None:
        for step in sorted(self._manager.all_steps(), reverse=True):
            try:
                state, bundle = self._read(step)
            except Exception as err:  # any failure to read makes it unusable: fall back
                moved = self._set_aside(step)
                kept = f"moved to {str(moved)!r}" if moved else "left in place"
                warnings.warn(
                    f"checkpoint {str(self.directory / str(step))!r} could not be read "
                    f"({type(err).__name__}: {err}); falling back to the next newest. It was "
                    f"not deleted: it was {kept}",
                    RuntimeWarning,
                    stacklevel=3,
                )
                self._manager.reload()
                continue
            return step, state, bundle
        return None

    def restore(self, step: int | None = None) -> int | None:
        """Restores checkpoint `step` (default the newest readable one) into the trainer.

        The arrays go to the trainer now if its state exists, else when its first batch
        creates the state; `trainer.global_step` and `loop.loop_step` are set at once. The
        trigger states and the dataset position are applied at the start of the next run.
        With `step=None`, an unreadable checkpoint is moved to `<directory>/damaged/` with a
        warning naming it and why, and the next newest is tried.

        Returns:
          The restored step, or None when there is no checkpoint.

        Raises:
          ValueError: `step` is not on disk, or its arrays do not fit the model.
          Exception: whatever reading checkpoint `step` raised, when `step` is given.
        """
        self.wait()
        if step is None:
            found = self._read_newest_good()
            if found is None:
                return None
            step, state, bundle = found
        else:
            if step not in self._manager.all_steps():
                raise ValueError(
                    f"no checkpoint of step {step} in {str(self.directory)!r}; "
                    f"there are {self.all_steps()}"
                )
            state, bundle = self._read(step)
        where = f"checkpoint {str(self.directory / str(step))!r}"
        if self.trainer.state is not None:
            self.trainer.state = _from_plain(self.trainer.state, state, where)
        else:
            self._pending_state = state
            self._pending_where = where
            self.trainer._global_step = step
        self.loop.loop_step = self.loop.start_step = step
        self._pending_bundle = bundle
        self._last_saved_step = step
        self.restored_step = step
        _logger.info("restored checkpoint %s (step %d)", self.directory / str(step), step)
        return step

    # -- hooks ----------------------------------------------------------------------------------

    def _on_state_created(self, state: TrainState) -> TrainState:
        pending, self._pending_state = self._pending_state, None
        if pending is None:
            return state
        return _from_plain(state, pending, self._pending_where)

    def _on_start(self, loop: Any, dataset: Any) -> None:
        self._dataset = dataset
        bundle, self._pending_bundle = self._pending_bundle, None
        if bundle is None:
            return
        saved_triggers = bundle.get("triggers", {})
        current = self._trigger_states()  # for the same de-duplicated names
        for trigger, name in zip(loop._triggers, current):
            if name in saved_triggers:
                trigger.set_state(saved_triggers[name])
        saved_datasets = bundle.get("datasets", {})
        name = getattr(dataset, "name", "dataset")
        if name in saved_datasets and callable(getattr(dataset, "set_state", None)):
            dataset.set_state(saved_datasets[name])
        elif saved_datasets:
            warnings.warn(
                f"the checkpoint of step {bundle['global_step']} holds the position of dataset(s) "
                f"{sorted(saved_datasets)}, but this run trains on {name!r}"
                f"{'' if callable(getattr(dataset, 'set_state', None)) else ' (no set_state)'}; "
                "it starts where it is, so the batches differ from an uninterrupted run",
                RuntimeWarning,
                stacklevel=2,
            )

    def _save_on_trigger(self, loop: Any, metrics: dict) -> None:
        self.save(metrics)

    def _on_end(self, loop: Any, metrics: dict) -> None:
        if self.trainer.state is not None:
            self.save(metrics)
        self.wait()

    def __repr__(self) -> str:
        return f"Checkpointer({str(self.directory)!r}, steps={self.all_steps()})"


def checkpoint(
    loop: Any,
    directory: str | os.PathLike,
    *,
    keep: int | None = 3,
    every_n_steps: int | None = None,
    period_seconds: float | None = None,
    best_metric: str | None = None,
    best_mode: str = "min",
    keep_best: int = 1,
    keep_period: int | None = None,
    restore: bool = True,
    async_save: bool = True,
    clock: Callable[[], float] = time.monotonic,
) -> Checkpointer:
    """Checkpoints the loop's training to `directory` with Orbax and resumes from it.

    When attached, restores the newest readable checkpoint: `trainer.global_step` and
    `loop.loop_step` continue from it at once (so `loop.run_to_step(ds, target)` runs only
    what is left), the arrays go into the trainer when its first batch creates the state,
    and the trigger states and the dataset position (`get_state`/`set_state`) come back at
    the start of the next run. A resumed run then matches an uninterrupted one bit for bit.

    Saves run in the background (training continues once the arrays are off the device) and
    are atomic: a save cut off by a crash is never taken for a checkpoint. The hook saves on
    its triggers and at the end of every run, waits for in-flight saves at the end of each
    run and at interpreter exit, and keeps the newest `keep` checkpoints plus the
    `keep_best` best by `best_metric` plus every step that is a multiple of `keep_period`.

    Args:
      loop: the `loopax.Loop`.
      directory: where the checkpoints go; created if missing. It must hold nothing but
        loopax checkpoints.
      keep: how many of the newest checkpoints to keep; None keeps all.
      every_n_steps: also save after step k when `(k + 1) % every_n_steps == 0`, i.e. at
        global steps that are multiples of it.
      period_seconds: also save when this many seconds passed since the last periodic save.
      best_metric: keep the best checkpoints by this metric: `"train/<metric>"` (a train
        metric of the saving step, e.g. `"train/loss"`) or `"eval/<dataset>/<metric>"`, read
        from `loop.shared_data["eval"][<dataset>][<metric>]` (the floats `hooks.evaluate`
        leaves there, e.g. `"eval/test/mean_loss"`; ignored when `shared_data["eval_step"]`
        says they were computed at another step). A save without the value counts only for
        `keep` and `keep_period`. Evaluate at the steps you save, with a higher-priority
        hook (`Priority.EVALUATE` runs before `Priority.CHECKPOINT`).
      best_mode: `"min"` or `"max"`: whether lower or higher `best_metric` is better.
      keep_best: how many of the best checkpoints to keep.
      keep_period: keep every checkpoint whose step is a multiple of this, forever.
      restore: restore the newest checkpoint now.
      async_save: save in the background (False blocks the loop until each save is written).
      clock: the clock of `period_seconds`, in seconds.

    Returns:
      The `Checkpointer`, for `save()`, `restore(step)`, `latest_step()`, `all_steps()` and
      `wait()`.

    Raises:
      ValueError: a bad count, `best_mode` or `best_metric`, or a directory holding
        something that is not a loopax checkpoint.

    Example:
      >>> import tempfile, numpy as np, optax, flax.linen as nn, loopax
      >>> trainer = loopax.Trainer(lambda ctx, spec, x: nn.Dense(1)(x[0]),
      ...     loopax.losses.mean_squared_error, optax.sgd(0.1), devices=jax.devices()[:1])
      >>> data = loopax.ArrayDataset(np.ones((8, 2), np.float32), np.ones((8, 1), np.float32),
      ...     batch_size=4, loop_forever=True)
      >>> directory = tempfile.mkdtemp()
      >>> checkpointer = checkpoint(loopax.Loop(trainer), directory, every_n_steps=2)
      >>> _ = checkpointer.loop.run_to_step(data, 5)
      >>> checkpointer.all_steps()
      [2, 4, 5]
      >>> trainer = loopax.Trainer(lambda ctx, spec, x: nn.Dense(1)(x[0]),
      ...     loopax.losses.mean_squared_error, optax.sgd(0.1), devices=jax.devices()[:1])
      >>> loop = loopax.Loop(trainer)
      >>> checkpointer = checkpoint(loop, directory)
      >>> trainer.global_step, loop.loop_step
      (5, 5)
    """
    checkpointer = Checkpointer(
        loop, directory, keep=keep, best_metric=best_metric, best_mode=best_mode,
        keep_best=keep_best, keep_period=keep_period, async_save=async_save,
    )
    if every_n_steps is not None:
        _every_n_steps(loop, every_n_steps, "checkpoint", checkpointer._save_on_trigger,
                       priority=Priority.CHECKPOINT)
    if period_seconds is not None:
        _periodic_callback(loop, period_seconds, "checkpoint", checkpointer._save_on_trigger,
                           priority=Priority.CHECKPOINT, clock=clock)
    # Before the other start hooks, so that they see the restored dataset position.
    loop.on_start("checkpoint: restore position", checkpointer._on_start, Priority.VALIDATE)
    loop.on_end("checkpoint", checkpointer._on_end, Priority.CHECKPOINT)
    trainer = loop.trainer
    if restore:
        checkpointer.restore()
    trainer.add_state_initializer(checkpointer._on_state_created)
    return checkpointer
