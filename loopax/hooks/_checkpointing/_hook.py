"""`hooks.checkpoint`: attaches a `Checkpointer` to a loop, on the schedules asked for."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import jax  # noqa: F401  (the doctest's namespace)

from ...loop import Loop, Priority
from .._schedules import EveryNEpochs, EveryNSteps, Periodic
from .._triggers import on_schedule
from ._agreed import AgreedSchedule
from ._checkpointer import Checkpointer
from ._coordination import DEFAULT_TIMEOUT_SECONDS


def checkpoint(
    loop: Loop,
    directory: str | os.PathLike[str],
    *,
    keep: int | None = 3,
    every_n_steps: int | None = None,
    period_seconds: float | None = None,
    every_n_epochs: int | None = None,
    best_metric: str | None = None,
    best_mode: str = "min",
    keep_best: int = 1,
    keep_period: int | None = None,
    restore: bool | str = True,
    async_save: bool = True,
    clock: Callable[[], float] = time.monotonic,
    barrier_timeout: float = DEFAULT_TIMEOUT_SECONDS,
) -> Checkpointer:
    """Checkpoints the loop's training to `directory` with Orbax and resumes from it.

    When attached, restores the newest good checkpoint: the trainer's state, `global_step`
    and `loop.loop_step` continue from it at once (so `loop.run_to_step(ds, target)` runs
    only what is left), the loop's history and hook states come back, and the dataset
    position (`get_state`/`set_state`) at the start of the next run. A resumed run then
    matches an uninterrupted one bit for bit, its logs included. A damaged checkpoint
    (unreadable, not matching the checksums written with it, or holding NaN or infinite
    values) is moved to `<directory>/damaged/` with a warning and the next newest is
    restored; when none is good the hook raises instead of starting over.
    A run that goes on from an older step than the newest checkpoint (after `restore(step)`,
    `restore_best()`, or a fresh start beside checkpoints) moves the newer ones, which hold
    the trajectory it left, to `<directory>/abandoned/` at its start, with a warning: this
    run saves its own at their steps, and a resume never takes them for this run's.

    Saves run in the background (training continues once the arrays are off the device) and
    are atomic: a save cut off by a crash is never taken for a checkpoint. A save waits for
    every loss so far to be checked finite and refuses a state holding NaN or infinity; the
    logs (TensorBoard, metrics_log, plot) of its step are on disk before it commits. The hook
    saves on its triggers and at the end of every run (an interrupted run included), and
    keeps the newest `keep` checkpoints plus the `keep_best` best by `best_metric` plus every
    step that is a multiple of `keep_period`. A run returns once its end-of-run save is
    copied off the device; the next save, a restore, `all_steps()`, `wait()`, a new hook on
    the directory, `loopax.load_params` and the interpreter's exit wait for its commit (a
    run stopped early, or on several processes, waits itself), and so does SIGINT or
    SIGTERM arriving meanwhile, which then exits as during a run (`interrupted at step K;
    saved checkpoint K`, status 130 or 143). A run that raises waits for
    the saves in flight, and commits a save its failing step had taken. A failed background
    save (a read-only directory, a full disk) raises at the next step or run. The loop's
    host metrics (`metrics.median_loss`) are saved with the loop's state.

    Several processes (after `jax.distributed.initialize`): attach the hook in every process,
    with the same arguments. Each process saves its own shards of the state in the
    background; the processes agree through JAX's coordination service (never a device
    collective off the training thread), and a process that stops answering makes the others
    raise within `barrier_timeout`, naming it. Each process's dataset position is kept and
    restored to it; process 0's clock decides the `period_seconds` saves for all. A
    checkpoint restores onto any number of processes and devices; positions that differ
    between processes restore only onto the same process count.

    Args:
      loop: the `loopax.Loop`.
      directory: where the checkpoints go; created if missing. It must hold nothing but
        loopax checkpoints.
      keep: how many of the newest checkpoints to keep; None keeps all.
      every_n_steps: also save after step k when `(k + 1) % every_n_steps == 0`, i.e. at
        global steps that are multiples of it.
      period_seconds: also save when this many seconds passed since the last periodic save.
      every_n_epochs: also save at the end of every n-th epoch of `run_epochs`.
      best_metric: keep the best checkpoints by this metric, a key of `loop.history`:
        `"train/<metric>"` (e.g. `"train/loss"`, the saving step's) or
        `"eval/<dataset>/<metric>"` (e.g. `"eval/test/mean_loss"`: the evaluation of the
        saving step, from `hooks.evaluate`). A save without the value counts only for
        `keep` and `keep_period`.
      best_mode: `"min"` or `"max"`: whether lower or higher `best_metric` is better.
      keep_best: how many of the best checkpoints to keep; of equal values the earliest
        steps (the first to reach a value is its best step, as for early stopping).
      keep_period: keep every checkpoint whose step is a multiple of this, forever.
      restore: True or `"latest"` restores the newest good checkpoint now; False or
        `"never"` does not (and starts fresh even beside damaged checkpoints).
      async_save: save in the background (False blocks the loop until each save is written).
      clock: the clock of `period_seconds`, in seconds (read on process 0 only when there
        are several processes).
      barrier_timeout: with several processes, how many seconds a process waits for the
        others at each agreement of a save or a restore before raising `CoordinationError`.

    Returns:
      The `Checkpointer`, for `save()`, `restore(step)`, `restore_best()`, `best_step()`,
      `latest_step()`, `all_steps()` and `wait()`.

    Raises:
      ValueError: a bad count, `best_mode`, `best_metric`, `restore` or `barrier_timeout`,
        a directory holding something that is not a loopax checkpoint, or a checkpoint whose
        per-process data positions do not map to this run's process count.
      NoGoodCheckpointError: every checkpoint in the directory is damaged.

    Example:
      >>> import tempfile, numpy as np, optax, flax.linen as nn, loopax
      >>> def new_loop():  # a fresh trainer, as a new process would build it
      ...     return loopax.Loop(loopax.Trainer(lambda ctx, spec, x: nn.Dense(1)(x[0]),
      ...         loopax.losses.mean_squared_error, optax.sgd(0.1), devices=jax.devices()[:1]))
      >>> data = loopax.ArrayDataset(np.ones((8, 2), np.float32), np.ones((8, 1), np.float32),
      ...     batch_size=4, loop_forever=True)
      >>> directory = tempfile.mkdtemp()
      >>> checkpointer = checkpoint(new_loop(), directory, every_n_steps=2)
      >>> _ = checkpointer.loop.run_to_step(data, 5)
      >>> checkpointer.all_steps()
      [2, 4, 5]
      >>> loop = checkpoint(new_loop(), directory).loop
      >>> loop.trainer.global_step, loop.loop_step, loop.trainer.params is not None
      (5, 5, True)
    """
    if restore not in (True, False, "latest", "never"):
        raise ValueError(f"restore must be True, False, 'latest' or 'never', got {restore!r}")
    schedules = [
        schedule
        for schedule in (
            None if every_n_steps is None else EveryNSteps(every_n_steps),
            None if period_seconds is None else Periodic(period_seconds, clock),
            None if every_n_epochs is None else EveryNEpochs(every_n_epochs),
        )
        if schedule is not None
    ]
    checkpointer = Checkpointer(
        loop,
        directory,
        keep=keep,
        best_metric=best_metric,
        best_mode=best_mode,
        keep_best=keep_best,
        keep_period=keep_period,
        async_save=async_save,
        barrier_timeout=barrier_timeout,
    )
    if not checkpointer.coordination.single:
        schedules = [
            AgreedSchedule(schedule, checkpointer.coordination, f"schedule{index}")
            if schedule.time_based
            else schedule
            for index, schedule in enumerate(schedules)
        ]
    for schedule in schedules:
        # `save` checks the losses itself, first (a nan_guard may roll back there).
        on_schedule(
            loop,
            schedule,
            "checkpoint",
            checkpointer.save_on_trigger,
            priority=Priority.CHECKPOINT,
            check_finite=False,
        )
    # Before the other start hooks, so that they see the restored dataset position.
    loop.on_start("checkpoint: restore position", checkpointer.on_start, Priority.VALIDATE)
    loop.on_end("checkpoint", checkpointer.on_end, Priority.CHECKPOINT, check_finite=False)
    loop.on_error("checkpoint", checkpointer.on_error, Priority.CHECKPOINT)
    if restore in (True, "latest"):
        checkpointer.restore()
    return checkpointer
