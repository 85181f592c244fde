"""Trigger helpers: register a `fn(loop, metrics)` on a `Loop` to run on a schedule.

Each helper registers one OnStep hook (plus one OnEnd hook with `call_on_end=True`) and returns
the trigger object that owns the schedule. Trigger objects check the loss is finite themselves,
only on the steps they fire (`checks_finite_lazily`), so a checkpoint every 1000 steps costs a
host sync every 1000 steps, not every step. They register in `loop._triggers` and offer
`get_state()` / `set_state(state)` so a checkpoint can carry the schedule across a restart.
"""

from __future__ import annotations

import abc
import numbers
import time
from typing import Any, Callable

from ..trainer._hooks import Priority
from ._schedules import EveryNSteps, Exponential, NTimes, Periodic

StepFn = Callable[[Any, Any], Any]


def _check_hook_args(name: object, fn: object) -> None:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {name!r} of type {type(name).__name__}")
    if not callable(fn):
        raise TypeError(f"fn for hook {name!r} must be callable as fn(loop, metrics), got {fn!r}")


class _Trigger(abc.ABC):
    """Base of the trigger objects: the OnStep hook callable itself.

    Subclasses implement `_should_fire(loop, first_step_of_run)`; calling the object as `obj(loop, metrics)` runs
    `fn` when it fires.
    """

    # Tells the loop not to check the loss before every step: we check only when firing.
    checks_finite_lazily = True

    def __init__(self, hook_name: str, fn: StepFn, priority: int):
        if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
            raise TypeError(
                f"hook {hook_name!r}: priority must be an int such as loopax.Priority.CHECKPOINT, "
                f"got {priority!r}"
            )
        self.name = hook_name
        self.fn = fn
        self.priority = int(priority)
        self._checks_finite = self.priority >= Priority.CHECKPOINT
        self._run_index: int | None = None

    def _register(self, loop: Any, call_on_end: bool = False) -> None:
        loop.on_step(self.name, self, priority=self.priority)
        if call_on_end:
            loop.on_end(self.name, _OnEndHook(self), priority=self.priority)
        loop._triggers.append(self)

    def _fire(self, loop: Any, metrics: Any) -> Any:
        if self._checks_finite:
            loop._check_finite()
        return self.fn(loop, metrics)

    def __call__(self, loop: Any, metrics: Any) -> Any:
        first_step_of_run = loop.run_index != self._run_index
        if first_step_of_run:
            self._run_index = loop.run_index
            self._start_run(loop)
        if self._should_fire(loop, first_step_of_run):
            return self._fire(loop, metrics)
        return None

    def _start_run(self, loop: Any) -> None:
        """Called on the first OnStep of every run, before `_should_fire`."""

    @abc.abstractmethod
    def _should_fire(self, loop: Any, first_step_of_run: bool) -> bool:
        """Whether to call `fn` at the current step (may advance the schedule)."""

    def _fire_on_end(self, loop: Any, metrics: Any) -> Any:
        return self._fire(loop, metrics)

    def get_state(self) -> dict[str, int | float]:
        """The schedule state a checkpoint must save (JSON-serializable); `{}` when stateless."""
        return {}

    def set_state(self, state: dict[str, int | float]) -> None:
        """Restores a state returned by `get_state`, before the next run starts."""
        del state

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} priority={self.priority}>"


class _OnEndHook:
    """The OnEnd hook of a trigger with `call_on_end=True`: fires once, unconditionally."""

    checks_finite_lazily = True

    def __init__(self, trigger: _Trigger):
        self.trigger = trigger

    def __call__(self, loop: Any, metrics: Any) -> Any:
        return self.trigger._fire_on_end(loop, metrics)


class EveryNStepsTrigger(_Trigger):
    """Runs `fn` at step k iff `(k + 1) % n == 0`; see `every_n_steps`. Stateless."""

    def __init__(self, n: int, name: str, fn: StepFn, priority: int):
        self.schedule = EveryNSteps(n)
        super().__init__(f"every_n_steps({self.schedule.n}): {name}", fn, priority)

    def __call__(self, loop: Any, metrics: Any) -> Any:
        # Stateless, so skip the run bookkeeping: this runs every step.
        if self.schedule.should_fire(loop.loop_step):
            return self._fire(loop, metrics)
        return None

    def _should_fire(self, loop: Any, first_step_of_run: bool) -> bool:
        return self.schedule.should_fire(loop.loop_step)


