"""The `Loop`: runs steps or epochs and fires prioritized hooks."""

from __future__ import annotations

import bisect
import collections
import contextlib
import itertools
import logging
import sys
import time
import warnings
from typing import Any, Callable, Iterator

import jax
import numpy as np

from ._datasets import Dataset, dataset_name
from ._finite import FiniteChecker, NonFiniteHandler, NonFiniteLossError
from ._history import Evaluation, History, train_key
from ._hooks import NEVER, Hook, HookError, Priority, Schedule
from ._inflight import InFlight, limit_for
from ._signals import Interrupts, signal_name
from ._trainer import Trainer

Metrics = dict[str, Any]
_DURATIONS_KEPT = 1024  # step durations kept for the median: bounded memory on long runs
PHASES = (
    "OnStart", "OnStep", "OnEpochEnd", "OnEnd", "OnEvaluation", "OnRestore", "OnFlush", "OnError"
)
LogFn = Callable[[int, dict[str, float]], Any]
_logger = logging.getLogger("loopax")

__all__ = ["Loop", "NonFiniteLossError"]


class Loop:
    """Runs a `Trainer` over a dataset for some steps or epochs, firing hooks.

    Hooks run in ascending priority (ties in registration order) and receive the loop:
    `fn(loop, dataset)` (OnStart), `fn(loop, metrics)` (OnStep, OnEpochEnd, OnEnd; the
    step's metrics as `train_step` returned them, on the device), `fn(loop, evaluation)`
    (OnEvaluation), `fn(loop, step)` (OnRestore), `fn(loop, error)` (OnError). While OnStep
    hooks run, `loop_step` is the 0-based index of the step just run and
    `trainer.global_step` is `loop_step + 1`; in OnEpochEnd and OnEnd, `loop_step` is one
    past the last step run (`== trainer.global_step`).

    What hooks may use (and the ready hooks use nothing else): the attributes below,
    `host_metrics()` (the step's metrics read once however many hooks ask),
    `record_train_metrics()`, `evaluate(dataset)` (once per step and dataset, published to
    OnEvaluation hooks), `history`, `check_finite()`, `request_stop(reason)`,
    `call_after_hooks(fn)`, `add_state(name, obj)` / `get_state()` / `set_state()`,
    `resume_from(step)` and `handle_non_finite(fn)`.

    Every step's loss is checked without a per-step host sync: it is read when the loop
    already waits for that step (the in-flight bound), before any hook registered with
    `check_finite` (by default those of priority >= `Priority.CHECKPOINT`) and before
    OnEnd. A non-finite loss stops the run with `NonFiniteLossError` naming the first bad
    step. SIGINT and SIGTERM during a run finish the current step, run the OnEnd hooks
    (so a checkpoint hook saves) and exit with one line; a second signal exits at once.

    Args:
      trainer: the `Trainer` to run.

    Attributes:
      trainer: the trainer.
      loop_step: the step being run (starts at `trainer.global_step`).
      start_step: the first step of the current run.
      end_step: one past the last step of the run; -1 while unknown during the first
        epoch of `run_epochs`.
      epoch: the current epoch of `run_epochs` (0-based).
      run_index: incremented at the start of every run (hooks use it to spot a new run).
      metrics: the latest step's metrics, on the device.
      history: the `History` of every logged metric (`"train/<m>"`, `"eval/<ds>/<m>"`).
      shared_data: a dict where hooks leave results for each other.
      train_step_durations: seconds per step, hooks included (the last 1024 steps).
      stop_reason: the reason given to `request_stop`, or None.
      checkpointed_step: the newest global step a checkpoint hook saved, or None.

    Example:
      >>> import numpy as np, optax, flax.linen as nn, loopax
      >>> trainer = loopax.Trainer(lambda ctx, spec, x: nn.Dense(1)(x[0]),
      ...     loopax.losses.mean_squared_error, optax.sgd(0.1), devices=jax.devices()[:1])
      >>> data = loopax.ArrayDataset(np.ones((8, 2), np.float32), np.ones((8, 1), np.float32),
      ...     batch_size=4, loop_forever=True)
      >>> loop = loopax.Loop(trainer)
      >>> seen = []
      >>> _ = loop.on_step("record", lambda loop, metrics: seen.append(loop.loop_step))
      >>> _ = loop.run_steps(data, 3)
      >>> seen, loop.loop_step, trainer.global_step
      ([0, 1, 2], 3, 3)
    """

    def __init__(self, trainer: Trainer):
        if not isinstance(trainer, Trainer):
            raise TypeError(f"Loop needs a loopax.Trainer, got {type(trainer).__name__}")
        self.trainer = trainer
        self.loop_step = trainer.global_step
        self.start_step = trainer.global_step
        self.end_step = -1
        self.epoch = 0
        self.run_index = 0
        self.metrics: Metrics = {}
        self.history = History()
        self.shared_data: dict[str, Any] = {}
        self.train_step_durations: collections.deque[float] = collections.deque(
            maxlen=_DURATIONS_KEPT
        )
        self.stop_reason: str | None = None
        self.checkpointed_step: int | None = None
        self._hooks: dict[str, list[Hook]] = {phase: [] for phase in PHASES}
        self._order = itertools.count()
        self._every_step: list[Hook] = []  # OnStep hooks visited after every step
        self._wake_step = NEVER  # the next step at which a step-scheduled hook may fire
        self._states: dict[str, Any] = {}
        self._pending_states: dict[str, Any] = {}
        self._after_hooks: list[Callable[[], None]] = []
        self._running = False
        self._scheduling = False  # True from a run's first step: its schedules have started
        self._stop_requested = False
        self._rewound = False
        self._metrics_step = -1
        self._host_metrics: dict[str, float] = {}
        self._host_metrics_step = -1
        self._evaluations: dict[str, Evaluation] = {}
        self._evaluations_step = -1
        self._epoch_batches = 0
        # Train metrics asked for by `log_train_metrics`, read once their step finished:
        # (loop step, its metrics, extra device values, [(callback, its extra keys)]).
        self._pending_logs: list[tuple[int, Metrics, dict[str, Any], list[tuple[LogFn, tuple]]]] = []
        self._warned_epoch_hooks = False
        self._pending_error: BaseException | None = None
        self._finite = FiniteChecker()
        self._in_flight = InFlight(limit_for(trainer.num_devices))
        self._interrupts = Interrupts(self._on_signal)

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
                "OnStep", "OnEpochEnd", "OnEnd"
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
                when.start_run(self)
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
        """Registers `fn(loop, metrics)` to run after every train step, or at the steps of
        the schedule `when` (e.g. `hooks.EveryNSteps(100)`).

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
        """Registers `fn(loop, metrics)` to run at the end of each epoch of `run_epochs`
        (or of the epochs `when` picks, e.g. `hooks.EveryNEpochs(2)`), after the OnStep
        hooks of the epoch's last step; `loop.epoch` is the epoch that ended, and, as in
        OnEnd, `loop_step` is one past its last step (`== trainer.global_step`)."""
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
        """Registers `fn(loop, evaluation)` to run for every `Evaluation` that
        `loop.evaluate` publishes (one per dataset and global step)."""
        return self._register("OnEvaluation", name, fn, priority)

    def on_restore(self, name: str, fn: Callable[[Loop, int], Any], priority: int = 0) -> Hook:
        """Registers `fn(loop, step)` to run whenever the training continues from an
        earlier global `step` (`resume_from`: a checkpoint restore or a rollback); writers
        drop what they wrote after `step` there."""
        return self._register("OnRestore", name, fn, priority)

    def on_flush(
        self, name: str, fn: Callable[[Loop, None], Callable[[], None] | None], priority: int = 0
    ) -> Hook:
        """Registers `fn(loop, None)` to run when `loop.flush()` is called (before every
        checkpoint commit): it starts writing out what its output holds and may return a
        function that waits until that is on disk."""
        return self._register("OnFlush", name, fn, priority)

    def on_error(
        self, name: str, fn: Callable[[Loop, BaseException], Any], priority: int = 0
    ) -> Hook:
        """Registers `fn(loop, error)` to run when a run raises (its own errors are logged,
        and the run's error propagates), e.g. to wait for saves in flight."""
        return self._register("OnError", name, fn, priority)

    def hooks(self, phase: str) -> list[tuple[int, str]]:
        """The `(priority, name)` of the hooks of `phase` (one of `PHASES`) in run order."""
        if phase not in self._hooks:
            raise ValueError(f"unknown phase {phase!r}; the phases are {list(PHASES)}")
        return [(h.priority, h.name) for h in self._hooks[phase]]

    # -- state that checkpoints carry -----------------------------------------------------

    def add_state(self, name: str, obj: Any) -> str:
        """Registers `obj` (with `get_state() -> dict` and `set_state(dict)`) so that
        checkpoints save and restore it with the loop; returns the name it is kept under
        (`name`, or `name#2`, ... when taken). A state saved under that name and not
        applied yet is applied now."""
        if not (callable(getattr(obj, "get_state", None)) and callable(getattr(obj, "set_state", None))):
            raise TypeError(f"state {name!r} needs get_state() and set_state(state) methods")
        unique, count = name, 2
        while unique in self._states:
            unique, count = f"{name}#{count}", count + 1
        self._states[unique] = obj
        if unique in self._pending_states:
            obj.set_state(self._pending_states.pop(unique))
        return unique

    def get_state(self) -> dict[str, Any]:
        """The loop's resumable state (JSON-serializable): the history and every state
        registered with `add_state` (trigger schedules, early stopping, ...)."""
        return {
            "history": self.history.get_state(),
            "hooks": {name: obj.get_state() for name, obj in self._states.items()},
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores a `get_state()` result; states of hooks not registered yet wait for
        their registration."""
        if "history" in state:
            self.history.set_state(state["history"])
        for name, hook_state in state.get("hooks", {}).items():
            if name in self._states:
                self._states[name].set_state(hook_state)
            else:
                self._pending_states[name] = hook_state

    # -- what hooks ask of the loop -------------------------------------------------------

    @property
    def running(self) -> bool:
        """Whether a run (`run_steps`, `run_epochs`) is in progress."""
        return self._running

    def report_error(self, error: BaseException) -> None:
        """Makes the run raise `error` once the current step's hooks have run; safe to call
        from another thread (e.g. a background save that failed). Outside a run, the next
        run raises it at its start."""
        def raise_it() -> None:
            raise error

        if self._running:
            self._after_hooks.append(raise_it)
        else:
            self._pending_error = error

    def request_stop(self, reason: str = "") -> None:
        """Ends the run after the current step's hooks; OnEnd hooks still run."""
        self._stop_requested = True
        self.stop_reason = reason

    def handle_non_finite(self, fn: NonFiniteHandler | None) -> None:
        """Makes `fn(loop, steps)` handle steps the trainer skipped for a non-finite loss or
        gradient (`Trainer.skip_non_finite_steps`), instead of a warning; None removes it.
        `hooks.nan_guard` sets it."""
        self._finite.handler = fn

    def check_finite(self) -> None:
        """Waits for the steps in flight and checks their losses.

        Raises:
          NonFiniteLossError: naming the first step whose loss is NaN or infinite.
        """
        if self._finite.checked_through < self._metrics_step or self._finite.failure:
            self._settle()

    def host_metrics(self) -> dict[str, float]:
        """The latest step's metrics as Python floats, read from the device at most once
        per step however many hooks ask (it waits for that step)."""
        if self._host_metrics_step != self._metrics_step:
            values = jax.device_get(self.metrics)
            self._host_metrics = {key: float(np.asarray(value)) for key, value in values.items()}
            self._host_metrics_step = self._metrics_step
        return dict(self._host_metrics)

    def record_train_metrics(self) -> dict[str, float]:
        """Reads the latest step's metrics (`host_metrics`), records them in `history` at
        their global step, and returns them keyed `"train/<metric>"`. Writers call it on the
        steps they log."""
        keyed = {train_key(name): value for name, value in self.host_metrics().items()}
        if keyed:
            self.history.record(self._metrics_step + 1, keyed)
        return keyed

    def log_train_metrics(self, fn: LogFn, extra: dict[str, Any] | None = None) -> None:
        """Logs the latest step's train metrics without waiting for the device.

        Once the step has finished (when the loop next waits for it anyway: at most one
        in-flight window later, or at the latest at `check_finite`, `flush` or the end of
        the run) its metrics are read (once, however many writers asked), recorded in
        `history` at their global step, and `fn(global_step, values)` is called with
        `values` keyed `"train/<metric>"`, plus this caller's `extra` (`{key: device
        scalar}`, e.g. the learning rate), read at the same time and recorded too.
        """
        step = self._metrics_step
        if not self.metrics:
            return
        extra = dict(extra or {})
        pending = self._pending_logs
        if pending and pending[-1][0] == step:
            pending[-1][2].update(extra)
            pending[-1][3].append((fn, tuple(extra)))
        else:
            pending.append((step, self.metrics, extra, [(fn, tuple(extra))]))
        if not self._running:
            self._resolve_logs(NEVER)

    def _resolve_logs(self, through_step: int) -> None:
        """Reads and hands out the pending train logs of steps `<= through_step`."""
        pending = self._pending_logs
        ready = 0
        while ready < len(pending) and pending[ready][0] <= through_step:
            ready += 1
        if not ready:
            return
        entries, self._pending_logs = pending[:ready], pending[ready:]
        values = jax.device_get([(metrics, extra) for _, metrics, extra, _ in entries])
        for (step, _, _, callbacks), (metrics, extra) in zip(entries, values):
            keyed = {train_key(name): float(np.asarray(v)) for name, v in metrics.items()}
            extra = {key: float(np.asarray(v)) for key, v in extra.items()}
            self.history.record(step + 1, {**keyed, **extra})
            for callback, extra_keys in callbacks:
                callback(step + 1, {**keyed, **{key: extra[key] for key in extra_keys}})

    def flush(self) -> Callable[[], None]:
        """Hands the pending train logs to their writers and asks every output (OnFlush
        hooks) to write out; returns a function that waits until all of it is on disk.

        A checkpoint calls it after the hooks of the step it saves and waits before it
        commits, so that a resumed run's logs hold every point up to the checkpoint."""
        self._resolve_logs(NEVER)
        waiters = []
        for hook in self._hooks["OnFlush"]:
            try:
                waiter = hook.fn(self, None)
            except Exception as err:
                raise HookError("OnFlush", hook.name, self.loop_step, err) from err
            if callable(waiter):
                waiters.append(waiter)

        def wait() -> None:
            for waiter in waiters:
                waiter()

        return wait

    def evaluate(self, dataset: Dataset) -> Evaluation:
        """Evaluates `dataset` at the current global step, once: a second call at the same
        step returns the same `Evaluation`. A new evaluation is recorded in `history`
        (`"eval/<dataset>/<metric>"`) and published to the OnEvaluation hooks.

        Raises:
          ValueError: the dataset has no non-empty str `name`.
        """
        name = dataset_name(dataset)
        step = self.trainer.global_step
        if self._evaluations_step != step:
            self._evaluations, self._evaluations_step = {}, step
        evaluation = self._evaluations.get(name)
        if evaluation is None:
            evaluation = Evaluation(step, name, self.trainer.evaluate(dataset))
            self._evaluations[name] = evaluation
            self.history.record(step, evaluation.keyed())
            self._run_phase("OnEvaluation", evaluation)
        return evaluation

    def evaluation(self, dataset: str) -> Evaluation | None:
        """The evaluation of dataset `dataset` (a name) at the current global step, if any."""
        if self._evaluations_step != self.trainer.global_step:
            return None
        return self._evaluations.get(dataset)

    def call_after_hooks(self, fn: Callable[[], None]) -> None:
        """Runs `fn()` once the hooks of the current phase have all run (this step's
        OnStep hooks, or the OnEnd hooks); at once outside a run. A checkpoint commits
        there, after the logs of its step are written."""
        if self._running:
            self._after_hooks.append(fn)
        else:
            fn()

    def resume_from(self, step: int, state: dict[str, Any] | None = None) -> None:
        """Continues from global step `step`, to which the trainer's state was just set
        (a checkpoint restore, or a rollback inside a run).

        Drops the history after `step`, applies the loop `state` (from `get_state`), and
        runs the OnRestore hooks. Inside a run, the steps in flight are dropped and the run
        continues at `step` (its end stays where it was).
        """
        step = int(step)
        self.history.truncate_after(step)
        if state is not None:
            self.set_state(state)
        self._evaluations_step = -1
        self._pending_logs = [entry for entry in self._pending_logs if entry[0] < step]
        if self._running:
            self._in_flight.wait_all()
            self._finite.restart(self.trainer, step)
            self.loop_step = step
            self._rewound = True
            for hook in self._scheduled():
                hook.schedule.restart(self)
            self._reschedule()
        else:
            self.loop_step = self.start_step = step
        self._run_phase("OnRestore", step)

    # -- timing ---------------------------------------------------------------------------

    def median_train_step_duration(self) -> float:
        """The median step duration in seconds (hooks included); 1 ms with no steps."""
        if not self.train_step_durations:
            return 1e-3
        ordered = sorted(self.train_step_durations)
        return ordered[len(ordered) // 2]

    # -- running hooks --------------------------------------------------------------------

    def _scheduled(self) -> Iterator[Hook]:
        for phase in ("OnStep", "OnEpochEnd"):
            for hook in self._hooks[phase]:
                if hook.schedule is not None:
                    yield hook

    def _reschedule(self) -> None:
        """Asks every step schedule for its next step from the current one."""
        wake = NEVER
        for hook in self._hooks["OnStep"]:
            if hook.schedule is not None and not hook.schedule.checks_every_step:
                hook.next = hook.schedule.next_step(self, self.loop_step)
                wake = min(wake, hook.next)
        self._wake_step = wake

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
            fire = schedule.should_fire(self)
            hook.next = schedule.next_step(self, step + 1)
        else:
            fire = schedule.should_fire(self)
        if fire:
            self._call(hook, argument)
            schedule.fired(self)

    def _step_hooks(self, metrics: Metrics, step: int) -> None:
        if step >= self._wake_step:
            for hook in self._hooks["OnStep"]:
                if self._rewound:
                    return
                self._visit(hook, metrics, step)
            self._wake_step = min(
                (h.next for h in self._hooks["OnStep"]
                 if h.schedule is not None and not h.schedule.checks_every_step),
                default=NEVER,
            )
        else:
            for hook in self._every_step:
                if self._rewound:
                    return
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

    # -- running --------------------------------------------------------------------------

    def _on_signal(self, signum: int) -> None:
        self.request_stop(f"interrupted by {signal_name(signum)}")

    def _settle(self) -> None:
        """Waits for every step in flight and checks their losses."""
        window = self._in_flight.wait_all()
        if window:
            self._finite.verify(self, window)
        self._finite.raise_failure()
        if self._pending_logs:
            self._resolve_logs(NEVER)

    def _settle_between_steps(self) -> None:
        """`_settle` where no step is half done: a rollback it causes needs no skipping."""
        self._settle()
        self._rewound = False

    @contextlib.contextmanager
    def _run(self, dataset: Dataset, end_step: int) -> Iterator[None]:
        if self._running:
            raise RuntimeError("this Loop is already running; a hook cannot start another run")
        self._running = True
        try:
            with self._interrupts:
                self._start_run(dataset, end_step)
                yield
        except BaseException as error:
            self._in_flight.wait_all()
            self._after_hooks.clear()
            self._pending_logs.clear()
            for hook in self._hooks["OnError"]:
                try:
                    hook.fn(self, error)
                except Exception:  # the run's own error is the one to report
                    _logger.exception("OnError hook %r failed", hook.name)
            raise
        finally:
            self._running = self._scheduling = False
        if self._interrupts.received is not None:
            self._exit_interrupted(self._interrupts.received)

    def _exit_interrupted(self, signum: int) -> None:
        step = self.trainer.global_step
        if self.checkpointed_step == step:
            saved = f"saved checkpoint {step}; run again to resume"
        elif self.checkpointed_step is not None:
            saved = f"the newest checkpoint is {self.checkpointed_step}; run again to resume"
        else:
            saved = "no checkpoint hook is attached, so nothing was saved"
        print(f"interrupted at step {step}; {saved}", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    def _start_run(self, dataset: Dataset, end_step: int) -> None:
        if self._pending_error is not None:
            error, self._pending_error = self._pending_error, None
            raise error
        self.trainer.reset_train_metrics()
        self.run_index += 1
        self.loop_step = self.trainer.global_step
        self.start_step = self.loop_step
        self.end_step = end_step
        self.epoch = 0
        self._stop_requested = False
        self._rewound = False
        self.stop_reason = None
        self.metrics = {}
        self._metrics_step = self.loop_step - 1
        self._run_phase("OnStart", dataset)
        # After the OnStart hooks, which may restore schedule states and the step.
        self._rewound = False
        self.loop_step = self.start_step = self.trainer.global_step
        self._metrics_step = self.loop_step - 1
        self._finite.start_run(self.trainer, self.loop_step)
        for hook in self._scheduled():
            hook.schedule.start_run(self)
        self._reschedule()
        self._scheduling = True

    def _dataset_error(self, dataset: Dataset, err: Exception) -> RuntimeError:
        return RuntimeError(
            f"dataset {getattr(dataset, 'name', dataset)!r} failed at step "
            f"{self.loop_step}: {type(err).__name__}: {err}"
        )

    def _bad_batch(self, dataset: Dataset, batch: Any) -> ValueError:
        size = f"a tuple of {len(batch)} items" if isinstance(batch, tuple) else f"a {type(batch).__name__}"
        return ValueError(
            f"dataset {getattr(dataset, 'name', dataset)!r} yielded {size}; yield_batch() must "
            "return (spec, inputs, labels). For (inputs, labels) pairs return "
            "(None, inputs, labels), or wrap a generator in loopax.IterableDataset, which "
            "accepts both"
        )

    def _train_until(self, dataset: Dataset, stop_step: int) -> bool:
        """Runs steps and their OnStep hooks until `loop_step` reaches `stop_step`, a stop
        is requested, or the dataset ends; returns True if the dataset ended.

        Before returning False it waits for the steps in flight and checks them, and goes
        on if that rolled the run back. The per-step path of every run, kept tight: on a
        small model the loop's own Python shows in the step rate.
        """
        train_step = self.trainer.train_step
        yield_batch = dataset.yield_batch
        push = self._in_flight.push
        record_duration = self.train_step_durations.append
        clock = time.perf_counter
        while True:
            indicator = self._finite.indicator
            while self.loop_step < stop_step and not self._stop_requested:
                started = clock()
                try:
                    batch = yield_batch()
                except StopIteration:
                    return True
                except Exception as err:
                    raise self._dataset_error(dataset, err) from err
                if type(batch) is not tuple or len(batch) != 3:
                    raise self._bad_batch(dataset, batch)
                step = self.loop_step
                metrics = train_step(*batch)
                self.metrics = metrics
                self._metrics_step = step
                self._epoch_batches += 1
                window = push(metrics[indicator], (step, metrics))
                if window is not None:
                    self._finite.verify(self, window)
                    if self._pending_logs:
                        self._resolve_logs(window[-1][0])
                if not self._rewound:
                    self._step_hooks(metrics, step)
                    if self._after_hooks:
                        self._run_after_hooks()
                record_duration(clock() - started)
                if self._rewound:
                    self._rewound = False
                    continue
                self.loop_step = step + 1
            self._settle()
            if not self._rewound:
                return False
            self._rewound = False

    def _end_run(self) -> Metrics:
        self._settle_between_steps()
        self._run_phase("OnEnd", self.metrics)
        return self.metrics

    @staticmethod
    def _check_count(argument: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{argument} must be an int >= 0, got {argument}={value!r}")
        return int(value)

    def run_steps(self, dataset: Dataset, steps: int) -> Metrics:
        """Runs `steps` train steps from the current step; returns the last metrics.

        Raises:
          ValueError: `steps` is negative or not an int, or the dataset yields something
            other than `(spec, inputs, labels)`.
          RuntimeError: the dataset ended before `steps` steps (OnEnd does not run), or
            raised.
          HookError: a hook raised.
          NonFiniteLossError: the loss became NaN or infinite.
        """
        steps = self._check_count("steps", steps)
        if steps == 0:
            return {}
        if self._hooks["OnEpochEnd"] and not self._warned_epoch_hooks:
            self._warned_epoch_hooks = True
            names = [hook.name for hook in self._hooks["OnEpochEnd"]]
            warnings.warn(
                f"hooks {names} run at epoch ends, which only run_epochs has; run_steps "
                "will not call them",
                RuntimeWarning,
                stacklevel=2,
            )
        with self._run(dataset, self.trainer.global_step + steps):
            # A stop requested by an OnStart hook runs no step, as in run_epochs.
            if self._train_until(dataset, self.end_step):
                done = self.loop_step - self.start_step
                raise RuntimeError(
                    f"reached the end of dataset {getattr(dataset, 'name', dataset)!r} after "
                    f"{done} of {steps} steps; use run_epochs or a looping dataset "
                    "(e.g. ArrayDataset(..., loop_forever=True))"
                )
            return self._end_run()

    def run_to_step(self, dataset: Dataset, global_step: int) -> Metrics:
        """Runs the steps left until `trainer.global_step == global_step` (resume-aware).

        Returns the last metrics, or `{}` when the trainer is already there (a warning says
        so when it is past it).

        Raises:
          ValueError: `global_step` is negative or not an int.
        """
        global_step = self._check_count("global_step", global_step)
        remaining = global_step - self.trainer.global_step
        if remaining <= 0:
            if remaining < 0:
                warnings.warn(
                    f"run_to_step({global_step}): the trainer is already at global step "
                    f"{self.trainer.global_step}, past the target; nothing to run",
                    RuntimeWarning,
                    stacklevel=2,
                )
            self.loop_step = self.trainer.global_step
            return {}
        return self.run_steps(dataset, remaining)

    def run_epochs(self, dataset: Dataset, epochs: int) -> Metrics:
        """Runs `epochs` passes over `dataset`; resets it after each epoch.

        The first epoch starts where the dataset is (no reset before it). `end_step` is -1
        until the first epoch ends, then extrapolated from its number of batches.

        Raises:
          ValueError: `epochs` is negative or an epoch yields no batch.
          TypeError: the dataset has no `reset()`.
          HookError, NonFiniteLossError: as `run_steps`.
        """
        epochs = self._check_count("epochs", epochs)
        if not callable(getattr(dataset, "reset", None)):
            raise TypeError(
                f"run_epochs needs a dataset with reset() to start each epoch over, and "
                f"{getattr(dataset, 'name', type(dataset).__name__)!r} has none; add reset(), "
                "or use run_steps"
            )
        with self._run(dataset, -1):
            while self.epoch < epochs and not self._stop_requested:
                self._epoch_batches = 0
                if not self._train_until(dataset, NEVER):
                    break  # a stop was requested
                if self._epoch_batches == 0:
                    raise ValueError(
                        f"dataset {getattr(dataset, 'name', dataset)!r} yielded no batch in "
                        f"epoch {self.epoch}"
                    )
                self.end_step = self.loop_step + self._epoch_batches * (epochs - self.epoch - 1)
                self._settle_between_steps()
                self._reschedule()
                self._run_phase("OnEpochEnd", self.metrics)
                dataset.reset()
                self.epoch += 1
            return self._end_run()

    def __repr__(self) -> str:
        return f"Loop(loop_step={self.loop_step}, end_step={self.end_step}, epoch={self.epoch})"
