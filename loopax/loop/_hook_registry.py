"""The hooks of a loop: registration, schedules, dispatch in priority order, hook states."""

from __future__ import annotations

import bisect
import itertools
import logging
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from .. import _validate
from ._finite import NonFiniteLossError
from ._hook import NEVER, Hook, HookError, Metrics, Priority, Schedule

PHASES = (
    "OnStart",
    "OnStep",
    "OnEpochEnd",
    "OnEnd",
    "OnEvaluation",
    "OnRestore",
    "OnFlush",
    "OnError",
)
_logger = logging.getLogger("loopax")


class HookOwner(Protocol):
    """The loop whose hooks a `HookRegistry` runs, as the registry sees it (a `Loop` is one).

    Where its run stands (the first four: a `RunInfo`), for the schedules; `trainer`, for
    the global step a hook's error names; `check_finite()`, called before a hook registered
    with `check_finite` runs (it may roll back, and so halt the phase). Every hook receives
    it as its first argument.
    """

    @property
    def start_step(self) -> int: ...
    @property
    def end_step(self) -> int: ...
    @property
    def loop_step(self) -> int: ...
    @property
    def epoch(self) -> int: ...
    @property
    def trainer(self) -> Any: ...
    def check_finite(self) -> None: ...


class HookRegistry:
    """Holds the hooks of each phase and runs them.

    Hooks of a phase run in ascending priority, ties in registration order. A scheduled
    hook's schedule is asked only from the step it named (`Schedule.next_step`), so the
    steps where no scheduled hook is due cost one comparison.

    Args:
      loop: what every hook receives as its first argument (`HookOwner`, the loop): where
        the run stands, for the schedules and for the step errors name; its trainer, whose
        `global_step` a hook's error names beside the loop step where they differ; its
        finite check, asked before a hook registered with `check_finite` (looked up at each
        call, so that a wrapper set on the loop sees every check).

    Its state is read by the loop's `Runner` and changed only by its own methods: the
    runner says when the hooks halt (`halt`, `resume`), when a run's steps start and end
    (`start_steps`, `end_steps`), and what waits for the end of a phase (`defer`).

    Attributes:
      halted: True while the run has gone back to an earlier step (a rollback): the
        hooks left in the phase running are skipped. Set by `halt`, cleared by `resume`.
      scheduling: True from a run's first step until its end (`start_steps`,
        `end_steps`): a step schedule registered then starts at once.
      wake_step: the next step at which a step-scheduled OnStep hook may fire.
      exact_wake_step: the next step at which a hook fires by steps, not by the clock;
        fused groups end there.
      call_step: the first step at which `step_hooks` has anything to do: `wake_step`,
        or 0 while an OnStep hook is visited after every step. Before it the runner
        need not call `step_hooks` at all.
      after_hooks: what `defer` deferred, run by `run_after_hooks`.
    """

    def __init__(self, loop: HookOwner) -> None:
        self._owner = loop  # also where the run stands (a `RunInfo`)
        self._trainer = loop.trainer
        self._hooks: dict[str, list[Hook]] = {phase: [] for phase in PHASES}
        self._order = itertools.count()
        self._every_step: list[Hook] = []  # OnStep hooks visited after every step
        # The OnStep hooks whose schedule names its next step (`hook.next`), in run order,
        # and those of them that fire at set steps (no clock): the wake steps' minima.
        self._scheduled: list[Hook] = []
        self._exact: list[Hook] = []
        self._states: dict[str, Any] = {}
        self._pending_states: dict[str, Any] = {}
        self.halted = False
        self.scheduling = False
        self.wake_step = NEVER
        self.exact_wake_step = NEVER
        self.call_step = NEVER
        self.after_hooks: list[Callable[[], None]] = []

    # -- registration ---------------------------------------------------------------------

    def register(
        self,
        phase: str,
        name: str,
        fn: Callable,
        priority: int,
        when: Schedule | None = None,
        check_finite: bool | None = None,
    ) -> Hook:
        """Adds a hook to `phase` in its priority order; see `Loop.on_step`.

        Raises:
          ValueError: `name` is not a non-empty str.
          TypeError: `fn` is not callable, `priority` not an int, or `when` not a
            schedule for this phase.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"a hook needs a non-empty name, got {name!r}")
        if not callable(fn):
            raise TypeError(f"hook {name!r}: fn must be callable, got {type(fn).__name__}")
        priority = _validate.priority(priority, where=f"hook {name!r}: ")
        if when is not None:
            if not isinstance(when, Schedule):
                raise TypeError(
                    f"hook {name!r}: when= must be a loopax.hooks schedule (e.g. "
                    f"EveryNSteps(10)), got {type(when).__name__}"
                )
            at_epoch_end = when.at_epoch_end
            if at_epoch_end != (phase == "OnEpochEnd"):
                where = "on_epoch_end" if at_epoch_end else "on_step"
                raise TypeError(f"hook {name!r}: {when!r} is a schedule for loop.{where}")
        if check_finite is None:
            check_finite = priority >= Priority.CHECKPOINT and phase in (
                "OnStep",
                "OnEpochEnd",
                "OnEnd",
            )
        hook = Hook(phase, name, fn, priority, next(self._order), when, bool(check_finite))
        # A new list, not an insertion: a phase that is running (a hook registering another)
        # goes on over the list it started with; the new hook runs from the next time.
        hooks = list(self._hooks[phase])
        bisect.insort(hooks, hook, key=lambda h: (h.priority, h.order))
        self._hooks[phase] = hooks
        if phase == "OnStep":
            self._every_step = [h for h in hooks if h.every_step]
            self._scheduled = [h for h in hooks if not h.every_step]
            self._exact = [
                h for h in self._scheduled if h.schedule is not None and not h.schedule.time_based
            ]
            self.call_step = 0 if self._every_step else self.wake_step
        if when is not None:
            self.add_state(name, hook)
            if self.scheduling:  # registered during a run's steps: schedule it from here
                when.start_run(self._owner)
                self.reschedule()
        return hook

    def of(self, phase: str) -> list[Hook]:
        """The hooks of `phase` in run order.

        Raises:
          ValueError: `phase` is not one of `PHASES`.
        """
        if phase not in self._hooks:
            raise ValueError(f"unknown phase {phase!r}; the phases are {list(PHASES)}")
        return self._hooks[phase]

    # -- states that checkpoints carry ----------------------------------------------------

    def add_state(self, name: str, obj: Any) -> str:
        """Keeps `obj` under `name` (or `name#2`, ...); see `Loop.add_state`."""
        if not (
            callable(getattr(obj, "get_state", None)) and callable(getattr(obj, "set_state", None))
        ):
            raise TypeError(f"state {name!r} needs get_state() and set_state(state) methods")
        unique, count = name, 2
        while unique in self._states:
            unique, count = f"{name}#{count}", count + 1
        self._states[unique] = obj
        if unique in self._pending_states:
            obj.set_state(self._pending_states.pop(unique))
        return unique

    def get_states(self) -> dict[str, Any]:
        """`{name: state}` of every object kept by `add_state`."""
        return {name: obj.get_state() for name, obj in self._states.items()}

    def set_states(self, states: dict[str, Any]) -> None:
        """Applies `get_states()` results; those of objects not kept yet wait for them."""
        for name, state in states.items():
            if name in self._states:
                self._states[name].set_state(state)
            else:
                self._pending_states[name] = state

    # -- schedules ------------------------------------------------------------------------

    def _schedules(self) -> Iterator[Schedule]:
        """The schedules of the scheduled hooks (OnStep and OnEpochEnd)."""
        for phase in ("OnStep", "OnEpochEnd"):
            for hook in self._hooks[phase]:
                if hook.schedule is not None:
                    yield hook.schedule

    def start_steps(self) -> None:
        """A run's steps start: every schedule starts its run from the run's step.

        From now until `end_steps`, a schedule registered (by a hook) starts at once.
        """
        for schedule in self._schedules():
            schedule.start_run(self._owner)
        self.reschedule()
        self.scheduling = True

    def end_steps(self) -> None:
        """The run is over: a schedule registered from now on starts with the next run."""
        self.scheduling = False

    def restart_schedules(self) -> None:
        """The run went back to an earlier step: every schedule restarts from there."""
        for schedule in self._schedules():
            schedule.restart(self._owner)
        self.reschedule()

    def reschedule(self) -> None:
        """Asks every step schedule for its next step from the current one."""
        step = self._owner.loop_step
        for hook in self._scheduled:
            schedule = hook.schedule
            assert schedule is not None, "a hook not asked every step has a schedule"
            hook.next = schedule.next_step(self._owner, step)
        self._set_wake_steps()

    def _set_wake_steps(self) -> None:
        # Plain loops over lists kept at registration: this runs at every wake step.
        wake = exact = NEVER
        for hook in self._scheduled:
            if hook.next < wake:
                wake = hook.next
        for hook in self._exact:
            if hook.next < exact:
                exact = hook.next
        self.wake_step, self.exact_wake_step = wake, exact
        self.call_step = 0 if self._every_step else wake

    # -- dispatch -------------------------------------------------------------------------

    def _error(self, phase: str, name: str, step: int, err: Exception) -> HookError:
        return HookError(phase, name, step, err, global_step=self._trainer.global_step)

    def _call(self, hook: Hook, argument: Any) -> None:
        if hook.check_finite:
            self._owner.check_finite()
            if self.halted:
                return
        try:
            hook.fn(self._owner, argument)
        except NonFiniteLossError:
            raise
        except Exception as err:
            raise self._error(hook.phase, hook.name, self._owner.loop_step, err) from err

    def _visit(self, hook: Hook, argument: Any, step: int) -> None:
        """Calls `hook` if its schedule (if any) fires at `step`."""
        schedule = hook.schedule
        if schedule is None:
            self._call(hook, argument)
            return
        run = self._owner
        if not schedule.checks_every_step:
            if hook.next > step:
                return
            fire = schedule.should_fire(run)
            hook.next = schedule.next_step(run, step + 1)
        else:
            fire = schedule.should_fire(run)
        if fire:
            self._call(hook, argument)
            schedule.fired(run)

    def step_hooks(self, metrics: Metrics, step: int) -> None:
        """Runs the OnStep hooks due after loop step `step`."""
        if step >= self.wake_step:
            for hook in self._hooks["OnStep"]:
                if self.halted:
                    return
                # `next` stays 0 for a hook asked every step: only the step-scheduled ones
                # not due yet are passed over, with one comparison and no call.
                if hook.next <= step:
                    self._visit(hook, metrics, step)
            self._set_wake_steps()
        else:
            owner = self._owner
            for hook in self._every_step:
                if self.halted:
                    return
                if hook.schedule is None and not hook.check_finite:
                    # The common every-step hook (a progress bar), without `_visit`/`_call`:
                    # on a small model each call shows in the step rate.
                    try:
                        hook.fn(owner, metrics)
                    except NonFiniteLossError:
                        raise
                    except Exception as err:
                        raise self._error(hook.phase, hook.name, step, err) from err
                else:
                    self._visit(hook, metrics, step)

    def run_phase(self, phase: str, argument: Any) -> None:
        """Runs the hooks of `phase` due now, with `argument`."""
        step = self._owner.loop_step
        for hook in self._hooks[phase]:
            self._visit(hook, argument, step)

    def run_flush(self) -> Callable[[], None]:
        """Runs the OnFlush hooks; returns a function that runs the waits they handed back."""
        waiters = []
        for hook in self._hooks["OnFlush"]:
            try:
                waiter = hook.fn(self._owner, None)
            except Exception as err:
                raise self._error("OnFlush", hook.name, self._owner.loop_step, err) from err
            if callable(waiter):
                waiters.append(waiter)

        def wait() -> None:
            for waiter in waiters:
                waiter()

        return wait

    def run_error(self, error: BaseException) -> None:
        """Runs the OnError hooks; their own errors are logged (the run's is the one raised)."""
        for hook in self._hooks["OnError"]:
            try:
                hook.fn(self._owner, error)
            except Exception:
                _logger.exception("OnError hook %r failed", hook.name)

    # -- halting and deferring -----------------------------------------------------------

    def halt(self) -> None:
        """Skips the hooks left in the phase running: the run went back to an earlier step."""
        self.halted = True

    def resume(self) -> None:
        """Lets the hooks run again after `halt` (the run goes on from its new step)."""
        self.halted = False

    def defer(self, fn: Callable[[], None]) -> None:
        """Runs `fn()` at the next `run_after_hooks`, once the phase's hooks have run."""
        self.after_hooks.append(fn)

    def drop_deferred(self) -> None:
        """Forgets what `defer` holds, unrun (a run that raised)."""
        self.after_hooks.clear()

    def run_after_hooks(self) -> None:
        """Runs, once, what `after_hooks` holds."""
        pending, self.after_hooks = self.after_hooks, []
        for fn in pending:
            fn()