class NTimesTrigger(_Trigger):
    """Runs `fn` at most n times per run, evenly, always at the last step; see
    `n_times_during_loop`.

    State: the run's `start_step` and `end_step` (`-1` while unknown), so that a run resumed from
    a checkpoint that ends at the same `end_step` keeps the original run's firing points.
    """

    def __init__(self, n: int, name: str, fn: StepFn, priority: int):
        self.schedule = NTimes(n)
        super().__init__(f"n_times_during_loop({self.schedule.n}): {name}", fn, priority)
        self.run_start_step: int | None = None
        self.run_end_step: int = -1
        self._restored: dict[str, int] | None = None

    def _start_run(self, loop: Any) -> None:
        restored, self._restored = self._restored, None
        self.run_start_step = loop.start_step
        if (
            restored is not None
            and restored["end_step"] >= 0
            and restored["end_step"] == loop.end_step
            and restored["start_step"] <= loop.start_step < restored["end_step"]
        ):
            # Resuming the same run: keep its firing points.
            self.run_start_step = restored["start_step"]

    def _should_fire(self, loop: Any, first_step_of_run: bool) -> bool:
        self.run_end_step = loop.end_step
        assert self.run_start_step is not None
        steps_done = loop.loop_step - self.run_start_step + 1
        total_steps = None if loop.end_step < 0 else loop.end_step - self.run_start_step
        return self.schedule.should_fire(steps_done, total_steps)

    def get_state(self) -> dict[str, int | float]:
        if self.run_start_step is None:
            return {}
        return {"start_step": self.run_start_step, "end_step": self.run_end_step}

    def set_state(self, state: dict[str, int | float]) -> None:
        if not state:
            self._restored = None
            return
        self._restored = {
            "start_step": int(state["start_step"]),
            "end_step": int(state["end_step"]),
        }


class PeriodicTrigger(_Trigger):
    """Runs `fn` every `period_seconds` of `clock`; see `periodic_callback`.

    No state survives a restart: a clock's readings mean nothing in another process, so the
    period restarts with the first step of every run.
    """

    def __init__(
        self,
        period_seconds: float,
        name: str,
        fn: StepFn,
        priority: int,
        clock: Callable[[], float],
    ):
        self.schedule = Periodic(period_seconds)
        if not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds, got {clock!r}")
        self.clock = clock
        super().__init__(
            f"periodic_callback({self.schedule.period_seconds:g}s): {name}", fn, priority
        )

    def __call__(self, loop: Any, metrics: Any) -> Any:
        # Runs every step: within a run, one clock reading settles the usual "not yet".
        if loop.run_index == self._run_index and not self.schedule.should_fire(self.clock()):
            return None
        return super().__call__(loop, metrics)

    def _should_fire(self, loop: Any, first_step_of_run: bool) -> bool:
        if first_step_of_run:
            # The first step usually includes compilation: it only starts the clock.
            self.schedule.start(self.clock())
            return False
        return self.schedule.should_fire(self.clock())

    def _fire(self, loop: Any, metrics: Any) -> Any:
        try:
            return super()._fire(loop, metrics)
        finally:
            self.schedule.fired(self.clock())


class ExponentialTrigger(_Trigger):
    """Runs `fn` on an absolute grid of steps with growing gaps; see `exponential_callback`.

    Stateless across restarts: the grid is absolute and recomputed on the first step of each run.
    """

    def __init__(
        self, start_step: int, factor: float, name: str, fn: StepFn, priority: int
    ):
        self.schedule = Exponential(start_step, factor)
        super().__init__(
            f"exponential_callback({self.schedule.start_step}, {self.schedule.factor:g}): {name}",
            fn,
            priority,
        )

    def _start_run(self, loop: Any) -> None:
        self.schedule.start_run(loop.start_step)

    def _should_fire(self, loop: Any, first_step_of_run: bool) -> bool:
        return self.schedule.should_fire(loop.loop_step)


def every_n_steps(
    loop: Any, n: int, name: str, fn: StepFn, *, priority: int = Priority.DEFAULT
) -> EveryNStepsTrigger:
    """Calls `fn(loop, metrics)` after step k iff `(k + 1) % n == 0`.

    Aligned to the global step, so a resumed run fires where an uninterrupted one would. Never
    fires at the last step unless it is aligned, never in OnEnd.

    Args:
      loop: the `loopax.Loop`.
      n: the period in steps, a positive int.
      name: the user's hook name; the OnStep hook is named `"every_n_steps(n): name"`.
      fn: `fn(loop, metrics)`.
      priority: the hook's priority (see `loopax.Priority`).

    Returns:
      The trigger object (its `schedule` is an `EveryNSteps`).

    Raises:
      ValueError: if `n` is not a positive int.
    """
    _check_hook_args(name, fn)
    trigger = EveryNStepsTrigger(n, name, fn, priority)
    trigger._register(loop)
    return trigger


