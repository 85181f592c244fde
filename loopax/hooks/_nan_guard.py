"""`nan_guard`: skip non-finite steps, roll back to the newest good checkpoint, then stop.

The escalation ladder (as large-model trainers do it by hand, e.g. PaLM's "restart from a
checkpoint before the spike and skip the batches that caused it"):

1. A step whose loss or gradient is NaN or infinite is skipped inside the compiled step:
   parameters, optimizer, model and metric states stay as they were (`train/skipped_steps`
   counts them). Isolated bad batches cost nothing more.
2. After `max_skips` consecutive skipped steps, the newest good checkpoint is restored in
   the same process and the learning rate is multiplied by `lr_factor`; the run goes on from
   there with the next batches of the dataset (the ones that went bad are not replayed).
3. After `max_rollbacks` rollbacks (or at once with `rollback=False`) the run stops with
   `NonFiniteLossError`.

The guard hears of skipped steps when the loop waits for its steps in flight, so each step of
the ladder comes at most the in-flight bound of dispatches late (see `nan_guard`).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NoReturn

from .._validate import positive_int
from ..loop import Loop, NonFiniteLossError, Priority
from ..loop._internal import SET_RATE_FIX, rate_is
from ._checkpointing._checkpointer import CHECKPOINTERS
from ._lr_checks import (
    require_adjustable_learning_rate,
    set_trainer_learning_rates,
    trainer_learning_rates,
)


class NanGuard:
    """Skips non-finite steps, rolls back, then stops; created by `nan_guard`.

    Attributes:
      skipped_steps: every loop step skipped so far in this process, in order.
      consecutive: how many steps in a row were skipped, up to the newest checked one.
      rollbacks: the rollbacks made (restored in a resumed process).
      rolled_back_to: the global steps restored by each rollback of this process.
    """

    rollbacks: int
    consecutive: int

    def __init__(
        self, loop: Loop, max_skips: int, rollback: bool, lr_factor: float, max_rollbacks: int
    ):
        self.loop = loop
        self.max_skips = max_skips
        self.rollback = rollback
        self.lr_factor = lr_factor
        self.max_rollbacks = max_rollbacks
        self.skipped_steps: list[int] = []
        self.consecutive = 0
        self.rollbacks = 0
        self.rolled_back_to: list[int] = []
        self._last_skipped = -2
        self._rolling_back = False
        self._stopping = False  # the stop waits for the steps in flight: their skips counted

    # -- checkpointed state ---------------------------------------------------------------

    def get_state(self) -> dict[str, Any]:
        return {"rollbacks": self.rollbacks}

    def set_state(self, state: dict[str, Any]) -> None:
        if not self._rolling_back:  # a rollback restores older counters: keep the live ones
            self.rollbacks = int(state.get("rollbacks", 0))

    # -- hooks ----------------------------------------------------------------------------

    def _checkpointer(self) -> Any:
        found = self.loop.shared_data.get(CHECKPOINTERS, [])
        return found[-1] if found else None

    def on_start(self, loop: Loop, dataset: Any) -> None:
        del dataset
        self.consecutive, self._last_skipped = 0, -2

    def on_skipped(self, loop: Loop, steps: list[int]) -> None:
        """The loop's non-finite handler: `steps` were skipped in the compiled step."""
        for step in steps:
            self.skipped_steps.append(step)
            self.consecutive = self.consecutive + 1 if step == self._last_skipped + 1 else 1
            self._last_skipped = step
        if self.consecutive >= self.max_skips and not self._stopping:
            self._escalate(loop)

    def _escalate(self, loop: Loop) -> None:
        first = self._last_skipped - self.consecutive + 1
        # The limit was passed at the max_skips-th step in a row; the loop told it later.
        limit_step = first + self.max_skips - 1
        streak = f"{self.max_skips} steps in a row (steps {first} to {limit_step})"
        rate_problem = _non_finite_rate(loop, first, streak)
        if rate_problem is not None:  # neither a rollback nor a lower rate can help
            self._stop(loop, rate_problem, first)
        if not self.rollback:
            self._stop(
                loop,
                f"the loss or gradient was not finite for {streak}, and nan_guard stops "
                f"there (max_skips={self.max_skips}, rollback=False). Lower the learning rate, "
                "clip gradients, or check the data",
                first,
            )
        if self.rollbacks >= self.max_rollbacks:
            self._stop(
                loop,
                f"the loss or gradient was not finite for {streak} after {self.rollbacks} "
                f"rollback(s) (max_rollbacks={self.max_rollbacks}): stopping. Lower the learning "
                "rate, clip gradients, or check the data",
                first,
            )
        checkpointer = self._checkpointer()
        if checkpointer is None:
            self._stop(
                loop,
                f"the loss or gradient was not finite for {streak}, and nan_guard has no "
                "checkpoint to roll back to: no hooks.checkpoint is attached to this loop. "
                "Attach one (e.g. hooks.checkpoint(loop, dir, period_seconds=600)) to roll "
                "back, or pass rollback=False; then lower the learning rate, clip gradients, "
                "or check the data",
                first,
            )
        # The rates in use before the rollback (one per group), which the factor scales.
        rates = trainer_learning_rates(loop.trainer) if self.lr_factor != 1.0 else []
        self._rolling_back = True
        try:
            restored = checkpointer.restore()
        finally:
            self._rolling_back = False
        if restored is None:
            self._stop(
                loop,
                f"the loss or gradient was not finite for {streak}, and there is no checkpoint "
                f"in {str(checkpointer.directory)!r} to roll back to yet",
                first,
            )
        self.rollbacks += 1
        self.rolled_back_to.append(restored)
        self.consecutive, self._last_skipped = 0, -2
        if rates:
            set_trainer_learning_rates(loop.trainer, [rate * self.lr_factor for rate in rates])

    def _stop(self, loop: Loop, message: str, first: int) -> NoReturn:
        """Stops the run with `message`, once the steps in flight have run and been counted.

        The loop told of the streak when it waited for an older window of steps than the
        newest it dispatched; those run anyway (a stop cannot recall them). Waiting for them
        here, before the error, lets it say where the run stopped and how many steps from
        the streak's first were skipped in all, as `train/skipped_steps` counts them.
        """
        streak_index = len(self.skipped_steps) - self.consecutive  # the streak's first skip
        self._stopping = True  # their skips are only counted: this is the stop already
        try:
            loop.check_finite()
        except Exception as error:  # noqa: BLE001 - the count never hides the stop it explains
            raise NonFiniteLossError(
                f"{message}. (Waiting for the steps in flight to count their skips failed: "
                f"{type(error).__name__}: {error})",
                first,
            ) from error
        finally:
            self._stopping = False
        stop = loop.trainer.global_step - 1  # the newest step dispatched, now run
        skipped = self.skipped_steps[streak_index:]
        where = _stopped_at(first + self.max_skips - 1, first, stop, skipped)
        raise NonFiniteLossError(f"{message}. {where}", first)


