"""The Loop's hooks: registration, schedules, dispatch in priority order, resumable state."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ..data._datasets import Dataset
from ._finite import NonFiniteLossError
from ._history import Evaluation
from ._hook import NEVER, Hook, HookError, Priority, Schedule

if TYPE_CHECKING:
    from ._loop import Loop

Metrics = dict[str, Any]
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


class HookRegistry:
    """The part of `Loop` that holds its hooks and runs them; see `Loop`.

    Hooks of a phase run in ascending priority, ties in registration order. A scheduled
    hook's schedule is asked only from the step it named (`Schedule.next_step`), so the
    steps where no scheduled hook is due cost one comparison.
    """

    # Provided by `Loop` and its metrics part.
    loop_step: int
    start_step: int
    end_step: int
    history: Any
    _running: bool
    _rewound: bool
    check_finite: Callable[[], None]
    _resolve_logs: Callable[[int], None]

    @property
    def _as_loop(self) -> Loop:
        # Every HookRegistry is a Loop (its base class): schedules are handed the loop.
        return cast("Loop", self)

    def __init__(self) -> None:
        self._hooks: dict[str, list[Hook]] = {phase: [] for phase in PHASES}
        self._order = itertools.count()
        self._every_step: list[Hook] = []  # OnStep hooks visited after every step
        self._wake_step = NEVER  # the next step at which a step-scheduled hook may fire
        # The next step a hook fires at by steps, not by the clock: fused groups end there.
        self._exact_wake_step = NEVER
        self._scheduling = False  # True from a run's first step: its schedules have started
        self._states: dict[str, Any] = {}
        self._pending_states: dict[str, Any] = {}
        self._after_hooks: list[Callable[[], None]] = []
        self._resumed_run: dict[str, int] | None = None  # the run a restored state was in

    # -- hook registration ----------------------------------------------------------------

    def _register(
        self,
        phase: str,
        name: str,
        fn: Callable,
        priority: int,
        when: Schedule | None = None,
        check_finite: bool | None = None,
    ) -> Hook:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a hook needs a non-empty name, got {name!r}")
        if not callable(fn):
            raise TypeError(f"hook {name!r}: fn must be callable, got {type(fn).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
            raise TypeError(
                f"hook {name!r}: priority must be an int such as loopax.Priority.CHECKPOINT, "
                f"got {priority!r}"
            )
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
            check_finite = int(priority) >= Priority.CHECKPOINT and phase in (
                "OnStep",
                "OnEpochEnd",
                "OnEnd",
            )
        hook = Hook(phase, name, fn, int(priority), next(self._order), when, bool(check_finite))
        # A new list, not an insertion: a phase that is running (a hook registering another)
        # goes on over the list it started with; the new hook runs from the next time.
        hooks = list(self._hooks[phase])
        bisect.insort(hooks, hook, key=lambda h: (h.priority, h.order))
        self._hooks[phase] = hooks
        if phase == "OnStep":
            self._every_step = [h for h in hooks if h.every_step]
        if when is not None:
            self.add_state(name, hook)
            if self._scheduling:  # registered during a run's steps: schedule it from here
                when.start_run(self._as_loop)
                self._reschedule()
        return hook

    def on_start(self, name: str, fn: Callable[[Loop, Dataset], Any], priority: int = 0) -> Hook:
        """Registers `fn(loop, dataset)` to run at the start of every run."""
        return self._register("OnStart", name, fn, priority)

    def on_step(
        self,
        name: str,
        fn: Callable[[Loop, Metrics], Any],
        priority: int = 0,
        *,
        when: Schedule | None = None,
        check_finite: bool | None = None,
    ) -> Hook:
        """Registers `fn(loop, metrics)` to run after every train step, or when `when` fires.

        `when` is a step schedule (e.g. `hooks.EveryNSteps(100)`).

        Args:
          name: the hook's name, in messages and `hooks()`.
          fn: `fn(loop, metrics)`.
          priority: lower runs first (see `Priority`).
          when: a step `Schedule`; the loop calls `fn` only when it fires, and asks it
            only at the steps it may fire. Its state is checkpointed under `name`.
          check_finite: check that every loss so far is finite before calling `fn` (a
            wait for the device). Default: True for priority >= `Priority.CHECKPOINT`.
            Hooks that only read device values when they act can pass False and call
            `loop.check_finite()` themselves.

        Returns:
          The registered `Hook`.
        """
        return self._register("OnStep", name, fn, priority, when, check_finite)

    def on_epoch_end(
        self,
        name: str,
        fn: Callable[[Loop, Metrics], Any],
        priority: int = 0,
        *,
        when: Schedule | None = None,
        check_finite: bool | None = None,
    ) -> Hook:
        """Registers `fn(loop, metrics)` to run at the end of each epoch of `run_epochs`.

        Or of the epochs `when` picks, e.g. `hooks.EveryNEpochs(2)`; after the OnStep hooks of the
        epoch's last step. `loop.epoch` is the epoch that ended, and, as in OnEnd, `loop_step` is
        one past its last step (`== trainer.global_step`).
        """
        return self._register("OnEpochEnd", name, fn, priority, when, check_finite)

    def on_end(
        self,
        name: str,
        fn: Callable[[Loop, Metrics], Any],
        priority: int = 0,
        *,
        check_finite: bool | None = None,
    ) -> Hook:
        """Registers `fn(loop, metrics)` to run at the end of a run (the last metrics)."""
        return self._register("OnEnd", name, fn, priority, None, check_finite)

    def on_evaluation(
        self, name: str, fn: Callable[[Loop, Evaluation], Any], priority: int = 0
    ) -> Hook:
        """Registers `fn(loop, evaluation)` to run for every `Evaluation` of `loop.evaluate`.

        `loop.evaluate` publishes one per dataset and global step.
        """
        return self._register("OnEvaluation", name, fn, priority)

    def on_restore(self, name: str, fn: Callable[[Loop, int], Any], priority: int = 0) -> Hook:
        """Registers `fn(loop, step)` to run whenever the training continues from an earlier `step`.

        `step` is a global step (`resume_from`: a checkpoint restore or a rollback); writers drop
        what they wrote after `step` there.
        """
        return self._register("OnRestore", name, fn, priority)

    def on_flush(
        self, name: str, fn: Callable[[Loop, None], Callable[[], None] | None], priority: int = 0
    ) -> Hook:
        """Registers `fn(loop, None)` to run when `loop.flush()` is called.

        `loop.flush()` runs before every checkpoint commit: `fn` starts writing out what its output
        holds and may return a function that waits until that is on disk.
        """
        return self._register("OnFlush", name, fn, priority)

    def on_error(
        self, name: str, fn: Callable[[Loop, BaseException], Any], priority: int = 0
    ) -> Hook:
        """Registers `fn(loop, error)` to run when a run raises.

        Its own errors are logged, and the run's error propagates; e.g. to wait for saves in flight.
        """
        return self._register("OnError", name, fn, priority)

    def hooks(self, phase: str) -> list[tuple[int, str]]:
        """The `(priority, name)` of the hooks of `phase` (one of `PHASES`) in run order."""
        if phase not in self._hooks:
            raise ValueError(f"unknown phase {phase!r}; the phases are {list(PHASES)}")
        return [(h.priority, h.name) for h in self._hooks[phase]]

    # -- state that checkpoints carry -----------------------------------------------------

    def add_state(self, name: str, obj: Any) -> str:
        """Registers `obj` so that checkpoints save and restore it with the loop.

        `obj` has `get_state() -> dict` and `set_state(dict)`. Returns the name it is kept under
        (`name`, or `name#2`, ... when taken). A state saved under that name and not applied yet is
        applied now.
        """
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

    def get_state(self) -> dict[str, Any]:
        """The loop's resumable state (JSON-serializable).

        It holds the history, every state registered with `add_state` (trigger schedules, early
        stopping, ...), and the run in progress (so that resuming it continues its train metrics'
        averages).
        """
        return {
            "history": self.history.get_state(),
            "hooks": {name: obj.get_state() for name, obj in self._states.items()},
            "run": {"start_step": self.start_step, "end_step": self.end_step}
            if self._running
            else None,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores a `get_state()` result.

        States of hooks not registered yet wait for their registration.
        """
        if "history" in state:
            self.history.set_state(state["history"])
        self._resumed_run = state.get("run")
        for name, hook_state in state.get("hooks", {}).items():
            if name in self._states:
                self._states[name].set_state(hook_state)
            else:
                self._pending_states[name] = hook_state

    def call_after_hooks(self, fn: Callable[[], None]) -> None:
        """Runs `fn()` once the hooks of the current phase have all run.

        That is, this step's OnStep hooks, or the OnEnd hooks; at once outside a run. A checkpoint
        commits there, after the logs of its step are written.
        """
        if self._running:
            self._after_hooks.append(fn)
        else:
            fn()

    # -- running hooks --------------------------------------------------------------------

    def _scheduled(self) -> Iterator[Hook]:
        for phase in ("OnStep", "OnEpochEnd"):
            for hook in self._hooks[phase]:
                if hook.schedule is not None:
                    yield hook

    def _step_scheduled(self) -> Iterator[Hook]:
        """The OnStep hooks whose schedule names its next step (not asked every step)."""
        return (h for h in self._hooks["OnStep"] if not h.every_step)

    def _reschedule(self) -> None:
        """Asks every step schedule for its next step from the current one."""
        for hook in self._step_scheduled():
            schedule = hook.schedule
            assert schedule is not None, "a hook not asked every step has a schedule"
            hook.next = schedule.next_step(self._as_loop, self.loop_step)
        self._set_wake_steps()

    def _call(self, hook: Hook, argument: Any) -> None:
        if hook.check_finite:
            self.check_finite()
            if self._rewound:
                return
        try:
            hook.fn(self, argument)
        except NonFiniteLossError:
            raise
        except Exception as err:
            raise HookError(hook.phase, hook.name, self.loop_step, err) from err

    def _visit(self, hook: Hook, argument: Any, step: int) -> None:
        """Calls `hook` if its schedule (if any) fires at `step`."""
        schedule = hook.schedule
        if schedule is None:
            self._call(hook, argument)
            return
        if not schedule.checks_every_step:
            if hook.next > step:
                return
            fire = schedule.should_fire(self._as_loop)
            hook.next = schedule.next_step(self._as_loop, step + 1)
        else:
            fire = schedule.should_fire(self._as_loop)
        if fire:
            self._call(hook, argument)
            schedule.fired(self._as_loop)

    def _set_wake_steps(self) -> None:
        hooks = list(self._step_scheduled())
        self._wake_step = min((h.next for h in hooks), default=NEVER)
        self._exact_wake_step = min(
            (h.next for h in hooks if h.schedule is not None and not h.schedule.time_based),
            default=NEVER,
        )

    def _step_hooks(self, metrics: Metrics, step: int) -> None:
        if step >= self._wake_step:
            for hook in self._hooks["OnStep"]:
                if self._rewound:
                    return
                self._visit(hook, metrics, step)
            self._set_wake_steps()
        else:
            for hook in self._every_step:
                if self._rewound:
                    return
                if hook.schedule is None and not hook.check_finite:
                    # The common every-step hook (a progress bar), without `_visit`/`_call`:
                    # on a small model each call shows in the step rate.
                    try:
                        hook.fn(self, metrics)
                    except NonFiniteLossError:
                        raise
                    except Exception as err:
                        raise HookError(hook.phase, hook.name, step, err) from err
                else:
                    self._visit(hook, metrics, step)

    def _run_after_hooks(self) -> None:
        # What runs after the hooks (a checkpoint commit, a final flush) sees every log.
        self._resolve_logs(NEVER)
        pending, self._after_hooks = self._after_hooks, []
        for fn in pending:
            fn()

    def _run_phase(self, phase: str, argument: Any) -> None:
        step = self.loop_step
        for hook in self._hooks[phase]:
            self._visit(hook, argument, step)
        # OnEvaluation and OnRestore run inside other phases, which run `call_after_hooks`.
        if self._after_hooks and phase in ("OnStart", "OnEpochEnd", "OnEnd"):
            self._run_after_hooks()
