"""`early_stopping`: stops training once a monitored metric stops improving.

Keras's `EarlyStopping` on loopax's hook contract; `MetricMonitor` (`_monitor.py`) watches
the metric.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp

from .. import _warnings
from .._validate import non_negative_int
from ..loop import Loop, Priority
from ..loop._internal import from_plain
from ..trainer import Trainer
from ._checkpointing._checkpointer import CHECKPOINTERS
from ._metric_info import is_writer_process
from ._monitor import MetricMonitor, check_number
from ._train_state import state_of

_logger = logging.getLogger("loopax")

# After the checkpoint hook's end-of-run save (which then holds the true last state), before
# the logs and the UI.
RESTORE_PRIORITY = Priority.CHECKPOINT + 1
# loop.shared_data key: the loop's early stopping hooks (hooks.plot marks their monitor's best).
EARLY_STOPPERS = "loopax.early_stoppers"


def _weights(state: Any) -> dict[str, Any]:
    """What evaluation depends on, by `TrainState` field.

    The parameters, the model state, and the EMA weights when kept (evaluation uses them).
    """
    weights = {"params": state.params, "model_state": state.model_state}
    if state.ema_params is not None:
        weights["ema_params"] = state.ema_params
    return weights


def _equal_trees(a: Any, b: Any) -> bool:
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    equal = [
        jnp.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    ]
    return bool(jnp.all(jnp.stack(equal))) if equal else True


class EarlyStopping(MetricMonitor):
    """Stops the run once `monitor` has not improved for `patience` checks.

    Created by `early_stopping` (read its documentation for the rules).

    Attributes:
      monitor, mode, min_delta, checks, last_step: see `MetricMonitor`.
      patience: checks without improvement before stopping.
      baseline: the value to beat, or None.
      restore_best: whether the trainer holds the best parameters after each run.
      best: the best value so far, or None.
      best_step: the global step of `best`, or None.
      wait: checks since the last one that improved on the best (and the baseline).
      stopped_step: the global step at which it stopped the training, or None.
      stop_reason: why it stopped, or None.
      restored_step: the step whose parameters were put back at the end of the last run,
        or None when none were.
    """

    patience: int
    baseline: float | None
    trainer: Trainer

    def __init__(
        self,
        loop: Loop,
        monitor: Any,
        *,
        mode: Any,
        min_delta: float,
        patience: int,
        baseline: float | None,
        restore_best: bool,
        verbose: bool = True,
    ):
        super().__init__(loop, "early_stopping", monitor, mode, min_delta)
        if not isinstance(verbose, bool):
            raise ValueError(f"early_stopping: verbose must be True or False, got {verbose!r}")
        self.verbose = verbose
        self.patience = non_negative_int("patience", patience, "early_stopping: ")
        self.baseline = (
            None
            if baseline is None
            else check_number("early_stopping", "baseline", baseline, minimum=None)
        )
        if not isinstance(restore_best, bool):
            raise ValueError(
                f"early_stopping: restore_best must be True or False, got {restore_best!r}"
            )
        self.restore_best = restore_best
        self.trainer = loop.trainer
        self.stopped_step: int | None = None
        self.stop_reason: str | None = None
        self.restored_step: int | None = None
        # Whether the stop happened in this process, not in a run a checkpoint restored.
        self._stopped_here = False
        self._best_copy: dict[str, Any] | None = None  # the best weights, on the device
        self._best_copy_step: int | None = None
        # The training's own weights and global step, kept while the trainer holds the
        # best ones between runs: the next run trains on from them.
        self._set_aside: tuple[dict[str, Any], int] | None = None
        loop.on_start(self.name, self._on_start, Priority.VALIDATE + 1)
        loop.on_restore(self.name, self._on_restore)
        loop.on_end(self.name, self._on_end, RESTORE_PRIORITY, check_finite=False)
        self._watch(loop, Priority.DEFAULT)
        loop.shared_data.setdefault(EARLY_STOPPERS, []).append(self)

    @property
    def best_params(self) -> Any:
        """A device copy of the parameters at `best_step`, or None.

        With `restore_best`, kept from the check that found it in this process.
        """
        if self._best_copy is None or self._best_copy_step != self.best_step:
            return None
        return self._best_copy["params"]

    def reset(self) -> None:
        """Forgets the best value, the wait and the stop, so that later runs train again.

        As a new Keras `fit` would; values of steps already checked still are not counted.
        """
        self.best = self.best_step = self.stopped_step = self.stop_reason = None
        self.wait = 0
        self._stopped_here = False

    def measures_training(self, loop: Loop) -> bool:
        # Between runs the trainer may hold the best parameters instead of the training's.
        del loop
        return self._set_aside is None

    def on_value(self, loop: Loop, step: int, value: float) -> None:
        self.wait += 1
        if self.improves(value, self.best):
            self.best, self.best_step = value, step
            if self.restore_best:
                # A real copy: the next step donates the state's device buffers.
                state = state_of(loop.trainer, self.name)
                self._best_copy = jax.tree.map(jnp.copy, _weights(state))
                self._best_copy_step = step
            if self.baseline is None or self.improves(value, self.baseline):
                self.wait = 0
        if self.wait >= max(self.patience, 1) and self.stopped_step is None:
            if self.best is None:
                what = "had no finite value"
            elif self.baseline is not None and not self.improves(self.best, self.baseline):
                what = f"did not improve on baseline {self.baseline:.6g}"
            else:
                what = f"did not improve on {self.best:.6g} (step {self.best_step})"
            delta = f" by more than {self.min_delta:g}" if self.min_delta else ""
            self.stopped_step = step
            self._stopped_here = True
            self.stop_reason = (
                f"early stopping: {self.monitor} {what}{delta} in {self.wait} checks; "
                f"stopped at step {step}"
            )
            self._say(self.stop_reason)
            loop.request_stop(self.stop_reason)

    def _say(self, line: str) -> None:
        """Logs `line`; with `verbose`, also prints it once (on process 0), as Keras does."""
        _logger.info("%s", line)
        if self.verbose and is_writer_process():
            print(line, flush=True)

    def _on_start(self, loop: Loop, dataset: Any) -> None:
        del dataset
        if self.stopped_step is not None:
            if self._stopped_here:  # a program running its loop again: it may want reset()
                _warnings.warn(
                    f"{self.name} stopped this training at step {self.stopped_step} "
                    f"({self.stop_reason}), so this run stops before its first step. Call "
                    "reset() on the object early_stopping returned to train on"
                )
            else:  # a finished job run again: its checkpoint says it ended
                self._say(self._ended_line())
            loop.request_stop(self.stop_reason or "early stopping")
            return
        self._put_back_training_params(loop.trainer)

    def _ended_line(self) -> str:
        """Says that the training a checkpoint restored had stopped: why, where, its best step."""
        stopped = f"; stopped at step {self.stopped_step}"
        why = (self.stop_reason or "").removeprefix("early stopping: ").removesuffix(stopped)
        best = "no best step" if self.best_step is None else f"best step {self.best_step}"
        return (
            f"{self.name}: this training already ended: stopped early at step "
            f"{self.stopped_step} ({why}); {best}. Nothing is trained (reset() on the hook "
            "trains on)"
        )

    def _put_back_training_params(self, trainer: Trainer) -> None:
        """The next run continues the training from its own last parameters.

        Not from the best ones shown between runs: chunked runs equal one long run (and a resumed
        one).
        """
        set_aside, self._set_aside = self._set_aside, None
        if set_aside is None or self._best_copy is None:
            return
        weights, step = set_aside
        state = state_of(trainer, self.name)
        # Only if nobody replaced the parameters between the runs.
        if step == trainer.global_step and _equal_trees(_weights(state), self._best_copy):
            trainer.state = dataclasses.replace(state, **weights)

    def _on_restore(self, loop: Loop, step: int) -> None:
        del loop, step
        self._set_aside = None  # the trainer's state was replaced

    def _on_end(self, loop: Loop, metrics: Any) -> None:
        del metrics
        self._warn_if_never_checked(loop)
        self.restored_step = None
        if not self.restore_best or self.best_step is None:
            return
        trainer = loop.trainer
        if self.best_step == trainer.global_step:
            return  # the trainer holds the best parameters already
        if self._best_copy is None or self._best_copy_step != self.best_step:
            self._best_copy = self._read_best_checkpoint(loop)
        if self._best_copy is None:
            _warnings.warn(
                f"{self.name}: the best {self.monitor} ({self.best:.6g}) was at step "
                f"{self.best_step}, before the training last resumed from a checkpoint, so "
                f"those parameters are not in memory and the trainer keeps those of step "
                f"{trainer.global_step}. To get "
                f"them back, attach hooks.checkpoint(loop, directory, best_metric="
                f"{self.monitor!r}, best_mode={self.mode!r}) and call its restore_best()"
            )
            return
        state = state_of(trainer, self.name)
        if self._set_aside is None:
            # No copy: the trainer lets go of these arrays (its new state is placed anew).
            self._set_aside = (_weights(state), trainer.global_step)
        trainer.state = dataclasses.replace(state, **self._best_copy)
        self.restored_step = self.best_step
        self._say(f"{self.name}: restored the parameters of step {self.best_step}")

    def _read_best_checkpoint(self, loop: Loop) -> dict[str, Any] | None:
        """The best step's weights from a checkpoint hook keeping it, or None.

        After a resume the best parameters are not in memory; a `hooks.checkpoint` with
        this monitor as its `best_metric` keeps them on disk.
        """
        for checkpointer in loop.shared_data.get(CHECKPOINTERS, []):
            if checkpointer.best_metric == self.monitor and self.best_step in (
                checkpointer.all_steps()
            ):
                plain = checkpointer.read(self.best_step)
                state = state_of(loop.trainer, self.name)
                where = f"checkpoint {self.best_step} of {str(checkpointer.directory)!r}"
                weights = _weights(state)
                saved = {"params": plain["params"], "model_state": plain.get("model_state", {})}
                if "ema_params" in weights:  # saved before the EMA was kept: its parameters
                    saved["ema_params"] = plain.get("ema_params", plain["params"])
                self._best_copy_step = self.best_step
                return from_plain(weights, saved, where)
        return None

    def get_state(self) -> dict[str, Any]:
        """The counters a checkpoint saves (JSON): best, best step, wait, stop."""
        return {
            **super().get_state(),
            "stopped_step": self.stopped_step,
            "stop_reason": self.stop_reason,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores `get_state()`."""
        super().set_state(state)
        self.stopped_step = state.get("stopped_step")
        self.stop_reason = state.get("stop_reason")
        self._stopped_here = False

    def __repr__(self) -> str:
        return (
            f"EarlyStopping({self.monitor!r}, best={self.best}, best_step={self.best_step}, "
            f"wait={self.wait}, stopped_step={self.stopped_step})"
        )