def _stopped_at(limit_step: int, first: int, stop: int, skipped: list[int]) -> str:
    """Where a stop of nan_guard came, and the steps skipped from the streak's `first` on."""
    if len(skipped) == stop - first + 1:
        counted = f"all {len(skipped)} steps from step {first} on were skipped"
    else:
        counted = (
            f"{len(skipped)} of the {stop - first + 1} steps from step {first} on were "
            f"skipped, the last at step {skipped[-1]}"
        )
    return (
        "nan_guard hears of skipped steps when the loop waits for its steps in flight, not "
        "after each step, and the steps dispatched by then run: the run stopped after step "
        f"{stop} (global step {stop + 1}), {stop - limit_step} step(s) past step {limit_step}, "
        f"and {counted}"
    )


def _non_finite_rate(loop: Loop, first: int, streak: str) -> str | None:
    """The message for skipped steps while the optimizer's learning rate is not finite, or None.

    The rate kept in the optimizer state (set with `set_learning_rate`, or injected) is the
    one every step used: when it is NaN or infinite, the update before loop step `first`
    made the parameters non-finite and every step since is skipped. A rollback would go on
    with the same rate (scaled by `lr_factor`, still not finite): the rate is named first,
    with the one fix that applies, as the loop's own non-finite check names it.
    """
    try:
        rates = trainer_learning_rates(loop.trainer)
    except Exception:  # noqa: BLE001 - a diagnosis never hides the error it explains
        return None
    bad = [rate for rate in rates if not math.isfinite(rate)]
    if not bad:
        return None
    return (
        f"{rate_is(bad[0], first - 1)}. That step's update made the parameters "
        f"non-finite, so the loss or gradient was not finite for {streak}, and nan_guard "
        f"stops: skipping or rolling back goes on with the same rate. {SET_RATE_FIX}; a lower "
        "learning rate, clipped gradients or hooks.nan_guard cannot help with it"
    )


