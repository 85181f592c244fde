"""Hook priorities, the hook record, schedules, and the error raised when a hook fails."""

from __future__ import annotations

import abc
import dataclasses
import enum
import sys
from collections.abc import Callable
from typing import Any, Protocol

Metrics = dict[str, Any]  # a step's metrics by name, as hooks and `run_*` get them
NEVER = sys.maxsize  # a `Schedule.next_step` that will not come
# `loop.shared_data` key: functions `fn(loop_step)` the loop calls each time it has waited
# for its steps in flight through `loop_step` (in batches, never one by one): when steps
# finished on the device, with no wait of its own (`hooks.throughput` times its windows so).
FINISHED = "loopax.steps_finished"


class RunInfo(Protocol):
    """Where a run stands: all a `Schedule` is told (a `Loop` is one).

    A schedule can be tested without a Loop: any object with these four attributes will
    do, e.g. `types.SimpleNamespace(start_step=0, end_step=100, loop_step=0, epoch=0)`.

    Attributes:
      start_step: the first step of the current run.
      end_step: one past the run's last step; -1 while unknown in the first epoch of
        `run_epochs`.
      loop_step: the step being run (0-based); at an epoch end, one past its last step.
      epoch: the current epoch of `run_epochs` (0-based).
    """

    @property
    def start_step(self) -> int: ...
    @property
    def end_step(self) -> int: ...
    @property
    def loop_step(self) -> int: ...
    @property
    def epoch(self) -> int: ...


class Priority(enum.IntEnum):
    """Named bands for hook priorities: lower runs first; ties run in registration order.

    Ready hooks use these bands so that, at any step, evaluations run before the
    checkpoint that may keep the best model, which runs before the logs and the UI that
    show the results. Any int works as a priority; `Priority.DEFAULT + 1` is fine too.

    Example:
      >>> Priority.VALIDATE < Priority.DEFAULT < Priority.CHECKPOINT < Priority.UI
      True
    """

    VALIDATE = -200
    EVALUATE = -100
    DEFAULT = 0
    CHECKPOINT = 100
    LOG = 200
    UI = 300


class HookError(RuntimeError):
    """A hook raised: the message names the phase, the hook and the step.

    The step is the `loop.loop_step` the hook saw. Where the trainer's `global_step` (the
    number checkpoints, logs and the progress bar show) differs, as in an OnStep hook
    (after loop step k the global step is k + 1), both are named: `OnStep hook 'check'
    failed at step 1129 (global step 1130): ...`. The original exception is chained as
    `__cause__`.

    Args:
      phase: the hook's phase, e.g. `"OnStep"`.
      hook_name: the name the hook was registered under.
      step: the loop step.
      error: what the hook raised.
      global_step: the trainer's global step when the hook raised, or None if unknown.

    Attributes:
      phase, hook_name, step, global_step: as given.
    """

    def __init__(
        self,
        phase: str,
        hook_name: str,
        step: int,
        error: BaseException,
        *,
        global_step: int | None = None,
    ):
        self.phase = phase
        self.hook_name = hook_name
        self.step = step
        self.global_step = global_step
        where = f"step {step}"
        if global_step is not None and global_step != step:
            where += f" (global step {global_step})"
        super().__init__(
            f"{phase} hook {hook_name!r} failed at {where}: {type(error).__name__}: {error}"
        )


