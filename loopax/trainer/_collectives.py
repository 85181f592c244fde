"""Cross-device reductions every step body shares."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .._devices import AXIS


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
        False are left out of the fold, which starts at the first valid one (at least one
        must be). Metrics need not know about padding: a padding example's partial is
        computed, then never merged.
        """
        if self.single:
            return partial
        gathered = jax.lax.all_gather(partial, AXIS)
        result = jax.tree.map(lambda leaf: leaf[0], gathered)
        parts = [
            jax.tree.map(lambda leaf, i=i: leaf[i], gathered) for i in range(1, self.num_devices)
        ]
        if valid is None:
            for part in parts:
                result = merge(result, part)
        else:
            valid_devices = jax.lax.all_gather(valid, AXIS)
            started = valid_devices[0]
            for index, part in enumerate(parts, start=1):
                # `where`, not arithmetic: a padding example's partial may be NaN or inf.
                keep = valid_devices[index]
                result = _where(keep, _where(started, merge(result, part), part), result)
                started = started | keep
        # The fold is identical on every device; pmax marks it replicated for shard_map.
        return jax.tree.map(lambda leaf: jax.lax.pmax(leaf, AXIS), result)


def _where(condition: jax.Array, new: Any, old: Any) -> Any:
    """`new` where `condition`, else `old`, leaf by leaf, in `new`'s dtypes."""
    return jax.tree.map(lambda a, b: jnp.where(condition, a, b).astype(a.dtype), new, old)
