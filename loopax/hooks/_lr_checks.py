"""Whether an optimizer's learning rate can be changed at run time, asked before training."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ..loop import Loop, Priority
from ..optimizers import get_learning_rate, scale_learning_rate, set_learning_rate
from ..optimizers._internal import injected_learning_rates, with_learning_rates
from ..trainer import Trainer
from ._schedules import FirstNSteps
from ._train_state import state_of

_FIX = (
    "Build the optimizer with loopax.optimizers (e.g. loopax.optimizers.adam(1e-3)) or wrap "
    "an optax one with optax.inject_hyperparams (e.g. optax.inject_hyperparams(optax.adam)"
    "(learning_rate=1e-3)), with a float learning rate"
)


def check_optimizer_state(opt_state: Any, what: str, note: str = "") -> None:
    """Raises a ValueError naming `what` unless `opt_state` holds a settable learning rate.

    `opt_state` may hold arrays or shapes.
    """
    if get_learning_rate(opt_state) is None:
        raise ValueError(
            f"{what} changes the optimizer's learning rate while training, but this optimizer "
            f"keeps no learning rate in its state (e.g. optax.sgd(0.1)). {_FIX}.{note}"
        )
    try:
        jax.eval_shape(lambda state: set_learning_rate(state, 1.0), opt_state)
    except ValueError as err:
        raise ValueError(
            f"{what} changes the optimizer's learning rate while training, but a schedule drives "
            "this optimizer's learning rate and would overwrite every change at the next step. "
            f"{_FIX} for the hook to control it, or keep the schedule and drop the hook"
        ) from err


def check_adjustable_learning_rate(trainer: Trainer, what: str, note: str = "") -> bool:
    """Checks the trainer's optimizer now if possible.

    With its state, or initialized on stand-in parameters. Returns False when only the real
    parameters can tell (e.g. `optax.multi_transform` labelled by the parameter tree).

    Raises:
      ValueError: the learning rate cannot be changed at run time.
    """
    state = trainer.state
    if state is not None:
        check_optimizer_state(state.opt_state, what, note)
        return True
    stand_in = {
        "kernel": jax.ShapeDtypeStruct((2, 2), jnp.float32),
        "bias": jax.ShapeDtypeStruct((2,), jnp.float32),
    }
    try:
        opt_state = jax.eval_shape(trainer.optimizer.init, stand_in)
    except Exception:  # noqa: BLE001 - its init needs the real parameters' structure
        return False
    check_optimizer_state(opt_state, what, note)
    return True


def require_adjustable_learning_rate(
    loop: Loop, what: str, note: str = "", hook_name: str | None = None
) -> None:
    """`check_adjustable_learning_rate` now, or at the first step of each run.

    It waits for the first step when only the real parameters can tell (in an OnStep hook named
    after `hook_name`, default `what`).
    """
    if check_adjustable_learning_rate(loop.trainer, what, note):
        return

    def check(loop: Loop, metrics: Any) -> None:
        del metrics
        check_optimizer_state(state_of(loop.trainer, what).opt_state, what, note)

    loop.on_step(
        f"{hook_name or what}: check the learning rate",
        check,
        Priority.VALIDATE,
        when=FirstNSteps(1),
        check_finite=False,
    )


def _state(trainer: Trainer) -> Any:
    state = trainer.state
    if state is None:  # the hooks call these after a step; say so rather than fail obscurely
        raise RuntimeError("the learning rates can be changed once the optimizer state exists")
    return state


def scale_trainer_learning_rate(trainer: Trainer, factor: float, minimum: float = 0.0) -> None:
    """Multiplies each of the trainer's injected learning rates by `factor` (floor `minimum`).

    Each group of an `optax.multi_transform` keeps its own proportion, where
    `trainer.set_learning_rate` would give every group one value.
    """
    state = _state(trainer)
    trainer.state = state.replace(
        opt_state=scale_learning_rate(state.opt_state, factor, minimum=minimum)
    )


def trainer_learning_rates(trainer: Trainer) -> list[float]:
    """Each of the trainer's injected learning rates (one per group), as host floats."""
    return injected_learning_rates(_state(trainer).opt_state)


def set_trainer_learning_rates(trainer: Trainer, rates: list[float]) -> None:
    """Sets the trainer's injected learning rates, one per group (as listed above)."""
    state = _state(trainer)
    trainer.state = state.replace(opt_state=with_learning_rates(state.opt_state, rates))
