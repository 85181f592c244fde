"""The runs of a `Loop`: where a run stands, and the steps it reads, runs, checks and hooks."""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from .. import _validate, _warnings
from ..data import Dataset
from ..data._internal import (
    BadBatchError,
    RunIterable,
    StepReader,
    check_restartable,
    power_of_two_at_most,
    shown_name,
)
from ..trainer import Trainer
from ..trainer._internal import InFlight, limit_for
from ._ahead import AheadCompiles
from ._batch_check import HELD_BATCH_BYTES, batches_to_hold
from ._epochs import EpochCount
from ._finite import FiniteChecker, NonFiniteLossError, StepToken
from ._hook import FINISHED, NEVER, Metrics
from ._hook_registry import HookRegistry
from ._loop_metrics import Chunk, GroupMetrics, LoopMetrics, every_step
from ._lost_process import LostProcessWatch
from ._run_stop import RunStop

_logger = logging.getLogger("loopax")
STEP_DURATIONS_KEPT = 1024  # step durations kept for the median: bounded memory on long runs


class RunOwner(Protocol):
    """The loop a `Runner` runs for, as the runner sees it (a `Loop` is one).

    The runner reads these, and hands the object itself to what it calls back: the
    non-finite handler (`Loop.handle_non_finite`) and the lost-process report.

    Attributes:
      trainer: the trainer to run.
      shared_data: hooks' shared dict; its `FINISHED` entry lists the functions to call
        when steps have finished.
      checkpointed_step: the newest global step a checkpoint saved, or None (for the line
        an interrupted run ends with).
    """

    @property
    def trainer(self) -> Trainer: ...
    @property
    def shared_data(self) -> dict[str, Any]: ...
    @property
    def checkpointed_step(self) -> int | None: ...