def early_stopping(
    loop: Loop,
    monitor: str,
    *,
    mode: str = "auto",
    min_delta: float = 0.0,
    patience: int = 5,
    baseline: float | None = None,
    restore_best: bool = True,
    verbose: bool = True,
) -> EarlyStopping:
    """Stops training once `monitor` has stopped improving (Keras's `EarlyStopping`).

    `monitor` is checked at every evaluation of its dataset for `"eval/<dataset>/<metric>"`
    (from `hooks.evaluate` or any `loop.evaluate`), or at every epoch end of `run_epochs`
    for `"train/<metric>"` (the value at the epoch's last step). A value improves when it
    beats the best so far by more than `min_delta` (mode "min": `value < best -
    min_delta`; "max": `value > best + min_delta`); NaN and infinities never do. `wait`
    counts the checks since the last one that improved on the best (and, with `baseline`,
    also beat the baseline by more than `min_delta`); when it reaches `patience` the hook
    calls `loop.request_stop(reason)`: the run ends after the current step's hooks, its
    OnEnd hooks included.

    With `restore_best`, the parameters, the model state (e.g. BatchNorm statistics) and
    the EMA weights (`Trainer(ema_decay=...)`, which evaluations use) of the best check are
    copied on the device when found, and at the end of **every** run,
    stopped early or not, the trainer holds them; the optimizer state, the global step and
    the RNG stay the training's own. This runs after the checkpoint hook's end-of-run save
    (at `Priority.CHECKPOINT + 1`), so the last checkpoint holds the true last training
    state and resumes exactly. The next run on the same loop trains on from the
    training's own last parameters (unless they were replaced by hand in between), so
    chunked runs equal one long run. After a resume from a checkpoint, best parameters
    found before it are not in memory: the run's end then warns and keeps the current
    ones; `hooks.checkpoint(loop, directory, best_metric=monitor, best_mode=...)` and
    `Checkpointer.restore_best()` get them back.

    The counters (best, best step, wait, stop) live on across runs and are saved with
    every checkpoint, so a resumed run continues the patience count. Once it has stopped
    the training, a later run stops at its start, as the uninterrupted run did: a job run
    again (a new process resumed from the checkpoint of the finished training) prints one
    line, `this training already ended: stopped early at step S (why); best step B`, and
    then ends as the first run did (the best parameters restored); a later run on the same
    loop in the same process warns instead. `reset()` re-arms it.

    Where loopax differs from Keras's `EarlyStopping`: `patience` counts checks of
    `monitor` (evaluations or epoch ends), not epochs; the counters are not reset when a
    run starts (Keras resets them in every `fit`); `mode="auto"` uses the metric's type and
    raises for anything but a loss or an accuracy, where Keras guesses from the name; a
    negative `min_delta`, an unknown `mode` or `monitor` raise instead of being corrected
    or warned about; with `baseline`, the stop comes after `patience` checks that did not
    beat the baseline even while the value still improves (as Keras documents it; Keras's
    code waits for a check that does not improve); the best parameters are restored
    whether or not the run stopped early (Keras 2 restored them only after an early stop,
    keras-team/keras#12511); there is no `start_from_epoch`. With `verbose` (the default)
    the stop prints one line, as Keras's `verbose=1` does: the step, the monitor and the
    best value with its step (also in `loop.stop_reason` and the log), and a restore of the
    best parameters prints another. As in Keras, `patience=0` acts as 1.

    Args:
      loop: the `loopax.Loop`.
      monitor: the metric key: `"eval/<dataset>/<metric>"` (e.g. `"eval/test/mean_loss"`) or
        `"train/<metric>"` (e.g. `"train/moving_average_loss"`, with `run_epochs`).
      mode: `"min"`, `"max"`, or `"auto"`: min for losses, max for accuracies.
      min_delta: how much (>= 0) a value must beat the best by to count as an improvement.
      patience: how many checks without improvement end the training (>= 0).
      baseline: a value the monitor must beat (by `min_delta`) to reset the wait.
      restore_best: leave the trainer with the best parameters at the end of each run.
      verbose: print the stop (and the restore) in one line each, on process 0.

    Returns:
      The `EarlyStopping` (`best`, `best_step`, `wait`, `stopped_step`, `restored_step`,
      `best_params`, `reset()`).

    Raises:
      ValueError: `monitor` names none of the trainer's metric keys (the message lists
        them), `mode` is unknown or "auto" cannot decide, or a bad `patience`,
        `min_delta`, `baseline` or `restore_best`.

    Example:
      >>> import jax, numpy as np, optax, flax.linen as nn, loopax
      >>> from loopax import hooks
      >>> trainer = loopax.Trainer(lambda ctx, spec, x: nn.Dense(1)(x[0]),
      ...     loopax.losses.mean_squared_error, optax.sgd(0.1), devices=jax.devices()[:1])
      >>> x, y = np.ones((8, 2), np.float32), np.ones((8, 1), np.float32)
      >>> loop = loopax.Loop(trainer)
      >>> _ = hooks.evaluate(loop, loopax.ArrayDataset(x, y, 4, name="test"), every_n_steps=2)
      >>> stopper = hooks.early_stopping(loop, "eval/test/mean_loss", patience=3)
      >>> _ = loop.run_steps(loopax.ArrayDataset(x, y, 4, loop_forever=True), 10)
      >>> stopper.mode, stopper.checks, stopper.stopped_step
      ('min', 5, None)
    """
    return EarlyStopping(
        loop,
        monitor,
        mode=mode,
        min_delta=min_delta,
        patience=patience,
        baseline=baseline,
        restore_best=restore_best,
        verbose=verbose,
    )
