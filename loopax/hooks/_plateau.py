"""`reduce_lr_on_plateau`: lowers the live learning rate when a monitored metric stalls.

Keras's `ReduceLROnPlateau` on loopax's hook contract. The learning rate lives in the
optimizer state (`loopax.optimizers`, `optax.inject_hyperparams`), so changing it is a new
value of an input of the compiled step: nothing is compiled again.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from .._validate import non_negative_int
from ..loop import Loop, Priority
from ..trainer import Trainer
from ._lr_checks import (
    check_optimizer_state,
    require_adjustable_learning_rate,
    scale_trainer_learning_rate,
)
from ._monitor import MetricMonitor, check_number
from ._train_state import state_of

_logger = logging.getLogger("loopax")

_HOOK = "reduce_lr_on_plateau"
# Where the hook's error says how to do what optax's version of it cannot.
_CONTRIB_NOTE = (
    " (optax.contrib.reduce_on_plateau cannot be a Trainer's optimizer: its update needs the "
    "loss as value=...; this hook is loopax's way to do the same)"
)


class ReduceLROnPlateau(MetricMonitor):
    """Multiplies the learning rate by `factor` once `monitor` has not improved for a while.

    That is, for `patience` checks; created by `reduce_lr_on_plateau` (read it for the rules).

    Attributes:
      monitor, mode, min_delta, checks, last_step: see `MetricMonitor`.
      factor, patience, cooldown, min_lr: the arguments.
      best: the best value so far, or None.
      best_step: the global step of `best`, or None.
      wait: checks without improvement since the last improvement or reduction.
      cooldown_counter: checks left before the wait counts again after a reduction.
      reductions: `[(global step, new learning rate), ...]`, one per reduction.
    """

    patience: int
    cooldown: int
    cooldown_counter: int
    min_lr: float
    trainer: Trainer

    def __init__(
        self,
        loop: Loop,
        monitor: Any,
        *,
        factor: float,
        patience: int,
        min_delta: float,
        cooldown: int,
        min_lr: float,
        mode: Any,
    ):
        super().__init__(loop, _HOOK, monitor, mode, min_delta)
        factor = check_number(_HOOK, "factor", factor)
        if not 0.0 < factor < 1.0:
            raise ValueError(
                f"{_HOOK}: factor must be between 0 and 1 (new rate = rate * factor), got "
                f"factor={factor!r}"
            )
        self.factor = factor
        self.patience = non_negative_int("patience", patience, f"{_HOOK}: ")
        self.cooldown = non_negative_int("cooldown", cooldown, f"{_HOOK}: ")
        self.min_lr = check_number(_HOOK, "min_lr", min_lr)
        self.trainer = loop.trainer
        self.cooldown_counter = 0
        self.reductions: list[tuple[int, float]] = []
        require_adjustable_learning_rate(
            loop, f"{_HOOK}({monitor!r})", _CONTRIB_NOTE, hook_name=self.name
        )
        loop.on_end(
            self.name,
            lambda loop, metrics: self._warn_if_never_checked(loop),
            Priority.DEFAULT,
            check_finite=False,
        )
        self._watch(loop, Priority.DEFAULT)

    @property
    def learning_rate(self) -> float | None:
        """The optimizer's live learning rate (reads the device), or None before the first step."""
        return self.trainer.learning_rate

    def on_value(self, loop: Loop, step: int, value: float) -> None:
        # Keras's rules, step for step.
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.wait = 0
        if self.improves(value, self.best):
            self.best, self.best_step = value, step
            self.wait = 0
        elif self.cooldown_counter == 0:
            self.wait += 1
            if self.wait >= self.patience:
                self._reduce(loop, step)

    def _reduce(self, loop: Loop, step: int) -> None:
        trainer = loop.trainer
        old = trainer.learning_rate
        if old is None:  # the registration's check makes this unreachable; say why anyway
            check_optimizer_state(state_of(trainer, self.name).opt_state, self.name, _CONTRIB_NOTE)
            raise RuntimeError(f"{self.name}: the trainer's optimizer has no learning rate to set")
        # The rate is a float32 in the optimizer state: compare at that precision.
        if old <= float(np.float32(self.min_lr)):
            return
        # Each group of a multi_transform keeps its proportion; `new` is the first's.
        scale_trainer_learning_rate(trainer, self.factor, self.min_lr)
        new = max(old * self.factor, self.min_lr)
        self.reductions.append((step, float(new)))
        self.cooldown_counter = self.cooldown
        self.wait = 0
        _logger.info(
            "%s: no improvement of %s; learning rate %.6g -> %.6g at step %d",
            self.name,
            self.monitor,
            old,
            new,
            step,
        )

    def get_state(self) -> dict[str, Any]:
        """The counters a checkpoint saves (JSON); the rate itself is in the optimizer state."""
        return {
            **super().get_state(),
            "cooldown_counter": self.cooldown_counter,
            "reductions": [[step, rate] for step, rate in self.reductions],
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores `get_state()`."""
        super().set_state(state)
        self.cooldown_counter = int(state.get("cooldown_counter", 0))
        self.reductions = [(int(step), float(rate)) for step, rate in state.get("reductions", [])]

    def __repr__(self) -> str:
        return (
            f"ReduceLROnPlateau({self.monitor!r}, best={self.best}, wait={self.wait}, "
            f"cooldown_counter={self.cooldown_counter}, reductions={self.reductions})"
        )


def reduce_lr_on_plateau(
    loop: Loop,
    monitor: str,
    *,
    factor: float = 0.1,
    patience: int = 5,
    min_delta: float = 1e-4,
    cooldown: int = 0,
    min_lr: float = 0.0,
    mode: str = "auto",
) -> ReduceLROnPlateau:
    """Multiplies the live learning rate by `factor` when `monitor` stalls.

    Keras's `ReduceLROnPlateau`, without compiling anything again.

    `monitor` is checked at every evaluation of its dataset for `"eval/<dataset>/<metric>"`
    (from `hooks.evaluate` or any `loop.evaluate`), or at every epoch end of `run_epochs`
    for `"train/<metric>"`. A value improves when it beats the best so far by more than
    `min_delta` (lower for mode "min", higher for "max"; NaN and infinities never
    do). Each check
    without improvement adds one to `wait`; when it reaches `patience` the rate becomes
    `max(rate * factor, min_lr)` (nothing happens once it is at `min_lr`), `wait` restarts
    and for the next `cooldown` checks no wait is counted (Keras's counting: the check that
    ends the cooldown already counts). The new rate is used from the next step on; it is
    set through `Trainer.set_learning_rate`, so the optimizer state (and with it every
    checkpoint) holds it, and `hooks.tensorboard` shows it as `train/learning_rate`
    (the value at global step g is the rate of the steps after g: a reduction decided at
    the evaluation of step g shows at g). The counters live on across runs and are saved
    with every checkpoint, so a resumed run continues them.

    The optimizer must keep its learning rate in its state as a value, not a schedule:
    `loopax.optimizers` (sgd, adam, adamw, rmsprop, `from_name`) do, and so does any optax
    optimizer or chain built with `optax.inject_hyperparams`; every injected learning rate
    of the state is set to the new value. Anything else raises when the hook is attached
    (or, for an optimizer whose state depends on the parameters' structure, at the first
    step). `optax.contrib.reduce_on_plateau` cannot be a Trainer's optimizer (its update
    fails with "missing 'value'": it needs the loss); this hook is the supported way.

    Where loopax differs from Keras: `patience` and `cooldown` count checks of `monitor`
    (evaluations or epoch ends), not epochs; the counters are not reset when a new run
    starts; `mode="auto"` uses the metric's type (loss: min, accuracy: max) and raises for
    others, where Keras looks for "acc" in the name; an unknown `mode` or `monitor`, a
    `factor` outside (0, 1) and negative counts raise instead of being corrected.

    Args:
      loop: the `loopax.Loop`.
      monitor: the metric key: `"eval/<dataset>/<metric>"` (e.g. `"eval/test/mean_loss"`) or
        `"train/<metric>"` (with `run_epochs`).
      factor: the rate is multiplied by it, in (0, 1).
      patience: checks without improvement before a reduction (>= 0; 0 acts as 1).
      min_delta: how much (>= 0) a value must beat the best by to count as an improvement.
      cooldown: checks after a reduction during which no wait is counted (>= 0).
      min_lr: the lowest rate (>= 0).
      mode: `"min"`, `"max"`, or `"auto"`: min for losses, max for accuracies.

    Returns:
      The `ReduceLROnPlateau` (`learning_rate`, `reductions`, `best`, `wait`,
      `cooldown_counter`).

    Raises:
      ValueError: `monitor` names none of the trainer's metric keys (the message lists
        them), `mode` is unknown or "auto" cannot decide, a bad `factor`, `patience`,
        `min_delta`, `cooldown` or `min_lr`, or an optimizer without a settable learning
        rate (a plain `optax.sgd(0.1)`, or one driven by a schedule).

    Example:
      >>> import jax, numpy as np, optax, flax.linen as nn, loopax
      >>> from loopax import hooks
      >>> trainer = loopax.Trainer(lambda ctx, spec, x: nn.Dense(1)(x[0]),
      ...     loopax.losses.mean_squared_error, loopax.optimizers.sgd(0.1),
      ...     devices=jax.devices()[:1])
      >>> loop = loopax.Loop(trainer)
      >>> plateau = hooks.reduce_lr_on_plateau(loop, "eval/test/mean_loss", patience=2)
      >>> plateau.mode
      'min'
      >>> hooks.reduce_lr_on_plateau(loopax.Loop(loopax.Trainer(
      ...     lambda ctx, spec, x: nn.Dense(1)(x[0]), loopax.losses.mean_squared_error,
      ...     optax.sgd(0.1), devices=jax.devices()[:1])), "eval/test/mean_loss")
      Traceback (most recent call last):
      ...
      ValueError: reduce_lr_on_plateau('eval/test/mean_loss') changes the optimizer's ...
    """
    return ReduceLROnPlateau(
        loop,
        monitor,
        factor=factor,
        patience=patience,
        min_delta=min_delta,
        cooldown=cooldown,
        min_lr=min_lr,
        mode=mode,
    )
