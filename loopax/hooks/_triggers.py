"""Schedules and trigger helpers: run a `fn(loop, metrics)` on a `Loop` at chosen steps.

A schedule (`EveryNSteps`, `NTimes`, `Exponential`, `Periodic`, `AtSteps`, `FirstNSteps`,
`EveryNEpochs`) says *when*; `loop.on_step(name, fn, when=schedule)` attaches *what*. The
helpers (`every_n_steps`, ...) do both in one call and return the registered `Hook`.
Schedules combine with `|` (`EveryNSteps(1000) | AtSteps([10, 100])`, bobbin's CronTab
style), and their positions are checkpointed with the loop under the hook's name.

The loop asks a step schedule only at the steps it may fire (`next_step`), so a hook that
fires every 1000 steps costs nothing on the other 999.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from ..loop import Hook, Loop, Priority, Schedule
from ._schedules import (
    AtSteps,
    EveryNEpochs,
    EveryNSteps,
    Exponential,
    FirstNSteps,
    NTimes,
    Periodic,
)

StepFn = Callable[[Loop, Any], Any]


def _check_name(name: object) -> None:
    # The hook is registered as "<schedule>: name", a non-empty str whatever `name` is.
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {name!r} of type {type(name).__name__}")


# -- helpers ----------------------------------------------------------------------------------


def on_schedule(
    loop: Loop,
    when: Schedule,
    name: str,
    fn: StepFn,
    *,
    call_on_end: bool = False,
    priority: int = Priority.DEFAULT,
    check_finite: bool | None = None,
) -> Hook:
    """Calls `fn(loop, metrics)` at the steps of `when`.

    `when` is any schedule, e.g. combined with `|`; an epoch schedule such as `EveryNEpochs` calls
    it at the epoch ends it picks.

    The hook is named `"<schedule>: name"`. With `call_on_end` it also runs once in OnEnd,
    whatever the schedule, unless SIGINT or SIGTERM interrupted the run (`loop.interrupted`):
    that run is not over, its resumed run ends it. Hooks of priority >= `Priority.CHECKPOINT`
    check every loss so far is finite before they run, only on the steps they fire
    (`check_finite` overrides it, as for `loop.on_step`).

    Args:
      loop: the `loopax.Loop`.
      when: the schedule.
      name: the user's hook name.
      fn: `fn(loop, metrics)`.
      call_on_end: also call `fn` at the end of each run (not of an interrupted one).
      priority: the hook's priority (see `loopax.Priority`).
      check_finite: as for `loop.on_step`.

    Returns:
      The OnStep (or OnEpochEnd) `Hook` (its `schedule` is `when`).

    Example:
      >>> from loopax.hooks import EveryNSteps, AtSteps
      >>> import loopax, optax, jax, flax.linen as nn
      >>> loop = loopax.Loop(loopax.Trainer(lambda ctx, spec, x: nn.Dense(1)(x[0]),
      ...     loopax.losses.mean_squared_error, optax.sgd(0.1), devices=jax.devices()[:1]))
      >>> on_schedule(loop, EveryNSteps(100) | AtSteps([1, 10]), "log", print).name
      'every_n_steps(100) | at_steps(1, 10): log'
    """
    _check_name(name)
    # The registration checks `when`, `fn` and `priority`, and names what was wrong.
    register = loop.on_epoch_end if getattr(when, "at_epoch_end", False) else loop.on_step
    hook = register(f"{when!r}: {name}", fn, priority, when=when, check_finite=check_finite)
    if call_on_end:
        loop.on_end(hook.name, at_run_end(fn), priority, check_finite=check_finite)
    return hook


def at_run_end(fn: StepFn) -> StepFn:
    """`fn` as an OnEnd hook that skips a run SIGINT or SIGTERM interrupted.

    Such a run stops to be resumed: what runs at a run's end (a last log point, a last
    evaluation) runs at the end of the resumed run, so that its logs and hook states equal
    an uninterrupted run's. The checkpoint's end-of-run save is not such a hook.
    """

    def at_end(loop: Loop, metrics: Any) -> Any:
        if loop.interrupted:
            return None
        return fn(loop, metrics)

    return at_end


def every_n_steps(
    loop: Loop, n: int, name: str, fn: StepFn, *, priority: int = Priority.DEFAULT
) -> Hook:
    """Calls `fn(loop, metrics)` after step k iff `(k + 1) % n == 0`, for a positive int `n`.

    Aligned to the global step, so a resumed run fires where an uninterrupted one would. Never
    fires at the last step unless it is aligned, never in OnEnd. Registers
    `on_schedule(loop, EveryNSteps(n), name, fn, priority=priority)`, which describes the
    other arguments, and returns its OnStep `Hook` (named `"every_n_steps(n): name"`); a bad
    `n` raises ValueError.
    """
    return on_schedule(loop, EveryNSteps(n), name, fn, priority=priority)


def n_times_during_loop(
    loop: Loop, n: int, name: str, fn: StepFn, *, priority: int = Priority.DEFAULT
) -> Hook:
    """Calls `fn(loop, metrics)` at most `n` times per run (a positive int), evenly spaced.

    It always fires at the last step; see `NTimes`. Registers
    `on_schedule(loop, NTimes(n), name, fn, priority=priority)`, which describes the other
    arguments, and returns its OnStep `Hook` (named `"n_times_during_loop(n): name"`); a bad
    `n` raises ValueError.
    """
    return on_schedule(loop, NTimes(n), name, fn, priority=priority)


def periodic_callback(
    loop: Loop,
    period_seconds: float,
    name: str,
    fn: StepFn,
    *,
    call_on_end: bool = False,
    priority: int = Priority.DEFAULT,
    clock: Callable[[], float] = time.monotonic,
) -> Hook:
    """Calls `fn(loop, metrics)` at most once every `period_seconds`; see `Periodic`.

    `period_seconds` is the minimum time between calls, a finite number > 0 (else ValueError),
    measured by `clock` (it returns the time in seconds; inject a fake one in tests). The
    other arguments are those of `on_schedule`, which registers the OnStep `Hook` returned
    (named `"periodic_callback(<p>s): name"`).
    """
    schedule = Periodic(period_seconds, clock)
    return on_schedule(loop, schedule, name, fn, call_on_end=call_on_end, priority=priority)


def exponential_callback(
    loop: Loop,
    start_step: int,
    factor: float,
    name: str,
    fn: StepFn,
    *,
    call_on_end: bool = False,
    priority: int = Priority.DEFAULT,
) -> Hook:
    """Calls `fn(loop, metrics)` on a grid of steps whose gaps grow by `factor`.

    The grid is absolute (global steps); see `Exponential`. `start_step` is the first firing
    step and the first gap, a positive int, and `factor` (a finite number > 1) how much the
    gap grows each time; anything else raises ValueError. The other arguments are those of
    `on_schedule`, which registers the OnStep `Hook` returned (named
    `"exponential_callback(start_step, factor): name"`).
    """
    schedule = Exponential(start_step, factor)
    return on_schedule(loop, schedule, name, fn, call_on_end=call_on_end, priority=priority)


def at_steps(
    loop: Loop, steps: Iterable[int], name: str, fn: StepFn, *, priority: int = Priority.DEFAULT
) -> Hook:
    """Calls `fn(loop, metrics)` after the steps that bring the global step to one of `steps`.

    `steps` are values of `trainer.global_step` (global steps, as checkpoints count them),
    positive ints (empty or anything else raises ValueError); see `AtSteps`. The other
    arguments are those of `on_schedule`, which registers the OnStep `Hook` returned.
    """
    return on_schedule(loop, AtSteps(steps), name, fn, priority=priority)


def first_n_steps(
    loop: Loop,
    n: int,
    name: str,
    fn: StepFn,
    *,
    of_process: bool = False,
    priority: int = Priority.DEFAULT,
) -> Hook:
    """Calls `fn(loop, metrics)` at each of the first `n` steps of every run.

    With `of_process=True`, the first `n` steps of this process; see `FirstNSteps`. A bad `n`
    (not a positive int) raises ValueError. The other arguments are those of `on_schedule`,
    which registers the OnStep `Hook` returned.
    """
    return on_schedule(loop, FirstNSteps(n, of_process=of_process), name, fn, priority=priority)


def every_n_epochs(
    loop: Loop, n: int, name: str, fn: StepFn, *, priority: int = Priority.DEFAULT
) -> Hook:
    """Calls `fn(loop, metrics)` at the end of every n-th epoch of `run_epochs`.

    It runs after the OnStep hooks of the epoch's last step, with that step's metrics. Only
    `run_epochs` has epoch ends: with `run_steps` the hook does not run (the loop warns at the
    start of such a run). A bad `n` (not a positive int) raises ValueError. The other
    arguments are those of `on_schedule`, which registers the OnEpochEnd `Hook` returned.
    """
    return on_schedule(loop, EveryNEpochs(n), name, fn, priority=priority)
