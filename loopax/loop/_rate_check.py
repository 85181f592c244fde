"""Whether the learning rate of the update before a non-finite loss was itself not finite.

A learning rate is a value the step computes like the loss (a schedule of the update count,
or a rate set at run time): a schedule that divides by zero at its first count makes the
parameters NaN and the next loss NaN, and the loss's usual advice (a lower learning rate,
clipped gradients, `hooks.nan_guard`) cannot help. Nothing here runs unless a loss went bad.
"""

from __future__ import annotations

import math
from typing import Any

from ..optimizers import get_learning_rate
from ..optimizers._internal import schedule_name, scheduled_learning_rates, update_count

# The one fix for a rate the optimizer state holds (set or injected, not a schedule's).
SET_RATE_FIX = "Set a finite learning rate"


def rate_is(value: float, step: int, source: str | None = None) -> str:
    """`the learning rate is nan at step 6 (global step 7): <where it came from>`.

    The sentence that names a learning rate that is not finite, at loop step `step` (the
    state of global step `step + 1`): the loss check, `hooks.nan_guard` and the checkpoint
    hook's refused save all say it alike.

    Args:
      value: the rate.
      step: the loop step whose update used it (or would).
      source: where it came from (a schedule at an update count); by default, the rate
        the optimizer state holds, set with `set_learning_rate` or injected so.
    """
    if source is None:
        source = (
            f"the optimizer's learning rate is {value} (a value set with set_learning_rate, "
            "or injected so)"
        )
    return f"the learning rate is {value} at step {step} (global step {step + 1}): {source}"


def rate_problem(trainer: Any, step: int, loss: float) -> str | None:
    """The message for a loss first non-finite at loop step `step` after a non-finite rate.

    Returns:
      The sentences that say the learning rate of step `step - 1` was not finite (which
      schedule, at which update count, its value) and the one fix that applies, or None
      when that rate was finite or cannot be told.
    """
    if step < 1 or trainer.state is None:
        return None
    try:
        opt_state = trainer.state.opt_state
        count = update_count(opt_state)
        if count is None:  # no schedule: the rate every step used is the state's
            rate = get_learning_rate(opt_state)
            value = None if rate is None else float(rate)
            if value is None or math.isfinite(value):
                return None
            named = rate_is(value, step - 1)
            fix = SET_RATE_FIX
        else:
            # The update of loop step `step - 1` used the count before it.
            count_then = count - (trainer.global_step - (step - 1))
            rates = scheduled_learning_rates(trainer.optimizer, [count_then])
            if rates is None or math.isfinite(rates[0]):
                return None
            value = rates[0]
            name = schedule_name(trainer.optimizer)
            schedule = f"the schedule {name}" if name else "the learning-rate schedule"
            named = rate_is(
                value, step - 1, f"{schedule} gives {value} at update count {count_then}"
            )
            fix = "Fix the schedule so that it is finite at every count"
    except Exception:  # noqa: BLE001 - a diagnosis never hides the error it explains
        return None
    return (
        f"{named}. That step's update made the parameters non-finite, so the loss is {loss} "
        f"at step {step} (global step {step + 1}), the first non-finite step; stopped before any "
        f"checkpoint could save it. {fix}; a lower learning rate, clipped gradients or "
        "hooks.nan_guard cannot help with it"
    )
