"""The `Loop`: runs steps or epochs and fires prioritized hooks."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterable
from typing import Any

from .. import _validate
from ..data import Dataset
from ..trainer import Trainer
from ._finite import FiniteChecker, NonFiniteHandler, NonFiniteLossError
from ._history import Evaluation, History
from ._hook import NEVER, Hook, Metrics, Schedule
from ._hook_registry import PHASES, HookRegistry
from ._loop_metrics import LogFn, LoopMetrics
from ._runner import Runner

__all__ = ["PHASES", "Loop", "NonFiniteLossError"]


def _runner_view(name: str, doc: str) -> Any:
    """A read-only property of the `Loop`: its runner's attribute `name` (dotted: a member's)."""
    return property(operator.attrgetter(f"_runner.{name}"), doc=doc)


class Loop:
    """Runs a `Trainer` over a dataset for some steps or epochs, firing hooks.

    Hooks run in ascending priority, ties in registration order, and are called with the
    loop: `fn(loop, dataset)` (OnStart), `fn(loop, metrics)` (OnStep, OnEpochEnd, OnEnd: the
    step's metrics on the device), `fn(loop, evaluation)` (OnEvaluation), `fn(loop, step)`
    (OnRestore), `fn(loop, error)` (OnError). In OnStep `loop_step` is the step just run
    (`trainer.global_step - 1`); in OnEpochEnd and OnEnd it is one past the last step.
    What a hook may use is in the extending guide ("A hook").

    Every loss is checked without a per-step host sync, and SIGINT or SIGTERM end a run
    through its OnEnd hooks (the reliability guide). With `steps_per_execution=K > 1` each
    `Trainer.run` takes up to K steps and every step-scheduled hook still fires at its step
    (the fused execution guide).

    Args:
      trainer: the `Trainer` to run.
      steps_per_execution: K, the most steps per compiled call (1: one step per call).

    Attributes:
      trainer: the trainer.
      loop_step: the step being run (starts at `trainer.global_step`).
      start_step: the first step of the current run.
      end_step: one past the last step of the run; -1 while unknown during the first
        epoch of `run_epochs`.
      epoch: the current epoch (0-based): of `run_epochs` in the run (`run_to_epoch`: total).
      epochs_done: the epochs completed in total by `run_epochs` and `run_to_epoch`,
        restored ones included (checkpoints keep it).
      run_index: incremented at the start of every run (hooks use it to spot a new run).
      metrics: the latest step's metrics, on the device.
      steps_per_execution: the most steps per compiled call.
      history: the `History` of every logged metric (`"train/<m>"`, `"eval/<ds>/<m>"`).
      shared_data: a dict where hooks leave results for each other.
      train_step_durations: seconds per step, hooks included (the last 1024 steps).
      stop_reason: the reason given to `request_stop`, or None.
      interrupted: True from the OnEnd hooks of a run that SIGINT or SIGTERM stopped before
        its last step (on any process of the run) until the next run starts.
      checkpointed_step: the newest global step a checkpoint hook saved, or None.
      running: whether a run is in progress.

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
        self.history = History()
        self.shared_data: dict[str, Any] = {}
        self.checkpointed_step: int | None = None
        self._hooks = HookRegistry(self)
        self._loop_metrics = LoopMetrics(
            trainer, self.history, functools.partial(self._hooks.run_phase, "OnEvaluation")
        )
        self._finite = FiniteChecker()
        self._runner = Runner(
            self, self.steps_per_execution, self._hooks, self._loop_metrics, self._finite
        )

    # -- where the run stands (the runner's, read-only; see the class) -------------------

    loop_step = _runner_view("loop_step", "The step being run (see the class).")
    start_step = _runner_view("start_step", "The first step of the current run.")
    end_step = _runner_view("end_step", "One past the last step of the run; -1 while unknown.")
    epoch = _runner_view("epoch", "The current epoch (see the class).")

    @property
    def epochs_done(self) -> int:
        """Epochs completed in total by `run_epochs` and `run_to_epoch`, restored ones included."""
        return self._runner.epoch_count.done

    run_index = _runner_view("run_index", "Incremented at the start of every run.")
    metrics = _runner_view("metrics", "The latest step's metrics, on the device.")
    stop_reason = _runner_view("stop.reason", "The reason given to `request_stop`, or None.")
    interrupted = _runner_view(
        "stop.interrupted", "Whether a signal stopped the run (see the class)."
    )
    running = _runner_view("running", "Whether a run (`run_steps`, `run_epochs`) is in progress.")
    train_step_durations = _runner_view(
        "step_durations", "Seconds per step, hooks included (the last 1024 steps)."
    )

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
        self._runner.call_after_hooks(fn)

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
            "run": self._runner.run_state(),
            "epochs": self._runner.epoch_count.state(self._runner.running),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores a `get_state()` result.

        States of hooks not registered yet wait for their registration.
        """
        if "history" in state:
            self.history.set_state(state["history"])
        self._runner.remember_run(state.get("run"))
        self._runner.epoch_count.remember(state.get("epochs"))
        self._hooks.set_states(state.get("hooks", {}))

    # -- metrics --------------------------------------------------------------------------

    def host_metrics(self) -> dict[str, float]:
        """The latest step's metrics as Python floats (it waits for that step).

        Read from the device at most once per step, however many hooks ask, all of them
        together (one wait for the device).
        """
        return self._loop_metrics.host(self._runner.metrics, self._runner.metrics_step)

    def record_train_metrics(self) -> dict[str, float]:
        """Records the latest step's metrics in `history`; returns them keyed `"train/<metric>"`.

        Reads them as `host_metrics` does and records them at their global step. Writers
        call it on the steps they log.
        """
        return self._loop_metrics.record(self._runner.metrics, self._runner.metrics_step)

    def log_train_metrics(self, fn: LogFn, extra: dict[str, Any] | None = None) -> None:
        """Logs the latest step's train metrics without waiting for the device.

        Once the step has finished (when the loop next waits for it anyway: at most one
        in-flight window later, or at the latest at `check_finite`, `flush` or the end of
        the run) its metrics are read (once, however many writers asked), recorded in
        `history` at their global step, and `fn(global_step, values)` is called with
        `values` keyed `"train/<metric>"`, plus this caller's `extra` (`{key: device
        scalar}`, e.g. the learning rate), read at the same time and recorded too.
        """
        self._loop_metrics.log(self._runner.metrics, self._runner.metrics_step, fn, extra)
        if not self._runner.running:
            self._loop_metrics.resolve_logs(NEVER)

    def flush(self) -> Callable[[], None]:
        """Hands the pending train logs to their writers and asks every output to write out.

        The outputs are the OnFlush hooks. Returns a function that waits until all of it is
        on disk.

        A checkpoint calls it after the hooks of the step it saves and waits before it
        commits, so that a resumed run's logs hold every point up to the checkpoint.
        """
        self._loop_metrics.resolve_logs(NEVER)
        return self._hooks.run_flush()

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
        return self._runner.group_metrics()

    # -- what hooks ask of the loop -------------------------------------------------------

    def report_error(self, error: BaseException) -> None:
        """Makes the run raise `error` once the current step's hooks have run.

        Safe to call from another thread (e.g. a background save that failed). Outside a
        run, the next run raises it at its start.
        """
        self._runner.report_error(error)

    def request_stop(self, reason: str = "") -> None:
        """Ends the run after the current step's hooks; OnEnd hooks still run."""
        self._runner.stop.request(reason)

    def handle_non_finite(self, fn: NonFiniteHandler | None) -> None:
        """Makes `fn(loop, steps)` handle the steps the trainer skipped, instead of a warning.

        Those are the steps skipped for a non-finite loss or gradient
        (`Trainer.skip_non_finite_steps`). None removes `fn`. `hooks.nan_guard` sets it.
        """
        self._finite.set_handler(fn)

    def check_finite(self) -> None:
        """Waits for the steps in flight and checks their losses.

        Raises:
          NonFiniteLossError: naming the first step whose loss is NaN or infinite.
        """
        self._runner.check_finite()

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
        self._runner.rewind(step)
        self._hooks.run_phase("OnRestore", step)

    def median_train_step_duration(self) -> float:
        """The median step duration in seconds (hooks included); 1 ms with no steps."""
        ordered = sorted(self.train_step_durations)
        return ordered[len(ordered) // 2] if ordered else 1e-3

    # -- running --------------------------------------------------------------------------

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
        return self._runner.steps(dataset, steps)

    def run_to_step(self, dataset: Dataset | Iterable[Any], global_step: int) -> Metrics:
        """Runs the steps left until `trainer.global_step == global_step` (resume-aware).

        Returns the last metrics, or `{}` when the trainer is already there (a warning says
        so when it is past it). `dataset` as for `run_steps`.

        Raises:
          ValueError: `global_step` is negative or not an int.
        """
        return self._runner.to_step(dataset, global_step)

    def run_epochs(self, dataset: Dataset | Iterable[Any], epochs: int) -> Metrics:
        """Runs `epochs` more passes over `dataset`, resetting it after each (GoMLX's RunEpochs).

        For a total that survives a resume, use `run_to_epoch`.

        The first epoch starts where the dataset is (no reset before it). `end_step` is -1
        until the first epoch ends, then extrapolated from its number of batches. `dataset`
        as for `run_steps`, but not an iterator (a generator), which cannot start over.

        Raises:
          ValueError: `epochs` is negative or an epoch yields no batch.
          TypeError: the dataset has no `reset()`, or is an iterator.
          HookError, NonFiniteLossError: as `run_steps`.
        """
        return self._runner.epochs(dataset, epochs)

    def run_to_epoch(self, dataset: Dataset | Iterable[Any], epochs: int) -> Metrics:
        """Runs until `epochs` epochs are done in total (`epochs_done`), as Keras's `fit`.

        Resume-aware, as `run_to_step`: after a restore the interrupted epoch finishes from
        the checkpoint's dataset position, then the rest run; `loop.epoch` counts in total.
        Returns `{}` when they are done (a warning says so when more are); else as `run_epochs`.
        See the checkpoints guide.

        Raises:
          ValueError, TypeError, HookError, NonFiniteLossError: as `run_epochs`.
        """
        if not self._runner.epoch_count.left(_validate.non_negative_int("epochs", epochs)):
            return {}  # done already
        return self._runner.epochs(dataset, epochs, total=True)

    def __repr__(self) -> str:
        return (
            f"Loop(loop_step={self.loop_step}, end_step={self.end_step}, epoch={self.epoch}, "
            f"steps_per_execution={self.steps_per_execution})"
        )