def n_times_during_loop(
    loop: Any, n: int, name: str, fn: StepFn, *, priority: int = Priority.DEFAULT
) -> NTimesTrigger:
    """Calls `fn(loop, metrics)` at most `n` times per run, evenly spaced, always at the last step.

    For a run of T known steps from `start_step`, fires where `k - start_step + 1` equals
    `ceil(i * T / n)` for i = 1..n (every step when T <= n). While the end is unknown (first epoch
    of `run_epochs`) fires after 128, 256, 512, ... steps of the run; once the end is known,
    continues with the even points (so it may fire a little more than n times in that run). The
    count restarts with each run; a run resumed from a checkpoint with the same `end_step` keeps
    the original run's points.

    Args:
      loop: the `loopax.Loop`.
      n: how many times per run, a positive int.
      name: the user's hook name; the OnStep hook is named `"n_times_during_loop(n): name"`.
      fn: `fn(loop, metrics)`.
      priority: the hook's priority (see `loopax.Priority`).

    Returns:
      The trigger object (its `schedule` is an `NTimes`).

    Raises:
      ValueError: if `n` is not a positive int.
    """
    _check_hook_args(name, fn)
    trigger = NTimesTrigger(n, name, fn, priority)
    trigger._register(loop)
    return trigger


def periodic_callback(
    loop: Any,
    period_seconds: float,
    name: str,
    fn: StepFn,
    *,
    call_on_end: bool = False,
    priority: int = Priority.DEFAULT,
    clock: Callable[[], float] = time.monotonic,
) -> PeriodicTrigger:
    """Calls `fn(loop, metrics)` at most once every `period_seconds`.

    The first step of each run only starts the clock (it usually includes compilation). After
    that it fires when `clock() - last >= period_seconds`, where `last` is read after the previous
    callback returned, so slow callbacks and paused time are not caught up. The clock restarts
    with each run and in each process: there is nothing to restore from a checkpoint.

    Args:
      loop: the `loopax.Loop`.
      period_seconds: the minimum time between calls, a finite number > 0.
      name: the user's hook name; the OnStep hook is named `"periodic_callback(<p>s): name"`.
      fn: `fn(loop, metrics)`.
      call_on_end: also call `fn` once in OnEnd, unconditionally.
      priority: the hook's priority (see `loopax.Priority`).
      clock: returns the time in seconds; inject a fake one in tests.

    Returns:
      The trigger object (its `schedule` is a `Periodic`).

    Raises:
      ValueError: if `period_seconds` is not a finite number > 0.
    """
    _check_hook_args(name, fn)
    trigger = PeriodicTrigger(period_seconds, name, fn, priority, clock)
    trigger._register(loop, call_on_end)
    return trigger


def exponential_callback(
    loop: Any,
    start_step: int,
    factor: float,
    name: str,
    fn: StepFn,
    *,
    call_on_end: bool = False,
    priority: int = Priority.DEFAULT,
) -> ExponentialTrigger:
    """Calls `fn(loop, metrics)` on an absolute grid of steps whose gaps grow by `factor`.

    The grid is `start_step`, then `next += gap; gap = round_half_away_from_zero(gap * factor)`:
    with 100 and 1.2, steps 100, 220, 364, 537, 745, ... On the first step of a run it skips the
    grid points `<=` the run's `start_step`, so a resumed run lands on the same grid; it fires at
    most once per step and catches up one step at a time when behind.

    Args:
      loop: the `loopax.Loop`.
      start_step: the first firing step and the first gap, a positive int.
      factor: how much the gap grows each time, a finite number > 1.
      name: the user's hook name; the OnStep hook is named
        `"exponential_callback(start_step, factor): name"`.
      fn: `fn(loop, metrics)`.
      call_on_end: also call `fn` once in OnEnd, unconditionally.
      priority: the hook's priority (see `loopax.Priority`).

    Returns:
      The trigger object (its `schedule` is an `Exponential`).

    Raises:
      ValueError: if `start_step` is not a positive int or `factor` is not a finite number > 1.
    """
    _check_hook_args(name, fn)
    trigger = ExponentialTrigger(start_step, factor, name, fn, priority)
    trigger._register(loop, call_on_end)
    return trigger