def nan_guard(
    loop: Loop,
    *,
    max_skips: int = 3,
    rollback: bool = True,
    lr_factor: float = 0.5,
    max_rollbacks: int = 3,
) -> NanGuard:
    """Replaces the stop on a non-finite loss with an escalation: skip, roll back, stop.

    A train step whose loss or gradient is NaN or infinite is skipped inside the compiled
    step (parameters and optimizer state unchanged; `train/skipped_steps` counts them in
    `loop.history` and every writer). After `max_skips` consecutive skipped steps the newest
    good checkpoint of the loop's `hooks.checkpoint` is restored in-process, the learning
    rate (the one in use before the rollback) is multiplied by `lr_factor`, and the run goes
    on from that step with the dataset's next batches. After `max_rollbacks` rollbacks it
    stops with `NonFiniteLossError`; with `rollback=False` it stops after `max_skips`
    consecutive skips instead.

    Skips are heard of when the loop waits for its steps in flight (no per-step host sync),
    so a rollback or stop comes at most the loop's in-flight bound of dispatches after the
    `max_skips`-th skipped step in a row: 32 on one device, 8 over several devices, 4 over
    several simulated CPU devices of one process (each dispatch up to `steps_per_execution`
    steps). The steps dispatched by then run (skipped too while the fault lasts); a stop
    waits for them, and its error names the step where `max_skips` was passed, the step the
    run stopped after, and how many steps from the streak's first on were skipped (as
    `train/skipped_steps` counts them).

    Args:
      loop: the `loopax.Loop`.
      max_skips: consecutive skipped steps that trigger a rollback (or the stop).
      rollback: roll back to the newest good checkpoint of `hooks.checkpoint`. Attached
        without one, nan_guard still skips bad steps; a streak that calls for a rollback
        then stops the run with `NonFiniteLossError` naming the missing hook.
      lr_factor: multiplies the learning rate at each rollback (1.0 keeps it); needs an
        optimizer whose learning rate can change (`loopax.optimizers`, or
        `optax.inject_hyperparams`).
      max_rollbacks: rollbacks before it stops.

    Returns:
      The `NanGuard`.

    Raises:
      ValueError: bad counts or factor; an optimizer whose learning rate cannot change with
        `lr_factor != 1`.
    """
    max_skips = positive_int("max_skips", max_skips)
    max_rollbacks = positive_int("max_rollbacks", max_rollbacks)
    if (
        isinstance(lr_factor, bool)
        or not isinstance(lr_factor, numbers.Real)
        or not math.isfinite(lr_factor)
        or not 0 < lr_factor <= 1
    ):
        raise ValueError(f"lr_factor must be a number in (0, 1], got lr_factor={lr_factor!r}")
    guard = NanGuard(loop, max_skips, bool(rollback), float(lr_factor), max_rollbacks)
    if guard.rollback and guard.lr_factor != 1.0:
        require_adjustable_learning_rate(loop, f"nan_guard(lr_factor={guard.lr_factor:g})")
    loop.trainer.skip_non_finite_steps(True)
    loop.handle_non_finite(guard.on_skipped)
    loop.add_state("nan_guard", guard)
    loop.on_start("nan_guard", guard.on_start, Priority.VALIDATE)
    return guard