class Runner:
    """Runs a trainer over a dataset's steps or epochs, one run at a time, firing the hooks.

    The engine of a `Loop` (see there for what a run does). It reads each step, or each
    group of up to `steps_per_execution` fused steps, as dispatches (`StepReader`), runs
    them with `Trainer.run`, bounds the steps in flight, checks every step's loss when it
    waits for it anyway (`FiniteChecker`), hands out the pending logs, and runs the step
    hooks, all in one tail per dispatch.

    Each member changes its own state through its own methods: the runner tells the hooks
    when they halt and when a run's steps start (`HookRegistry.halt`, `start_steps`, ...),
    the finite checker what it checks, the loop metrics which logs to hand out; it writes
    no attribute of theirs.

    Args:
      loop: the loop it runs for (`RunOwner`), which the hooks receive too.
      steps_per_execution: the most steps per compiled call.
      hooks: the loop's hooks.
      loop_metrics: the pending logs to hand out as their steps finish.
      finite: the finite checks of every step's loss.

    Attributes:
      loop_step, start_step, end_step, epoch, run_index, metrics: as in `Loop`, which
        shows them.
      metrics_step: the loop step of `metrics` (-1 before any).
      group: the latest group of fused steps, or None (`steps_per_execution=1`).
      running: whether a run is in progress.
      stop: how the run ends early (`RunStop`): its `requested`, `reason` (the Loop's
        `stop_reason`) and `interrupted`.
      step_durations: seconds per step, hooks included, of the last `STEP_DURATIONS_KEPT`
        steps.
    """

    def __init__(
        self,
        loop: RunOwner,
        steps_per_execution: int,
        hooks: HookRegistry,
        loop_metrics: LoopMetrics,
        finite: FiniteChecker,
    ) -> None:
        trainer = loop.trainer
        self._loop = loop
        self._trainer = trainer
        self._steps_per_execution = steps_per_execution
        self._hooks = hooks
        self._loop_metrics = loop_metrics
        self._finite = finite
        self.step_durations: collections.deque[float] = collections.deque(
            maxlen=STEP_DURATIONS_KEPT
        )
        self.loop_step = trainer.global_step
        self.start_step = trainer.global_step
        self.end_step = -1
        self.epoch = 0
        self.epoch_count = EpochCount()
        self.run_index = 0
        self.metrics: Metrics = {}
        self.metrics_step = -1
        self.group: GroupMetrics | None = None
        self.running = False
        self._epoch_batches = 0
        self._warned_epoch_hooks = False
        self._pending_error: BaseException | None = None
        self._resumed_run: dict[str, int] | None = None  # the run a restored state was in
        self._in_flight = InFlight(limit_for(trainer.devices))
        # Several processes: a process reads the agreed stop at its settle points, which come
        # at most `limit + 1` dispatches apart, and no process runs more than that ahead of
        # another's dispatched steps; twice that, and one, is past any process's first look.
        self.stop = RunStop(trainer, (2 * self._in_flight.limit + 3) * steps_per_execution)
        self._iterable = RunIterable()

    # -- what the loop asks between steps -------------------------------------------------

    def report_error(self, error: BaseException) -> None:
        """Raises `error` after the current step's hooks, or at the next run's start."""

        def raise_it() -> None:
            raise error

        if self.running:
            self._hooks.defer(raise_it)
        else:
            self._pending_error = error

    def call_after_hooks(self, fn: Callable[[], None]) -> None:
        """`Loop.call_after_hooks`: `fn()` after the current phase's hooks; now outside a run."""
        if self.running:
            self._hooks.defer(fn)
        else:
            fn()

    def remember_run(self, run: dict[str, int] | None) -> None:
        """The run (`{"start_step", "end_step"}`) a restored state was saved in, if any."""
        self._resumed_run = run

    def run_state(self) -> dict[str, int] | None:
        """The run in progress `{"start_step", "end_step"}` for a checkpoint; None between runs."""
        if not self.running:
            return None
        return {"start_step": self.start_step, "end_step": self.end_step}

    def group_metrics(self) -> dict[str, Any]:
        """Every step's metrics of the latest group of fused steps; see `Loop.group_metrics`."""
        return every_step(self.group, self.metrics)

    def check_finite(self) -> None:
        """Waits for the steps in flight and checks their losses, unless all are checked."""
        if self._finite.checked_through < self.metrics_step or self._finite.failure:
            self._settle()

    def rewind(self, step: int) -> None:
        """Continues from loop step `step`: inside a run, drops the steps in flight."""
        if not self.running:
            self.loop_step = self.start_step = step
            return
        self._in_flight.wait_all()
        self._finite.restart(self._trainer, step)
        self.loop_step = step
        self._hooks.halt()  # the step's hooks stop; the run goes on from `step`
        self._hooks.restart_schedules()

    # -- runs -----------------------------------------------------------------------------

    def steps(self, dataset: Dataset | Iterable[Any], steps: int) -> Metrics:
        """`Loop.run_steps`."""
        steps = _validate.non_negative_int("steps", steps)
        dataset = self._iterable.dataset(dataset, self._trainer)
        if steps == 0:
            return {}
        epoch_hooks = self._hooks.of("OnEpochEnd")
        if epoch_hooks and not self._warned_epoch_hooks:
            self._warned_epoch_hooks = True
            _warnings.warn(
                f"hooks {[hook.name for hook in epoch_hooks]} run at epoch ends, which only "
                "run_epochs has; run_steps will not call them"
            )
        with self._run(dataset, self._trainer.global_step + steps):
            # A stop requested by an OnStart hook runs no step, as in run_epochs.
            if self._train_until(dataset, self.end_step):
                done = self.loop_step - self.start_step
                raise RuntimeError(
                    f"reached the end of dataset {shown_name(dataset)!r} after "
                    f"{done} of {steps} steps; use run_epochs or a looping dataset "
                    "(e.g. ArrayDataset(..., loop_forever=True))"
                )
            return self._end_run()

    def to_step(self, dataset: Dataset | Iterable[Any], global_step: int) -> Metrics:
        """`Loop.run_to_step`."""
        global_step = _validate.non_negative_int("global_step", global_step)
        remaining = global_step - self._trainer.global_step
        if remaining <= 0:
            if remaining < 0:
                _warnings.warn(
                    f"run_to_step({global_step}): the trainer is already at global step "
                    f"{self._trainer.global_step}, past the target; nothing to run"
                )
            self.loop_step = self._trainer.global_step
            return {}
        return self.steps(dataset, remaining)

    def epochs(self, dataset: Dataset | Iterable[Any], epochs: int, total: bool = False) -> Metrics:
        """`Loop.run_epochs`; with `total`, `Loop.run_to_epoch` (`epoch_count`: in total)."""
        epochs = _validate.non_negative_int("epochs", epochs)
        dataset = self._iterable.dataset(dataset, self._trainer)
        check_restartable(dataset, "run_to_epoch" if total else "run_epochs")
        with self._run(dataset, -1, epochs if total else None):
            self.epoch_count.first_start(self.loop_step)  # a restored epoch's, or here
            # A position restored from a save at an epoch's end (every_n_epochs) is at the
            # end of its data: the run starts with the next pass, not with an empty one.
            at_end_of_pass = True
            while self.epoch < epochs and not self.stop.here(self.loop_step):
                self._epoch_batches = 0
                if not self._train_until(dataset, NEVER):
                    break  # a stop was requested
                if self._epoch_batches == 0 and at_end_of_pass:
                    at_end_of_pass = False
                    dataset.reset()
                    continue
                at_end_of_pass = False
                if self._epoch_batches == 0:
                    raise ValueError(
                        f"dataset {shown_name(dataset)!r} yielded no batch in epoch {self.epoch}"
                    )
                self.end_step = self.epoch_count.finish(self.loop_step, epochs - self.epoch - 1)
                self._settle_between_steps()
                self._hooks.reschedule()
                self.run_phase("OnEpochEnd", self.metrics)
                dataset.reset()
                self.epoch += 1
            return self._end_run()

    def run_phase(self, phase: str, argument: Any) -> None:
        """Runs the hooks of `phase`, then what they deferred to after the hooks."""
        self._hooks.run_phase(phase, argument)
        # OnEvaluation and OnRestore run inside other phases, which run `call_after_hooks`.
        if self._hooks.after_hooks and phase in ("OnStart", "OnEpochEnd", "OnEnd"):
            self._run_after_hooks()

    def _run_after_hooks(self) -> None:
        # What runs after the hooks (a checkpoint commit, a final flush) sees every log.
        self._loop_metrics.resolve_logs(NEVER)
        self._hooks.run_after_hooks()

    def _settle(self) -> None:
        """Waits for every step in flight and checks their losses."""
        window = self._in_flight.wait_all()
        if window:
            for watch in self._loop.shared_data.get(FINISHED, ()):
                watch(self._in_flight.finished.last_step)
            if self._loop_metrics.pending_logs:  # the check and the logs: one wait
                self._loop_metrics.start_reads(NEVER, self._finite.sentinel_of(window))
            self._finite.verify(self._loop, window)
        self._finite.raise_failure()
        if self._loop_metrics.pending_logs:
            self._loop_metrics.resolve_logs(NEVER)
        self.stop.poll(self.loop_step)  # several processes: a stop agreed on

    def _settle_between_steps(self) -> None:
        """`_settle` where no step is half done: a rollback it causes needs no skipping."""
        self._settle()
        self._hooks.resume()

    @contextlib.contextmanager
    def _run(self, dataset: Dataset, end_step: int, end_epoch: int | None = None) -> Iterator[None]:
        if self.running:
            raise RuntimeError("this Loop is already running; a hook cannot start another run")
        interrupts = self.stop.open()
        self.running = True
        # Several processes: one that stops answering ends the others, even inside a collective.
        with LostProcessWatch.for_run(self._trainer.devices, self._loop):
            try:
                with interrupts:
                    self._start_run(dataset, end_step, end_epoch)
                    yield
            except BaseException as error:
                self._in_flight.wait_all()
                self._hooks.drop_deferred()
                self._hand_out_logs_at(error)
                self._hooks.run_error(error)
                raise
            finally:
                self.running = False
                self._hooks.end_steps()
                self.epoch_count.end_run()
                agreed = self.stop.close()
        self.stop.exit_if_signaled(agreed, self.loop_step, self._loop.checkpointed_step)

    def _hand_out_logs_at(self, error: BaseException) -> None:
        """The train logs asked for before `error`: handed out, or dropped.

        Those of the steps checked finite are handed out, so that a checkpoint the OnError
        hooks commit (its step was checked before it was taken) finds its step's logs
        written, as without the error; the rest are dropped, and all of them when the error
        is a non-finite loss or tears the run down. A writer failing again is logged.
        """
        if isinstance(error, Exception) and not isinstance(error, NonFiniteLossError):
            try:
                self._loop_metrics.resolve_logs(self._finite.checked_through)
            except Exception:
                _logger.exception("writing the train logs of the steps before the error failed")
        self._loop_metrics.drop_logs()

    def _start_run(self, dataset: Dataset, end_step: int, end_epoch: int | None) -> None:
        if self._pending_error is not None:
            error, self._pending_error = self._pending_error, None
            raise error
        trainer = self._trainer
        # A run that goes on with a restored checkpoint's run (the same end, a step inside
        # it) keeps the train metrics' averages the checkpoint holds, as the uninterrupted
        # run did; any other run starts them afresh.
        resumed, self._resumed_run = self._resumed_run, None
        self.epoch = self.epoch_count.begin(end_epoch)  # run_to_epoch: counted in total
        continuing = self.epoch_count.continues(resumed, trainer.global_step, end_step)
        if not continuing:
            trainer.reset_train_metrics()
        self.run_index += 1
        self.loop_step = self.start_step = trainer.global_step
        self.end_step = self.epoch_count.end_step(resumed, continuing, end_step)
        self.stop.start_run()
        self._hooks.resume()
        self.metrics = {}
        self.metrics_step = self.loop_step - 1
        self.run_phase("OnStart", dataset)
        # After the OnStart hooks, which may restore schedule states and the step.
        self._hooks.resume()
        self.loop_step = self.start_step = trainer.global_step
        self.metrics_step = self.loop_step - 1
        self._finite.start_run(trainer, self.loop_step)
        if continuing:
            self._finite.restart(trainer, self.loop_step)  # the restored skip count
        self._hooks.start_steps()

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
        trainer, hooks, per_execution = self._trainer, self._hooks, self._steps_per_execution
        one_step = per_execution == 1
        read = StepReader(dataset, per_execution, trainer.accumulate_steps, trainer.gathers_on).read
        run = trainer.run
        loop_metrics = self._loop_metrics
        push = self._in_flight.push
        # The bytes of a turn's batches held until their losses are checked.
        turn_budget = HELD_BATCH_BYTES // self._in_flight.limit
        record_duration = self.step_durations.append
        clock = time.perf_counter
        stop = self.stop
        agreement = stop.agreement
        ahead = AheadCompiles(self._trainer, per_execution)
        while True:
            sentinel = self._finite.sentinel_metric  # its newest value flags a bad window
            if agreement is not None:  # several processes: not past a stop they agreed on
                stop_step = stop.agreed_stop_step(self.loop_step - 1, stop_step)
            while self.loop_step < stop_step and not stop.requested:
                started = clock()
                first = self.loop_step
                # A group stops at the run's stop or after the next step a hook fires at.
                group_stop = min(stop_step, hooks.exact_wake_step + 1)
                try:
                    dispatches, ended = read(
                        1
                        if one_step
                        else power_of_two_at_most(max(min(per_execution, group_stop - first), 1))
                    )
                except StopIteration:
                    return True
                except BadBatchError:
                    raise
                except Exception as err:
                    raise RuntimeError(
                        f"dataset {shown_name(dataset)!r} failed at step {first} (global "
                        f"step {first + 1}): {type(err).__name__}: {err}"
                    ) from err
                if one_step:
                    metrics, _ = run(dispatches[0])
                    last, count = first, 1
                else:
                    ahead.before_group(dispatches, first, group_stop)
                    parts = []
                    last = first - 1
                    for dispatch in dispatches:
                        result = run(dispatch)
                        parts.append(Chunk(last + 1, dispatch.count, result.stacked, result.last))
                        last += dispatch.count
                    metrics = self.group = GroupMetrics(parts[-1].last, parts)
                    count = last - first + 1
                # The one tail of every dispatch: the window, the checks, the hooks.
                self.metrics = metrics
                self.metrics_step = last
                self._epoch_batches += count
                window = push(
                    metrics[sentinel],
                    StepToken(last, metrics, batches_to_hold(dispatches, turn_budget)),
                )
                if window is not None:
                    # The window's steps have finished: its check reads one value, and the
                    # logs due with it are read in the same wait for the device.
                    for watch in self._loop.shared_data.get(FINISHED, ()):
                        watch(self._in_flight.finished.last_step)
                    if loop_metrics.pending_logs:
                        loop_metrics.start_reads(
                            window[-1].last_step, self._finite.sentinel_of(window)
                        )
                    self._finite.verify(self._loop, window)
                    if loop_metrics.pending_logs:
                        loop_metrics.resolve_logs(window[-1].last_step)
                    if agreement is not None:  # several processes: a settle point
                        stop_step = stop.agreed_stop_step(last, stop_step)
                if not hooks.halted:
                    self.loop_step = last
                    if last >= hooks.call_step:  # else no hook is due: not even a call
                        hooks.step_hooks(metrics, last)
                    if hooks.after_hooks:
                        self._run_after_hooks()
                record_duration((clock() - started) / count)
                if hooks.halted:
                    hooks.resume()
                    continue
                self.loop_step = last + 1
                if ended:
                    return True
            self._settle()
            if hooks.halted:
                hooks.resume()
                continue
            # Several processes: a stop asked, not at its agreed step yet, goes on to it.
            if agreement is None or stop.here(self.loop_step) or self.loop_step >= stop_step:
                return False

    def _end_run(self) -> Metrics:
        self._settle_between_steps()
        self.stop.end(self.loop_step, self.end_step)
        self.run_phase("OnEnd", self.metrics)
        return self.metrics
