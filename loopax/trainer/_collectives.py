"""Pieces every step body shares: cross-device reductions and the loss's moving average."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ._parallel import AXIS


class LossMovingAverage:
    """The built-in `moving_average_loss` and the count of skipped steps.

    A step's loss is averaged in with weight `max(0.01, 1/count)`.

    Its state is one float32[3] array `(mean, count, skipped)`: every state leaf costs the
    CPU runtime a few microseconds per step, which shows on small models. A skipped step
    (non-finite loss or gradient under `Trainer.skip_non_finite_steps`) leaves the mean
    and count alone and counts itself in `skipped`, so the average is never poisoned.
    """

    new_example_weight = 0.01

    def init(self):
        return jnp.zeros((3,), jnp.float32)

    def accumulate(self, state, loss, ok=None, skipped=None):
        """The state after a step of `loss`.

        With `ok` (a bool scalar), a step that is not ok leaves the mean and count alone
        and counts itself as skipped. With `skipped` only (dynamic loss scaling without
        `skip_non_finite`), the loss is averaged in anyway, non-finite or not, and a
        skipped step is counted.
        """
        count = state[1] + 1.0
        weight = jnp.maximum(self.new_example_weight, 1.0 / count)
        updated = jnp.stack([state[0] * (1.0 - weight) + loss * weight, count, state[2]])
        if ok is not None:
            return jnp.where(ok, updated, state.at[2].add(1.0))
        if skipped is not None:
            return updated.at[2].add(skipped.astype(jnp.float32))
        return updated

    def compute(self, state):
        return state[0]

    def skipped(self, state):
        return state[2]


class Collectives:
    """Cross-device reductions over `AXIS`; plain identities on a single device.

    On one device every collective is a no-op, but XLA's CPU runtime still runs each one
    through a rendezvous: skipping them (and shard_map's replication check, which needs
    them) keeps the 1-device step as lean as a hand-written one.
    """

    def __init__(self, num_devices: int):
        self.num_devices = num_devices
        self.single = num_devices == 1

    def pmean(self, tree: Any) -> Any:
        return tree if self.single else jax.lax.pmean(tree, AXIS)

    def reduce(self, tree: Any) -> Any:
        """Averages float leaves across devices and takes the max of the others."""
        if self.single:
            return tree

        def reduce(leaf):
            if jnp.issubdtype(leaf.dtype, jnp.inexact):
                return jax.lax.pmean(leaf, AXIS)
            return jax.lax.pmax(leaf, AXIS)

        return jax.tree.map(reduce, tree)

    def merge(
        self, merge: Callable[[Any, Any], Any], partial: Any, valid: jax.Array | None = None
    ) -> Any:
        """Combines per-device partial metric states with `merge`, in device order.

        With `valid` (this device's bool scalar), the partials of devices whose `valid` is
        False are left out of the fold; device 0's must be valid. Metrics need not know
        about padding: a padding example's partial is computed, then never merged.
        """
        if self.single:
            return partial
        gathered = jax.lax.all_gather(partial, AXIS)
        valid_devices = None if valid is None else jax.lax.all_gather(valid, AXIS)
        result = jax.tree.map(lambda leaf: leaf[0], gathered)
        for index in range(1, self.num_devices):
            merged = merge(result, jax.tree.map(lambda leaf, i=index: leaf[i], gathered))
            if valid_devices is not None:
                # `where`, not arithmetic: a padding example's partial may be NaN or inf.
                keep = valid_devices[index]
                merged = jax.tree.map(
                    lambda new, old, keep=keep: jnp.where(keep, new, old).astype(new.dtype),
                    merged,
                    result,
                )
            result = merged
        # The fold is identical on every device; pmax marks it replicated for shard_map.
        return jax.tree.map(lambda leaf: jax.lax.pmax(leaf, AXIS), result)
