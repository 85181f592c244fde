"""The `Loop`: runs steps or epochs and fires prioritized OnStart/OnStep/OnEnd hooks."""

from __future__ import annotations

import bisect
import collections
import itertools
import math
import sys
import time
from typing import Any, Callable

import jax
import numpy as np

from ._datasets import Dataset
from ._hooks import Hook, HookError, Priority
from ._inflight import InFlight, limit_for
from ._trainer import Trainer

Metrics = dict[str, Any]
_DURATIONS_KEPT = 1024  # step durations kept for the median: bounded memory on long runs


class NonFiniteLossError(FloatingPointError):
    """The loss of a step was NaN or infinite; the message names the step."""


class Loop:
    """Runs a `Trainer` over a dataset for some steps or epochs, firing hooks.

    Hooks are `fn(loop, dataset)` (OnStart) or `fn(loop, metrics)` (OnStep, OnEnd), run
    in ascending priority (ties in registration order). While they run, `loop_step` is the
    0-based index of the step just run; `trainer.global_step` is then `loop_step + 1`.

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
      shared_data: a dict where hooks leave results for each other (e.g. evaluations).
      train_step_durations: seconds per step, hooks included (the last 1024 steps).
      stop_reason: the reason given to `request_stop`, or None.

    Example:
      >>> import numpy as np, optax, flax.linen as nn, loopax
      >>> trainer = loopax.Trainer(lambda ctx, spec, x: nn.Dense(1)(x[0]),
      ...     loopax.losses.mean_squared_error, optax.sgd(0.1), devices=jax.devices()[:1])
      >>> data = loopax.ArrayDataset(np.ones((8, 2), np.float32), np.ones((8, 1), np.float32),
      ...     batch_size=4, loop_forever=True)
      >>> loop = loopax.Loop(trainer)
      >>> seen = []
      >>> loop.on_step("record", lambda loop, metrics: seen.append(loop.loop_step))
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
        self.shared_data: dict[str, Any] = {}
        self.train_step_durations: collections.deque[float] = collections.deque(
            maxlen=_DURATIONS_KEPT
        )
        self.stop_reason: str | None = None
        self._hooks: dict[str, list[Hook]] = {"OnStart": [], "OnStep": [], "OnEnd": []}
        self._order = itertools.count()
        self._triggers: list[Any] = []
        self._stop_requested = False
        self._metrics: Metrics = {}
        self._metrics_step = -1
        self._finite_checked_step = -1
        self._in_flight = InFlight(limit_for(trainer.num_devices))

    # -- hook registration ----------------------------------------------------------------

    def _add_hook(self, phase: str, name: str, fn: Callable, priority: int) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a hook needs a non-empty name, got {name!r}")
        if not callable(fn):
            raise TypeError(f"hook {name!r}: fn must be callable, got {type(fn).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
            raise TypeError(f"hook {name!r}: priority must be an int, got {priority!r}")
        eager = int(priority) >= Priority.CHECKPOINT and not getattr(fn, "checks_finite_lazily", False)
        hook = Hook(int(priority), next(self._order), name, fn, eager)
        bisect.insort(self._hooks[phase], hook, key=lambda h: (h.priority, h.order))

    def on_start(self, name: str, fn: Callable[["Loop", Dataset], Any], priority: int = 0) -> None:
        """Registers `fn(loop, dataset)` to run at the start of every run."""
        self._add_hook("OnStart", name, fn, priority)

    def on_step(self, name: str, fn: Callable[["Loop", Metrics], Any], priority: int = 0) -> None:
        """Registers `fn(loop, metrics)` to run after every train step."""
        self._add_hook("OnStep", name, fn, priority)

    def on_end(self, name: str, fn: Callable[["Loop", Metrics], Any], priority: int = 0) -> None:
        """Registers `fn(loop, metrics)` to run at the end of a run (the last metrics)."""
        self._add_hook("OnEnd", name, fn, priority)

    def hooks(self, phase: str) -> list[tuple[int, str]]:
        """The `(priority, name)` of the hooks of `phase` ("OnStart", "OnStep", "OnEnd") in run order."""
        return [(h.priority, h.name) for h in self._hooks[phase]]

    def request_stop(self, reason: str = "") -> None:
        """Ends the run after the current step's hooks; OnEnd hooks still run."""
        self._stop_requested = True
        self.stop_reason = reason

    # -- timing ---------------------------------------------------------------------------

    def median_train_step_duration(self) -> float:
        """The median step duration in seconds (hooks included); 1 ms with no steps."""
        if not self.train_step_durations:
            return 1e-3
        ordered = sorted(self.train_step_durations)
        return ordered[len(ordered) // 2]

    # -- running --------------------------------------------------------------------------

    def _check_finite(self) -> None:
        """Raises `NonFiniteLossError` if the current step's loss is NaN or infinite.

        Reads the loss from the device (waiting for the step): hooks call it only on the
        steps where something worth protecting (a checkpoint) happens.
        """
        step = self._metrics_step
        if self._finite_checked_step == step or "loss" not in self._metrics:
            return
        loss = float(np.asarray(jax.device_get(self._metrics["loss"])))
        if not math.isfinite(loss):
            raise NonFiniteLossError(
                f"the loss is {loss} at step {step}; stopping before checkpoints "
                "save it. Lower the learning rate, clip gradients, or check the data"
            )
        self._finite_checked_step = step

    def _run_hooks(self, phase: str, argument: Any) -> None:
        for hook in self._hooks[phase]:
            if hook.checks_finite_eagerly:
                self._check_finite()
            try:
                hook.fn(self, argument)
            except NonFiniteLossError:
                raise  # a trigger's lazy finite check: the same error as the loop's own
            except Exception as err:
                raise HookError(phase, hook.name, self.loop_step, err) from err

    def _start_run(self, dataset: Dataset, end_step: int) -> None:
        self.trainer.reset_train_metrics()
        self.run_index += 1
        self.loop_step = self.trainer.global_step
        self.start_step = self.loop_step
        self.end_step = end_step
        self.epoch = 0
        self._stop_requested = False
        self.stop_reason = None
        self._metrics = {}
        self._finite_checked_step = -1
        self._run_hooks("OnStart", dataset)

    def _dataset_error(self, dataset: Dataset, err: Exception) -> RuntimeError:
        return RuntimeError(
            f"dataset {getattr(dataset, 'name', dataset)!r} failed at step "
            f"{self.loop_step}: {type(err).__name__}: {err}"
        )

    def _train_until(self, dataset: Dataset, stop_step: int) -> bool:
        """Runs steps and their OnStep hooks until `loop_step` reaches `stop_step`, a stop
        is requested, or the dataset ends; returns True if the dataset ended.

        The per-step path of every run, kept tight: on a small model the loop's own
        Python shows in the step rate.
        """
        train_step = self.trainer.train_step
        yield_batch = dataset.yield_batch
        push = self._in_flight.push
        record_duration = self.train_step_durations.append
        run_hooks = self._run_hooks
        clock = time.perf_counter
        while self.loop_step < stop_step and not self._stop_requested:
            started = clock()
            try:
                batch = yield_batch()
            except StopIteration:
                return True
            except Exception as err:
                raise self._dataset_error(dataset, err) from err
            metrics = train_step(*batch)
            self._metrics = metrics
            self._metrics_step = self.loop_step
            push(metrics["loss"])
            run_hooks("OnStep", metrics)
            record_duration(clock() - started)
            self.loop_step += 1
        return False

    def _end_run(self) -> Metrics:
        self._in_flight.wait_all()
        if self._hooks["OnEnd"]:
            self._check_finite()
        self._run_hooks("OnEnd", self._metrics)
        return self._metrics

    def run_steps(self, dataset: Dataset, steps: int) -> Metrics:
        """Runs `steps` train steps from the current step; returns the last metrics.

        Raises:
          ValueError: `steps` is negative or not an int.
          RuntimeError: the dataset ended before `steps` steps (OnEnd does not run), or
            raised.
          HookError: a hook raised.
          NonFiniteLossError: the loss became NaN or infinite.
        """
        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 0:
            raise ValueError(f"steps must be an int >= 0, got {steps!r}")
        if steps == 0:
            return {}
        self._start_run(dataset, self.trainer.global_step + int(steps))
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

        Returns the last metrics, or `{}` when the trainer is already there.
        """
        remaining = int(global_step) - self.trainer.global_step
        if remaining <= 0:
            self.loop_step = self.trainer.global_step
            return {}
        return self.run_steps(dataset, remaining)

    def run_epochs(self, dataset: Dataset, epochs: int) -> Metrics:
        """Runs `epochs` passes over `dataset`; resets it after each epoch.

        The first epoch starts where the dataset is (no reset before it). `end_step` is -1
        until the first epoch ends, then extrapolated from its number of batches.

        Raises:
          ValueError: `epochs` is negative or an epoch yields no batch.
          HookError, NonFiniteLossError: as `run_steps`.
        """
        if isinstance(epochs, bool) or not isinstance(epochs, (int, np.integer)) or epochs < 0:
            raise ValueError(f"epochs must be an int >= 0, got {epochs!r}")
        self._start_run(dataset, -1)
        while self.epoch < epochs and not self._stop_requested:
            epoch_start = self.loop_step
            if not self._train_until(dataset, sys.maxsize):
                break  # a stop was requested
            batches_in_epoch = self.loop_step - epoch_start
            if batches_in_epoch == 0:
                raise ValueError(
                    f"dataset {getattr(dataset, 'name', dataset)!r} yielded no batch in "
                    f"epoch {self.epoch}"
                )
            self.end_step = self.loop_step + batches_in_epoch * (epochs - self.epoch - 1)
            dataset.reset()
            self.epoch += 1
        return self._end_run()

    def __repr__(self) -> str:
        return f"Loop(loop_step={self.loop_step}, end_step={self.end_step}, epoch={self.epoch})"
