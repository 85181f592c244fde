"""The runs of a `Loop`: where a run stands, and the steps it reads, runs, checks and hooks."""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

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
from ._batch_check import HELD_BYTES, kept
from ._epochs import EpochCount
from ._finite import FiniteChecker, NonFiniteLossError, StepToken
from ._hook import FINISHED, NEVER
from ._hook_registry import HookRegistry
from ._loop_metrics import Chunk, GroupMetrics, LoopMetrics, every_step
from ._lost_process import LostProcessWatch
from ._signals import Interrupts, exit_interrupted, signal_name
from ._stop_agreement import AgreedStop, StopAgreement

Metrics = dict[str, Any]
_logger = logging.getLogger("loopax")


class Runner:
    """Runs a trainer over a dataset's steps or epochs, one run at a time, firing the hooks.

    The engine of a `Loop` (see there for what a run does). It reads each step, or each
    group of up to `steps_per_execution` fused steps, as dispatches (`StepReader`), runs
    them with `Trainer.run`, bounds the steps in flight, checks every step's loss when it
    waits for it anyway (`FiniteChecker`), hands out the pending logs, and runs the step
    hooks, all in one tail per dispatch.

    Args:
      trainer: the `Trainer` to run.
      steps_per_execution: the most steps per compiled call.
      hooks: the hooks to run; their first argument is `owner`.
      loop_metrics: the pending logs to hand out as their steps finish.
      finite: the finite checks of every step's loss.
      owner: the object hooks and non-finite handlers receive (the loop).
      durations: where each step's duration is appended.
      checkpointed_step: the newest global step a checkpoint saved, or None (for the line
        an interrupted run ends with).

    Attributes:
      loop_step, start_step, end_step, epoch, run_index, metrics, stop_reason: as in
        `Loop`, which shows them.
      metrics_step: the loop step of `metrics` (-1 before any).
      group: the latest group of fused steps, or None (`steps_per_execution=1`).
      running: whether a run is in progress.
      stop_requested: whether the run ends after the current step's hooks.
      interrupted: whether SIGINT or SIGTERM stopped the run before its last step (on
        this process, or on the process whose stop every process agreed on); set before
        the OnEnd hooks, cleared when the next run starts.
    """

    def __init__(
        self,
        trainer: Trainer,
        steps_per_execution: int,
        hooks: HookRegistry,
        loop_metrics: LoopMetrics,
        finite: FiniteChecker,
        owner: Any,
        durations: collections.deque[float],
        checkpointed_step: Callable[[], int | None],
    ) -> None:
        self._trainer = trainer
        self._most = steps_per_execution
        self._hooks = hooks
        self._loop_metrics = loop_metrics
        self._finite = finite
        self._owner = owner
        self._durations = durations
        self._checkpointed_step = checkpointed_step
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
        self.stop_requested = False
        self.stop_reason: str | None = None
        self.interrupted = False
        self._epoch_batches = 0
        self._warned_epoch_hooks = False
        self._pending_error: BaseException | None = None
        self._resumed_run: dict[str, int] | None = None  # the run a restored state was in
        self._in_flight = InFlight(limit_for(trainer.devices))
        # Several processes: a process reads the agreed stop at its settle points, which come
        # at most `limit + 1` dispatches apart, and no process runs more than that ahead of
        # another's dispatched steps; twice that, and one, is past any process's first look.
        self._stop_margin = (2 * self._in_flight.limit + 3) * steps_per_execution
        self._agreement: StopAgreement | None = None  # during a run on several processes
        self._stop_adopted = False  # whether the run's steps go to the agreed stop already
        self._interrupts = Interrupts(self._on_signal)
        self._iterable = RunIterable()

    # -- what the loop asks between steps -------------------------------------------------

    def request_stop(self, reason: str, signum: int | None = None) -> None:
        """Ends the run after the current step's hooks.

        On several processes, after the step all of them agree on (`StopAgreement`): the
        steps stop at once, to propose it.
        """
        if self._agreement is not None:
            if self._agreement.want(reason, signum):
                self.stop_requested = True  # out of the steps, to propose the stop now
            return
        self.stop_requested = True
        self.stop_reason = reason

    def report_error(self, error: BaseException) -> None:
        """Raises `error` after the current step's hooks, or at the next run's start."""

        def raise_it() -> None:
            raise error

        if self.running:
            self._hooks.after_hooks.append(raise_it)
        else:
            self._pending_error = error

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
        self._hooks.halted = True  # the step's hooks stop; the run goes on from `step`
        for schedule in self._hooks.schedules():
            schedule.restart(self)
        self._hooks.reschedule()

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
            while self.epoch < epochs and not self._stops_here():
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

    def _on_signal(self, signum: int) -> None:
        self.request_stop(f"interrupted by {signal_name(signum)}", signum)

    def _settle(self) -> None:
        """Waits for every step in flight and checks their losses."""
        window = self._in_flight.wait_all()
        if window:
            for watch in self._owner.shared_data.get(FINISHED, ()):
                watch(self._in_flight.finished.last_step)
            self._finite.verify(self._owner, window)
        self._finite.raise_failure()
        if self._loop_metrics.pending_logs:
            self._loop_metrics.resolve_logs(NEVER)
        agreement = self._agreement
        if agreement is not None and not self._stop_adopted and agreement.poll(self.loop_step):
            self.stop_requested = True  # out of the steps, to go on to the agreed one

    def _agreed_stop_step(self, agreement: StopAgreement, step: int, stop_step: int) -> int:
        """`stop_step` brought to one past the agreed stop, if any; `step`: dispatched last."""
        agreed = agreement.poll(step)
        if agreed is None:
            return stop_step
        if step > agreed.step:
            raise RuntimeError(
                f"process {agreed.process} asked every process to stop after step "
                f"{agreed.step} ({agreed.reason}), but this one had already run step {step}; "
                "the processes were further apart than their steps in flight allow (does "
                "every step hold a collective over the processes' devices?)"
            )
        self._stop_adopted = True
        return min(stop_step, agreed.step + 1)

    def _stops_here(self) -> bool:
        """Between steps: whether the run ends at `loop_step` (a stop was asked or agreed).

        On several processes only at the agreed step: it sets `stop_reason` to the agreed
        reason, the same on every process.
        """
        agreement = self._agreement
        if agreement is None:
            return self.stop_requested
        agreed = agreement.poll(self.loop_step)
        self.stop_requested = False
        if agreed is not None and self._agreed_stop_step(agreement, self.loop_step - 1, NEVER) <= (
            self.loop_step
        ):
            self.stop_requested = True
            self.stop_reason = agreed.shown_reason
        return self.stop_requested

    def _settle_between_steps(self) -> None:
        """`_settle` where no step is half done: a rollback it causes needs no skipping."""
        self._settle()
        self._hooks.halted = False

    @contextlib.contextmanager
    def _run(self, dataset: Dataset, end_step: int, end_epoch: int | None = None) -> Iterator[None]:
        if self.running:
            raise RuntimeError("this Loop is already running; a hook cannot start another run")
        self._agreement = StopAgreement.for_run(self._trainer, self._stop_margin)
        self._stop_adopted = False
        self.running = True
        # Several processes: one that stops answering ends the others, even inside a collective.
        with LostProcessWatch.for_run(self._trainer.devices, self._owner):
            try:
                with self._interrupts:
                    self._start_run(dataset, end_step, end_epoch)
                    yield
            except BaseException as error:
                self._in_flight.wait_all()
                self._hooks.after_hooks.clear()
                self._hand_out_logs_at(error)
                self._hooks.run_error(error)
                raise
            finally:
                self.running = self._hooks.scheduling = False
                self.epoch_count.end_run()
                agreed = self._close_agreement()
        signum = self._interrupts.received
        if signum is None and agreed is not None and self.loop_step == agreed.step + 1:
            signum = agreed.signum  # the signal another process got: every process exits so
        if signum is not None:
            exit_interrupted(signum, self._trainer.global_step, self._checkpointed_step())

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
        self._loop_metrics.pending_logs.clear()

    def _close_agreement(self) -> AgreedStop | None:
        """Ends the run's agreement, if any; the stop it agreed on."""
        agreement, self._agreement = self._agreement, None
        if agreement is None:
            return None
        agreed = agreement.agreed
        agreement.close()
        return agreed

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
        self.stop_requested = self.interrupted = False
        self._hooks.halted = False
        self.stop_reason = None
        self.metrics = {}
        self.metrics_step = self.loop_step - 1
        self.run_phase("OnStart", dataset)
        # After the OnStart hooks, which may restore schedule states and the step.
        self._hooks.halted = False
        self.loop_step = self.start_step = trainer.global_step
        self.metrics_step = self.loop_step - 1
        self._finite.start_run(trainer, self.loop_step)
        if continuing:
            self._finite.restart(trainer, self.loop_step)  # the restored skip count
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
        trainer, hooks, most = self._trainer, self._hooks, self._most
        one_step = most == 1
        read = StepReader(dataset, most, trainer.accumulate_steps, trainer.gathers_on).read
        run = trainer.run
        loop_metrics = self._loop_metrics
        push = self._in_flight.push
        budget = HELD_BYTES // self._in_flight.limit  # a turn's batches, held to be checked
        record_duration = self._durations.append
        clock = time.perf_counter
        agreement = self._agreement
        ahead = AheadCompiles(self._trainer, self._most)
        while True:
            indicator = self._finite.indicator
            if agreement is not None:  # several processes: not past a stop they agreed on
                stop_step = self._agreed_stop_step(agreement, self.loop_step - 1, stop_step)
            while self.loop_step < stop_step and not self.stop_requested:
                started = clock()
                first = self.loop_step
                # A group ends at the run's stop or after the next step a hook fires at.
                cut = min(stop_step, hooks.exact_wake_step + 1)
                try:
                    dispatches, ended = read(
                        1 if one_step else power_of_two_at_most(max(min(most, cut - first), 1))
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
                    ahead.before_group(dispatches, first, cut)
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
                    metrics[indicator], StepToken(last, metrics, kept(dispatches, budget))
                )
                if window is not None:
                    for watch in self._owner.shared_data.get(FINISHED, ()):
                        watch(self._in_flight.finished.last_step)
                    self._finite.verify(self._owner, window)
                    if loop_metrics.pending_logs:
                        loop_metrics.resolve_logs(window[-1].last_step)
                    if agreement is not None:  # several processes: a settle point
                        stop_step = self._agreed_stop_step(agreement, last, stop_step)
                if not hooks.halted:
                    self.loop_step = last
                    hooks.step_hooks(metrics, last)
                    if hooks.after_hooks:
                        self._run_after_hooks()
                record_duration((clock() - started) / count)
                if hooks.halted:
                    hooks.halted = False
                    continue
                self.loop_step = last + 1
                if ended:
                    return True
            self._settle()
            if hooks.halted:
                hooks.halted = False
                continue
            # Several processes: a stop asked, not at its agreed step yet, goes on to it.
            if agreement is None or self._stops_here() or self.loop_step >= stop_step:
                return False

    def _end_run(self) -> Metrics:
        self._settle_between_steps()
        self.interrupted = self._stopped_by_signal()
        self.run_phase("OnEnd", self.metrics)
        return self.metrics

    def _stopped_by_signal(self) -> bool:
        """Whether a signal ends the run before its last step (see `interrupted`).

        On several processes the agreed stop decides, so every process answers alike.
        """
        if self.loop_step == self.end_step:
            return False  # the run is complete, whenever a signal came
        agreement = self._agreement
        if agreement is not None:
            agreed = agreement.agreed
            return agreed is not None and agreed.signum is not None
        return self._interrupts.received is not None