class Schedule(abc.ABC):
    """When a scheduled hook fires; pass one as `when=` to `Loop.on_step`/`on_epoch_end`.

    The loop calls `start_run` before the first step of every run, then `should_fire`
    at the steps it may fire, never before the step `next_step` named. A schedule that
    depends on time, not steps, sets `checks_every_step` and is asked after every step.
    `get_state`/`set_state` carry its position across a checkpoint resume.

    Schedules combine with `|`: `every | at` fires when either fires (both advance).

    Example:
      >>> from loopax.hooks import EveryNSteps, AtSteps
      >>> either = EveryNSteps(100) | AtSteps([5, 50])
      >>> type(either).__name__
      'AnyOf'
    """

    #: True for a schedule that must be asked after every step (e.g. a clock).
    checks_every_step: bool = False
    #: True for a schedule that fires by the clock, not at set steps: with fused execution
    #: (`Loop(steps_per_execution=K)`) it fires at group ends and never ends a group early.
    time_based: bool = False
    #: True for a schedule of epoch ends (`loop.on_epoch_end`), False for one of steps.
    at_epoch_end: bool = False

    def start_run(self, run: RunInfo) -> None:
        """Called before the first step of every run (after the OnStart hooks)."""
        del run  # stateless schedules ignore it

    def restart(self, run: RunInfo) -> None:
        """Called when the run continues from an earlier step (`loop.resume_from`)."""
        del run  # stateless schedules ignore it

    def next_step(self, run: RunInfo, step: int) -> int:
        """The first step index `>= step` at which `should_fire` may be True (`NEVER` for none).

        The default asks at every step.
        """
        return step

    @abc.abstractmethod
    def should_fire(self, run: RunInfo) -> bool:
        """Whether the hook runs at the current step (`run.loop_step`); may advance."""

    def fired(self, run: RunInfo) -> None:
        """Called after the hook ran (e.g. a clock restarts its period here)."""
        del run  # stateless schedules ignore it

    def get_state(self) -> dict[str, Any]:
        """The position a checkpoint must save (JSON-serializable); `{}` when stateless."""
        return {}

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores a state returned by `get_state`, before the next run starts."""
        del state

    def __or__(self, other: Schedule) -> AnyOf:
        return AnyOf(self, other)


class AnyOf(Schedule):
    """Fires when any of its schedules fires.

    Each one is asked, so each advances, and each hears of every firing (`fired`: a clock part
    restarts its period whichever part fired).

    Raises:
      TypeError: an element is not a `Schedule`, or epoch-end and step schedules are mixed.
    """

    schedules: tuple[Schedule, ...]
    at_epoch_end: bool
    checks_every_step: bool
    time_based: bool

    def __init__(self, *schedules: Schedule):
        flat: list[Schedule] = []
        for schedule in schedules:
            if not isinstance(schedule, Schedule):
                raise TypeError(
                    f"only schedules combine with |, got {type(schedule).__name__}; use e.g. "
                    "loopax.hooks.EveryNSteps(100) | loopax.hooks.AtSteps([10])"
                )
            flat += schedule.schedules if isinstance(schedule, AnyOf) else [schedule]
        kinds = {bool(getattr(schedule, "at_epoch_end", False)) for schedule in flat}
        if len(kinds) > 1:
            raise TypeError(
                f"cannot combine epoch-end and step schedules ({' | '.join(map(repr, flat))}): "
                "epoch schedules run at epoch ends (loop.on_epoch_end), step schedules after "
                "steps; register two hooks instead"
            )
        self.schedules = tuple(flat)
        self.at_epoch_end = kinds.pop() if kinds else False
        self.checks_every_step = any(s.checks_every_step for s in flat)
        # Only all-clock: a step part keeps its steps exact (and ends fused groups).
        self.time_based = bool(flat) and all(s.time_based for s in flat)

    def start_run(self, run: RunInfo) -> None:
        for schedule in self.schedules:
            schedule.start_run(run)

    def restart(self, run: RunInfo) -> None:
        for schedule in self.schedules:
            schedule.restart(run)

    def next_step(self, run: RunInfo, step: int) -> int:
        return min(schedule.next_step(run, step) for schedule in self.schedules)

    def should_fire(self, run: RunInfo) -> bool:
        step = run.loop_step
        fire = False
        for schedule in self.schedules:
            if (schedule.checks_every_step or schedule.next_step(run, step) <= step) and (
                schedule.should_fire(run)
            ):
                fire = True
        return fire

    def fired(self, run: RunInfo) -> None:
        for schedule in self.schedules:
            schedule.fired(run)

    def get_state(self) -> dict[str, Any]:
        states = {str(i): s.get_state() for i, s in enumerate(self.schedules)}
        return {key: state for key, state in states.items() if state}

    def set_state(self, state: dict[str, Any]) -> None:
        for i, schedule in enumerate(self.schedules):
            schedule.set_state(state.get(str(i), {}))

    def __repr__(self) -> str:
        return " | ".join(repr(s) for s in self.schedules)


@dataclasses.dataclass(eq=False, repr=False, slots=True)
class Hook:
    """One registered hook, as `Loop.on_step` and the other registrations return it.

    Attributes:
      phase: "OnStart", "OnStep", "OnEpochEnd", "OnEnd", "OnEvaluation", "OnRestore" or
        "OnError".
      name: the name given at registration.
      fn: the function called.
      priority: lower runs first.
      order: its place among hooks of the same priority (registration order).
      schedule: the `Schedule` of a scheduled hook, else None (runs every time).
      check_finite: whether the loop checks that every step's loss so far is finite
        before calling it.
      next: the loop's cache of `schedule.next_step`.
    """

    phase: str
    name: str
    fn: Callable[..., Any]
    priority: int
    order: int
    schedule: Schedule | None
    check_finite: bool
    next: int = dataclasses.field(default=0, init=False)

    @property
    def every_step(self) -> bool:
        """Whether the loop must visit it after every step (unscheduled or clock-driven)."""
        return self.schedule is None or self.schedule.checks_every_step

    def get_state(self) -> dict[str, Any]:
        """The schedule's state (`{}` for an unscheduled hook)."""
        return {} if self.schedule is None else self.schedule.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores the schedule's state."""
        if self.schedule is not None:
            self.schedule.set_state(state)

    def __repr__(self) -> str:
        return f"<Hook {self.phase} {self.name!r} priority={self.priority}>"
