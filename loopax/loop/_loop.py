"""The `Loop`: runs steps or epochs and fires prioritized hooks."""

from __future__ import annotations

import collections
import contextlib
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .. import _validate
from ..data._datasets import BadBatchError, Dataset, shown_name
from ..data._iterables import RunIterable, check_restartable
from ..data._reader import StepReader, power_of_two_at_most
from ..trainer._inflight import InFlight, limit_for
from ..trainer._trainer import Trainer
from ._finite import FiniteChecker, NonFiniteHandler, NonFiniteLossError
from ._history import Evaluation, History
from ._hook import NEVER, Hook, Schedule
from ._hook_registry import PHASES, HookRegistry
from ._loop_metrics import GroupMetrics, LogFn, LoopMetrics
from ._signals import Interrupts, exit_interrupted, signal_name

Metrics = dict[str, Any]
_DURATIONS_KEPT = 1024  # step durations kept for the median: bounded memory on long runs

__all__ = ["PHASES", "Loop", "NonFiniteLossError"]


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

    Fused execution (`steps_per_execution=K > 1`): the loop reads up to K steps' batches,
    stacks them and runs them in one compiled program (`Trainer.train_steps`), with the
    same results as K single steps. Step-based schedules keep their steps exactly: a group
    ends early at the next step a scheduled hook (`every_n_steps`, `n_times_during_loop`,
    `exponential_callback`, checkpoint and evaluation schedules, ...) fires at, and group
    lengths are powers of two, so a spec and shape compile at most log2(K) + 1 programs.
    Hooks asked every step (a plain `on_step`, a progress bar) and time-based schedules run
    once per group, at its last step, with its metrics; `group_metrics` holds every step's.
    `request_stop` ends the run at the end of the group. The first non-finite loss inside a
    group is still named. Checkpoints fall on group ends, and a run resumed with another K
    continues identically.

    Args:
      trainer: the `Trainer` to run.
      steps_per_execution: K, the most steps per compiled call (1: one step per call).

    Attributes:
      trainer: the trainer.
      loop_step: the step being run (starts at `trainer.global_step`).
      start_step: the first step of the current run.
      end_step: one past the last step of the run; -1 while unknown during the first
        epoch of `run_epochs`.
      epoch: the current epoch of `run_epochs` (0-based).
      run_index: incremented at the start of every run (hooks use it to spot a new run).
      metrics: the latest step's metrics, on the device.
      steps_per_execution: the most steps per compiled call.
      history: the `History` of every logged metric (`"train/<m>"`, `"eval/<ds>/<m>"`).
      shared_data: a dict where hooks leave results for each other.
      train_step_durations: seconds per step, hooks included (the last 1024 steps).
      stop_reason: the reason given to `request_stop`, or None.
      checkpointed_step: the newest global step a checkpoint hook saved, or None.

    Example:
      >>> import jax, numpy as np, optax, flax.linen as nn, loopax
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

    def __init__(self, trainer: Trainer, steps_per_execution: int = 1):
        if not isinstance(trainer, Trainer):
            raise TypeError(f"Loop needs a loopax.Trainer, got {type(trainer).__name__}")
        self.trainer = trainer
        self.steps_per_execution = _validate.positive_int(
            "steps_per_execution", steps_per_execution
        )
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
        self._group: GroupMetrics | None = None  # the latest group of fused steps
        self._running = False
        self._stop_requested = False
        self._metrics_step = -1
        self._epoch_batches = 0
        self._warned_epoch_hooks = False
        self._pending_error: BaseException | None = None
        self._resumed_run: dict[str, int] | None = None  # the run a restored state was in
        self._hooks = HookRegistry(self, self, self._before_hook)
        self._loop_metrics = LoopMetrics(trainer, self.history, self._publish)
        self._finite = FiniteChecker()
        self._in_flight = InFlight(limit_for(trainer.num_devices))
        self._interrupts = Interrupts(self._on_signal)
        self._iterable = RunIterable()

    # -- hooks ----------------------------------------------------------------------------

    def on_start(self, name: str, fn: Callable[[Loop, Dataset], Any], priority: int = 0) -> Hook:
        """Registers `fn(loop, dataset)` to run at the start of every run."""
        return self._hooks.register("OnStart", name, fn, priority)

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
        return self._hooks.register("OnStep", name, fn, priority, when, check_finite)

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
        return self._hooks.register("OnEpochEnd", name, fn, priority, when, check_finite)

    def on_end(
        self,
        name: str,
        fn: Callable[[Loop, Metrics], Any],
        priority: int = 0,
        *,
        check_finite: bool | None = None,
    ) -> Hook:
        """Registers `fn(loop, metrics)` to run at the end of a run (the last metrics)."""
        return self._hooks.register("OnEnd", name, fn, priority, None, check_finite)

    def on_evaluation(
        self, name: str, fn: Callable[[Loop, Evaluation], Any], priority: int = 0
    ) -> Hook:
        """Registers `fn(loop, evaluation)` to run for every `Evaluation` of `loop.evaluate`.

        `loop.evaluate` publishes one per dataset and global step.
        """
        return self._hooks.register("OnEvaluation", name, fn, priority)

    def on_restore(self, name: str, fn: Callable[[Loop, int], Any], priority: int = 0) -> Hook:
        """Registers `fn(loop, step)` to run whenever the training continues from an earlier `step`.

        `step` is a global step (`resume_from`: a checkpoint restore or a rollback); writers drop
        what they wrote after `step` there.
        """
        return self._hooks.register("OnRestore", name, fn, priority)

    def on_flush(
        self, name: str, fn: Callable[[Loop, None], Callable[[], None] | None], priority: int = 0
    ) -> Hook:
        """Registers `fn(loop, None)` to run when `loop.flush()` is called.

        `loop.flush()` runs before every checkpoint commit: `fn` starts writing out what its output
        holds and may return a function that waits until that is on disk.
        """
        return self._hooks.register("OnFlush", name, fn, priority)

    def on_error(
        self, name: str, fn: Callable[[Loop, BaseException], Any], priority: int = 0
    ) -> Hook:
        """Registers `fn(loop, error)` to run when a run raises.

        Its own errors are logged, and the run's error propagates; e.g. to wait for saves in flight.
        """
        return self._hooks.register("OnError", name, fn, priority)

    def hooks(self, phase: str) -> list[tuple[int, str]]:
        """The `(priority, name)` of the hooks of `phase` (one of `PHASES`) in run order."""
        return [(h.priority, h.name) for h in self._hooks.of(phase)]

    def call_after_hooks(self, fn: Callable[[], None]) -> None:
        """Runs `fn()` once the hooks of the current phase have all run.

        That is, this step's OnStep hooks, or the OnEnd hooks; at once outside a run. A checkpoint
        commits there, after the logs of its step are written.
        """
        if self._running:
            self._hooks.after_hooks.append(fn)
        else:
            fn()

    # -- state that checkpoints carry -----------------------------------------------------

    def add_state(self, name: str, obj: Any) -> str:
        """Registers `obj` so that checkpoints save and restore it with the loop.

        `obj` has `get_state() -> dict` and `set_state(dict)`. Returns the name it is kept under
        (`name`, or `name#2`, ... when taken). A state saved under that name and not applied yet is
        applied now.
        """
        return self._hooks.add_state(name, obj)

    def get_state(self) -> dict[str, Any]:
        """The loop's resumable state (JSON-serializable).

        It holds the history, every state registered with `add_state` (trigger schedules, early
        stopping, ...), and the run in progress (so that resuming it continues its train metrics'
        averages).
        """
        return {
            "history": self.history.get_state(),
            "hooks": self._hooks.get_states(),
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
        self._hooks.set_states(state.get("hooks", {}))

    # -- metrics --------------------------------------------------------------------------

    def host_metrics(self) -> dict[str, float]:
        """The latest step's metrics as Python floats (it waits for that step).

        Read from the device at most once per step, however many hooks ask.
        """
        return self._loop_metrics.host(self.metrics, self._metrics_step)

    def record_train_metrics(self) -> dict[str, float]:
        """Records the latest step's metrics in `history`; returns them keyed `"train/<metric>"`.

        Reads them as `host_metrics` does and records them at their global step. Writers
        call it on the steps they log.
        """
        return self._loop_metrics.record(self.metrics, self._metrics_step)

    def log_train_metrics(self, fn: LogFn, extra: dict[str, Any] | None = None) -> None:
        """Logs the latest step's train metrics without waiting for the device.

        Once the step has finished (when the loop next waits for it anyway: at most one
        in-flight window later, or at the latest at `check_finite`, `flush` or the end of
        the run) its metrics are read (once, however many writers asked), recorded in
        `history` at their global step, and `fn(global_step, values)` is called with
        `values` keyed `"train/<metric>"`, plus this caller's `extra` (`{key: device
        scalar}`, e.g. the learning rate), read at the same time and recorded too.
        """
        self._loop_metrics.log(self.metrics, self._metrics_step, fn, extra)
        if not self._running:
            self._loop_metrics.resolve_logs(NEVER)

    def flush(self) -> Callable[[], None]:
        """Hands the pending train logs to their writers and asks every output to write out.

        The outputs are the OnFlush hooks. Returns a function that waits until all of it is
        on disk.

        A checkpoint calls it after the hooks of the step it saves and waits before it
        commits, so that a resumed run's logs hold every point up to the checkpoint.
        """
        self._loop_metrics.resolve_logs(NEVER)
        waiters = self._hooks.run_flush()

        def wait() -> None:
            for waiter in waiters:
                waiter()

        return wait

    def evaluate(self, dataset: Dataset) -> Evaluation:
        """Evaluates `dataset` at the current global step, once.

        A second call at the same step returns the same `Evaluation`. A new evaluation is
        recorded in `history` (`"eval/<dataset>/<metric>"`) and published to the
        OnEvaluation hooks.

        Raises:
          ValueError: the dataset has no non-empty str `name`.
        """
        return self._loop_metrics.evaluate(dataset)

    def evaluation(self, dataset: str) -> Evaluation | None:
        """The evaluation of dataset `dataset` (a name) at the current global step, if any."""
        return self._loop_metrics.evaluation(dataset)

    @property
    def group_metrics(self) -> dict[str, Any]:
        """Every step's metrics of the latest group of fused steps.

        `{name: values with a leading axis of the group's steps}` on the device, the last
        step's values last (with `steps_per_execution=1`: the latest step's, axis of 1).
        A host metric's entry is its value after the group. The group's first loop step is
        `loop_step - len(values) + 1` while OnStep hooks run.
        """
        if self._group is None:
            import jax.numpy as jnp  # noqa: PLC0415

            return {key: jnp.asarray(value)[None] for key, value in self.metrics.items()}
        return self._group.every_step()

    # -- what hooks ask of the loop -------------------------------------------------------

    @property
    def running(self) -> bool:
        """Whether a run (`run_steps`, `run_epochs`) is in progress."""
        return self._running

    def report_error(self, error: BaseException) -> None:
        """Makes the run raise `error` once the current step's hooks have run.

        Safe to call from another thread (e.g. a background save that failed). Outside a
        run, the next run raises it at its start.
        """

        def raise_it() -> None:
            raise error

        if self._running:
            self._hooks.after_hooks.append(raise_it)
        else:
            self._pending_error = error

    def request_stop(self, reason: str = "") -> None:
        """Ends the run after the current step's hooks; OnEnd hooks still run."""
        self._stop_requested = True
        self.stop_reason = reason

    def handle_non_finite(self, fn: NonFiniteHandler | None) -> None:
        """Makes `fn(loop, steps)` handle the steps the trainer skipped, instead of a warning.

        Those are the steps skipped for a non-finite loss or gradient
        (`Trainer.skip_non_finite_steps`). None removes `fn`. `hooks.nan_guard` sets it.
        """
        self._finite.handler = fn

    def check_finite(self) -> None:
        """Waits for the steps in flight and checks their losses.

        Raises:
          NonFiniteLossError: naming the first step whose loss is NaN or infinite.
        """
        if self._finite.checked_through < self._metrics_step or self._finite.failure:
            self._settle()

    def resume_from(self, step: int, state: dict[str, Any] | None = None) -> None:
        """Continues from global step `step`, to which the trainer's state was just set.

        The state was set by a checkpoint restore, or by a rollback inside a run.

        Drops the history after `step`, applies the loop `state` (from `get_state`), and
        runs the OnRestore hooks. Inside a run, the steps in flight are dropped and the run
        continues at `step` (its end stays where it was).
        """
        step = int(step)
        self.history.truncate_after(step)
        if state is not None:
            self.set_state(state)
        self._loop_metrics.forget_from(step)
        if self._running:
            self._in_flight.wait_all()
            self._finite.restart(self.trainer, step)
            self.loop_step = step
            self._hooks.halted = True  # the step's hooks stop; the loop goes on from `step`
            for schedule in self._hooks.schedules():
                schedule.restart(self)
            self._hooks.reschedule()
        else:
            self.loop_step = self.start_step = step
        self._run_phase("OnRestore", step)

    def median_train_step_duration(self) -> float:
        """The median step duration in seconds (hooks included); 1 ms with no steps."""
        if not self.train_step_durations:
            return 1e-3
        ordered = sorted(self.train_step_durations)
        return ordered[len(ordered) // 2]

    # -- running --------------------------------------------------------------------------

    def _before_hook(self, hook: Hook) -> None:
        """Before a hook registered with `check_finite`: the check (which may roll back)."""
        del hook
        self.check_finite()

    def _publish(self, evaluation: Evaluation) -> None:
        self._hooks.run_phase("OnEvaluation", evaluation)

    def _run_phase(self, phase: str, argument: Any) -> None:
        self._hooks.run_phase(phase, argument)
        # OnEvaluation and OnRestore run inside other phases, which run `call_after_hooks`.
        if self._hooks.after_hooks and phase in ("OnStart", "OnEpochEnd", "OnEnd"):
            self._run_after_hooks()

    def _run_after_hooks(self) -> None:
        # What runs after the hooks (a checkpoint commit, a final flush) sees every log.
        self._loop_metrics.resolve_logs(NEVER)
        self._hooks.run_after_hooks()

    def _on_signal(self, signum: int) -> None:
        self.request_stop(f"interrupted by {signal_name(signum)}")

    def _settle(self) -> None:
        """Waits for every step in flight and checks their losses."""
        window = self._in_flight.wait_all()
        if window:
            self._finite.verify(self, window)
        self._finite.raise_failure()
        if self._loop_metrics.pending_logs:
            self._loop_metrics.resolve_logs(NEVER)

    def _settle_between_steps(self) -> None:
        """`_settle` where no step is half done: a rollback it causes needs no skipping."""
        self._settle()
        self._hooks.halted = False

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
            self._hooks.after_hooks.clear()
            self._loop_metrics.pending_logs.clear()
            self._hooks.run_error(error)
            raise
        finally:
            self._running = self._hooks.scheduling = False
        if self._interrupts.received is not None:
            exit_interrupted(
                self._interrupts.received, self.trainer.global_step, self.checkpointed_step
            )

    def _start_run(self, dataset: Dataset, end_step: int) -> None:
        if self._pending_error is not None:
            error, self._pending_error = self._pending_error, None
            raise error
        # A run that goes on with a restored checkpoint's run (the same end, a step inside
        # it) keeps the train metrics' averages the checkpoint holds, as the uninterrupted
        # run did; any other run starts them afresh.
        resumed, self._resumed_run = self._resumed_run, None
        continuing = (
            resumed is not None
            and 0 <= resumed["start_step"] <= self.trainer.global_step < end_step
            and resumed["end_step"] == end_step
        )
        if not continuing:
            self.trainer.reset_train_metrics()
        self.run_index += 1
        self.loop_step = self.trainer.global_step
        self.start_step = self.loop_step
        self.end_step = end_step
        self.epoch = 0
        self._stop_requested = False
        self._hooks.halted = False
        self.stop_reason = None
        self.metrics = {}
        self._metrics_step = self.loop_step - 1
        self._run_phase("OnStart", dataset)
        # After the OnStart hooks, which may restore schedule states and the step.
        self._hooks.halted = False
        self.loop_step = self.start_step = self.trainer.global_step
        self._metrics_step = self.loop_step - 1
        self._finite.start_run(self.trainer, self.loop_step)
        if continuing:
            self._finite.restart(self.trainer, self.loop_step)  # the restored skip count
        for schedule in self._hooks.schedules():
            schedule.start_run(self)
        self._hooks.reschedule()
        self._hooks.scheduling = True

    def _train_until(self, dataset: Dataset, stop_step: int) -> bool:
        """Runs steps and their OnStep hooks; returns True if the dataset ended.

        It runs until `loop_step` reaches `stop_step`, a stop is requested, or the dataset
        ends. Each read is one step, or with fused execution a group of up to
        `steps_per_execution` steps, which ends early at the next step a step-scheduled
        OnStep hook fires at (`exact_wake_step`: a clock's fires at group ends), at
        `stop_step`, or where the dataset ends; OnStep hooks run once, at its last step.

        Before returning False it waits for the steps in flight and checks them, and goes
        on if that rolled the run back. The per-step path of every run, kept tight: on a
        small model the loop's own Python shows in the step rate.
        """
        trainer, hooks = self.trainer, self._hooks
        most = self.steps_per_execution
        one_step = most == 1
        read = StepReader(dataset, most, trainer.accumulate_steps, trainer.gathers_on).read
        run = trainer.run
        loop_metrics = self._loop_metrics
        push = self._in_flight.push
        record_duration = self.train_step_durations.append
        clock = time.perf_counter
        while True:
            indicator = self._finite.indicator
            while self.loop_step < stop_step and not self._stop_requested:
                started = clock()
                first = self.loop_step
                try:
                    dispatches, ended = read(
                        1
                        if one_step
                        else power_of_two_at_most(
                            max(min(most, stop_step - first, hooks.exact_wake_step - first + 1), 1)
                        )
                    )
                except (StopIteration, BadBatchError) as err:
                    if isinstance(err, StopIteration):
                        return True
                    raise
                except Exception as err:
                    raise RuntimeError(
                        f"dataset {shown_name(dataset)!r} failed at step "
                        f"{self.loop_step}: {type(err).__name__}: {err}"
                    ) from err
                if one_step:
                    metrics, _ = run(dispatches[0])
                    last = first
                else:
                    parts = []
                    last = first - 1
                    for dispatch in dispatches:
                        result = run(dispatch)
                        parts.append((last + 1, dispatch.count, result.stacked, result.last))
                        last += dispatch.count
                    metrics = self._group = GroupMetrics(parts[-1][3], parts)
                # The tail of every dispatch: the window, the checks, the hooks.
                self.metrics = metrics
                self._metrics_step = last
                self._epoch_batches += last - first + 1
                window = push(metrics[indicator], (last, metrics))
                if window is not None:
                    self._finite.verify(self, window)
                    if loop_metrics.pending_logs:
                        loop_metrics.resolve_logs(window[-1][0])
                if not hooks.halted:
                    self.loop_step = last
                    hooks.step_hooks(metrics, last)
                    if hooks.after_hooks:
                        self._run_after_hooks()
                record_duration((clock() - started) / (last - first + 1))
                if hooks.halted:
                    hooks.halted = False
                    continue
                self.loop_step = last + 1
                if ended:
                    return True
            self._settle()
            if not hooks.halted:
                return False
            hooks.halted = False

    def _end_run(self) -> Metrics:
        self._settle_between_steps()
        self._run_phase("OnEnd", self.metrics)
        return self.metrics

    def run_steps(self, dataset: Dataset | Iterable[Any], steps: int) -> Metrics:
        """Runs `steps` train steps from the current step; returns the last metrics.

        `dataset` is a `Dataset` or any iterable of batches (a list, a generator, a grain
        `MapDataset`, `IterDataset` or `DataLoader`), read as an `IterableDataset` named
        "train": the next run on the same object goes on where this one stopped, and a
        checkpoint saves a grain iterator's position. With `Trainer(accumulate_steps=K)`
        a step is one optimizer step over K batches, stacked (see `Trainer`).

        Raises:
          TypeError: `dataset` is neither a `Dataset` nor an iterable.
          ValueError: `steps` is negative or not an int, the dataset yields something
            other than `(spec, inputs, labels)`, or (accumulating) batches of one step
            with different shapes.
          RuntimeError: the dataset ended before `steps` steps (OnEnd does not run), or
            raised.
          HookError: a hook raised.
          NonFiniteLossError: the loss became NaN or infinite.
        """
        steps = _validate.non_negative_int("steps", steps)
        dataset = self._iterable.dataset(dataset, self.trainer)
        if steps == 0:
            return {}
        if self._hooks.of("OnEpochEnd") and not self._warned_epoch_hooks:
            self._warned_epoch_hooks = True
            names = [hook.name for hook in self._hooks.of("OnEpochEnd")]
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
                    f"reached the end of dataset {shown_name(dataset)!r} after "
                    f"{done} of {steps} steps; use run_epochs or a looping dataset "
                    "(e.g. ArrayDataset(..., loop_forever=True))"
                )
            return self._end_run()

    def run_to_step(self, dataset: Dataset | Iterable[Any], global_step: int) -> Metrics:
        """Runs the steps left until `trainer.global_step == global_step` (resume-aware).

        Returns the last metrics, or `{}` when the trainer is already there (a warning says
        so when it is past it). `dataset` as for `run_steps`.

        Raises:
          ValueError: `global_step` is negative or not an int.
        """
        global_step = _validate.non_negative_int("global_step", global_step)
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

    def run_epochs(self, dataset: Dataset | Iterable[Any], epochs: int) -> Metrics:
        """Runs `epochs` passes over `dataset`; resets it after each epoch.

        The first epoch starts where the dataset is (no reset before it). `end_step` is -1
        until the first epoch ends, then extrapolated from its number of batches. `dataset`
        as for `run_steps`, but not an iterator (a generator), which cannot start over.

        Raises:
          ValueError: `epochs` is negative or an epoch yields no batch.
          TypeError: the dataset has no `reset()`, or is an iterator.
          HookError, NonFiniteLossError: as `run_steps`.
        """
        epochs = _validate.non_negative_int("epochs", epochs)
        dataset = self._iterable.dataset(dataset, self.trainer)
        check_restartable(dataset, "run_epochs")
        with self._run(dataset, -1):
            while self.epoch < epochs and not self._stop_requested:
                self._epoch_batches = 0
                if not self._train_until(dataset, NEVER):
                    break  # a stop was requested
                if self._epoch_batches == 0:
                    raise ValueError(
                        f"dataset {shown_name(dataset)!r} yielded no batch in epoch {self.epoch}"
                    )
                self.end_step = self.loop_step + self._epoch_batches * (epochs - self.epoch - 1)
                self._settle_between_steps()
                self._hooks.reschedule()
                self._run_phase("OnEpochEnd", self.metrics)
                dataset.reset()
                self.epoch += 1
            return self._end_run()

    def __repr__(self) -> str:
        return (
            f"Loop(loop_step={self.loop_step}, end_step={self.end_step}, epoch={self.epoch}, "
            f"steps_per_execution={self.steps_per_execution})"
        )
