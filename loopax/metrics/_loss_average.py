"""The trainer's built-in `moving_average_loss`, which also counts the skipped steps."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from ._base import Metric
from ._mean import MeanState, add_mean_states, mean_of


class LossMovingAverage(Metric):
    """The moving average of the train loss, and the count of skipped steps.

    A step's loss is averaged in with weight `max(0.01, 1/count)`, as `MovingAverage`
    does with a batch mean. Its state is one packed float32[3] array `(mean, count,
    skipped)`: every state leaf costs the CPU runtime a few microseconds per step, which
    shows on small models. A skipped step (non-finite loss or gradient under
    `Trainer.skip_non_finite_steps`) leaves the mean and count alone and counts itself in
    `skipped`, so the average is never poisoned.

    The trainer folds in each step's loss, already the mean over the devices, with
    `add_loss`. As a `Metric` it is fed the loss in place of the predictions:
    `update(labels, [losses])` summarizes a batch's per-example losses (or its mean loss)
    as a `MeanState`, whose mean `accumulate` folds in as one step.

    Example:
      >>> import jax.numpy as jnp
      >>> average = LossMovingAverage()
      >>> state = average.add_loss(average.init(), jnp.float32(2.0))
      >>> state = average.add_loss(state, jnp.float32(4.0))
      >>> float(average.compute(state)), float(average.skipped(state))
      (3.0, 0.0)
    """

    name = "moving_average_loss"
    short_name = "~loss"
    metric_type = "loss"
    new_example_weight = 0.01

    def init(self) -> jax.Array:
        """Returns `(mean, count, skipped)` before any step: float32 zeros."""
        return jnp.zeros((3,), jnp.float32)

    def update(self, labels: Sequence[jax.Array], predictions: Sequence[jax.Array]) -> MeanState:
        """Returns one batch's losses as a `MeanState`.

        Args:
          labels: unused.
          predictions: `[losses]`: the batch's per-example losses, or its mean loss.

        Returns:
          The sum of the losses and their count, float32 scalars.
        """
        del labels
        losses = jnp.asarray(predictions[0], jnp.float32)
        return MeanState(jnp.sum(losses), jnp.asarray(losses.size, jnp.float32))

    def merge(self, a: MeanState, b: MeanState) -> MeanState:
        """Adds the `MeanState`s of two disjoint parts of a batch."""
        return add_mean_states(a, b)

    def accumulate(self, state: jax.Array, partial: MeanState) -> jax.Array:
        """Folds a whole batch's losses in as one step (see `add_loss`)."""
        return self.add_loss(state, mean_of(partial))

    def add_loss(
        self,
        state: jax.Array,
        loss: jax.Array,
        ok: jax.Array | None = None,
        skipped: jax.Array | None = None,
    ) -> jax.Array:
        """The state after a step of `loss` (a float32 scalar).

        Args:
          state: the running `(mean, count, skipped)`.
          loss: the step's loss.
          ok: a bool scalar, or None: a step that is not ok leaves the mean and count
            alone and counts itself as skipped.
          skipped: a bool scalar, or None; used without `ok` (dynamic loss scaling
            without `skip_non_finite`): the loss is averaged in anyway, non-finite or not,
            and a skipped step is counted.

        Returns:
          The new float32[3] state.
        """
        count = state[1] + 1.0
        weight = jnp.maximum(self.new_example_weight, 1.0 / count)
        updated = jnp.stack([state[0] * (1.0 - weight) + loss * weight, count, state[2]])
        if ok is not None:
            return jnp.where(ok, updated, state.at[2].add(1.0))
        if skipped is not None:
            return updated.at[2].add(skipped.astype(jnp.float32))
        return updated

    def compute(self, state: jax.Array) -> jax.Array:
        """Returns the moving average (0 before any step)."""
        return state[0]

    def skipped(self, state: jax.Array) -> jax.Array:
        """Returns how many steps were skipped since the state was fresh (a float32 scalar)."""
        return state[2]
