"""The `Loop`: runs steps or epochs and fires prioritized hooks."""

from __future__ import annotations

import collections
import contextlib
import logging
import numbers
import sys
import time
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from ..data._datasets import Dataset, bad_batch_error, micro_batch_reader, shown_name
from ..data._iterables import RunIterable, check_restartable
from ..trainer._inflight import InFlight, limit_for
from ..trainer._trainer import Trainer
from ._finite import FiniteChecker, NonFiniteHandler, NonFiniteLossError
from ._fused_loop import FusedRuns
from ._history import History
from ._hook import NEVER
from ._hook_registry import PHASES
from ._loop_metrics import MetricsAccess
from ._signals import Interrupts, signal_name

Metrics = dict[str, Any]
_DURATIONS_KEPT = 1024  # step durations kept for the median: bounded memory on long runs
_logger = logging.getLogger("loopax")

__all__ = ["PHASES", "Loop", "NonFiniteLossError"]


class Loop(FusedRuns, MetricsAccess):
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
        if (
            isinstance(steps_per_execution, bool)
            or not isinstance(steps_per_execution, numbers.Integral)
            or steps_per_execution < 1
        ):
            raise ValueError(
                "steps_per_execution must be a positive int (the most steps per compiled "
                f"call), got {steps_per_execution!r}"
            )
        super().__init__()
        self.trainer = trainer
        self.steps_per_execution = int(steps_per_execution)
        self.loop_step = trainer.global_step
        self.start_step = trainer.global_step
        self.end_step = -1
        self.epoch = 0
        self.run_index = 0
        self.metrics: Metrics = {}
        self._group = None  # the latest fused group (see FusedRuns)
        self.history = History()
        self.shared_data: dict[str, Any] = {}
        self.train_step_durations: collections.deque[float] = collections.deque(
            maxlen=_DURATIONS_KEPT
        )
        self.stop_reason: str | None = None
        self.checkpointed_step: int | None = None
        self._running = False
        self._stop_requested = False
        self._rewound = False
        self._metrics_step = -1
        self._epoch_batches = 0
        self._warned_epoch_hooks = False
        self._pending_error: BaseException | None = None
        self._finite = FiniteChecker()
        self._in_flight = InFlight(limit_for(trainer.num_devices))
        self._interrupts = Interrupts(self._on_signal)
        self._iterable = RunIterable()

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
            self._after_hooks.append(raise_it)
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
        self._evaluations_step = -1
        self._pending_logs = [entry for entry in self._pending_logs if entry[0] < step]
        if self._running:
            self._in_flight.wait_all()
            self._finite.restart(self.trainer, step)
            self.loop_step = step
            self._rewound = True
            for hook in self._scheduled():
                if hook.schedule is not None:  # always: `_scheduled` yields only these
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
        if continuing:
            self._finite.restart(self.trainer, self.loop_step)  # the restored skip count
        for hook in self._scheduled():
            if hook.schedule is not None:  # always: `_scheduled` yields only these
                hook.schedule.start_run(self)
        self._reschedule()
        self._scheduling = True

    def _dataset_error(self, dataset: Dataset, err: Exception) -> RuntimeError:
        return RuntimeError(
            f"dataset {shown_name(dataset)!r} failed at step "
            f"{self.loop_step}: {type(err).__name__}: {err}"
        )

    def _train_until(self, dataset: Dataset, stop_step: int) -> bool:
        """Runs steps and their OnStep hooks; returns True if the dataset ended.

        It runs until `loop_step` reaches `stop_step`, a stop is requested, or the dataset
        ends.

        Before returning False it waits for the steps in flight and checks them, and goes
        on if that rolled the run back. The per-step path of every run, kept tight: on a
        small model the loop's own Python shows in the step rate.
        """
        if self.steps_per_execution > 1:
            return self._train_groups_until(dataset, stop_step)
        train_step = self.trainer.train_step
        micro_batches = self.trainer.accumulate_steps
        yield_batch = (
            dataset.yield_batch
            if micro_batches == 1
            else micro_batch_reader(dataset, micro_batches)
        )
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
                    raise bad_batch_error(dataset, batch)
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
        steps = self._check_count("steps", steps)
        dataset = self._iterable.dataset(dataset, self.trainer)
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
        epochs = self._check_count("epochs", epochs)
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
                self._reschedule()
                self._run_phase("OnEpochEnd", self.metrics)
                dataset.reset()
                self.epoch += 1
            return self._end_run()

    def __repr__(self) -> str:
        return (
            f"Loop(loop_step={self.loop_step}, end_step={self.end_step}, epoch={self.epoch}, "
            f"steps_per_execution={self.steps_per_execution})"
        )
