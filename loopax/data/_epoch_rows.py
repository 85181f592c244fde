"""An epoch's rows on the devices: its order, its permuted copy, and a batch's traced read.

The arrays lie on the devices in the order they were given; with shuffling, the epoch's
permutation says which example each epoch position holds. `permuted_copy` applies it once
per epoch (one compiled gather of the whole epoch), after which every batch is a contiguous
slice of the copy; without the copy each batch's rows are gathered through the permutation
(`rows_of`), batch by batch. `rows_at` is the read that fused programs trace: all of a
group's rows at once.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding


class Reading(enum.Enum):
    """How a compiled program takes a batch's rows from an on-device dataset's arrays."""

    SLICE = "slice"  # the examples lie in order (no shuffling): a batch is a slice
    COPY = "copy"  # a slice of the epoch's permuted copy (shuffled_copy=True)
    GATHER = "gather"  # the rows the epoch's permutation names, picked one by one


@dataclasses.dataclass(frozen=True, eq=False)
class EpochOrder:
    """One epoch's order of the examples on the devices.

    Attributes:
      order: the epoch's permutation (epoch position -> example), or None: in order.
      copy: `(inputs, labels)` permuted into the epoch's order (row i is epoch position
        i), made once for the epoch; None where batches are picked through `order`
        (`shuffled_copy=False`) or the arrays are in order already.
    """

    order: jax.Array | None
    copy: tuple[list[jax.Array], list[jax.Array]] | None

    @property
    def reading(self) -> Reading:
        """How a program takes this epoch's batches."""
        if self.copy is not None:
            return Reading.COPY
        return Reading.SLICE if self.order is None else Reading.GATHER


@functools.cache
def _permuting(sharding: NamedSharding) -> Callable[..., Any]:
    """The compiled permutation of arrays into an epoch's order, placed with `sharding`."""

    def permute(inputs: list, labels: list, order: jax.Array) -> Any:
        # A permutation: every index in bounds, each once, so the gather needs neither a
        # bounds mask nor a clip, which `array[order]` pays (docs/benchmarks.md).
        def take(array: jax.Array) -> jax.Array:
            return array.at[order].get(mode="promise_in_bounds", unique_indices=True)

        return [take(a) for a in inputs], [take(a) for a in labels]

    permute.__name__ = "permute_epoch"
    return jax.jit(permute, out_shardings=sharding)


def permuted_copy(
    inputs: list[jax.Array], labels: list[jax.Array], order: jax.Array, sharding: NamedSharding
) -> tuple[list[jax.Array], list[jax.Array]]:
    """`inputs` and `labels` permuted into the epoch's `order` by one compiled gather.

    Row i of each copy is example `order[i]`; the copies are placed with `sharding` (as the
    arrays are, so the programs compiled for those take them too). Dispatched, not waited
    for.
    """
    return _permuting(sharding)(inputs, labels, order)


def rows_of(
    arrays: list[jax.Array],
    order: jax.Array | None,
    next_order: jax.Array | None,
    first: jax.Array,
    end: jax.Array,
    count: int,
) -> list[jax.Array]:
    """The rows of `count` epoch positions from `first` on, of each array (traced).

    `end` is the epoch's end: from there on positions are the next epoch's, from its
    position 0, in `next_order`. The `count` positions lie on one side of `end` (a
    batch never straddles it). `order`/`next_order` are the epochs' permutations on the
    devices (None: in order, so a batch is a slice).
    """
    crossed = first >= end
    at = jnp.where(crossed, first - end, first)
    if order is None or next_order is None:
        return [lax.dynamic_slice_in_dim(array, at, count) for array in arrays]
    rows = jnp.where(
        crossed,
        lax.dynamic_slice_in_dim(next_order, at, count),
        lax.dynamic_slice_in_dim(order, at, count),
    )
    return [jnp.take(array, rows, axis=0, mode="clip") for array in arrays]


def rows_at(
    reading: Reading, lying: dict[str, Any], positions: jax.Array, end: jax.Array
) -> tuple[list[jax.Array], list[jax.Array]]:
    """The inputs and labels at epoch `positions` (any shape of int32 indices), traced.

    `lying` is where they lie, as `DeviceChunk.arguments` passes it, read as `reading`
    says; positions from `end` (the epoch's end) on are the next epoch's, from its position
    0. Each array is read by one gather of all the positions at once (a fused program reads
    its whole group so, before its steps, whose loop then indexes stacked batches as a
    hand-written scan does). Every position is in bounds by construction, so the gathers
    neither clip nor mask.
    """
    inputs, labels = lying["inputs"], lying["labels"]
    flat = positions.reshape(-1)
    crossed = flat >= end
    at = jnp.where(crossed, flat - end, flat)

    def take(array: jax.Array, rows: jax.Array) -> jax.Array:
        return array.at[rows].get(mode="promise_in_bounds")

    def shaped(array: jax.Array) -> jax.Array:
        return array.reshape((*positions.shape, *array.shape[1:]))

    def where_crossed(upcoming: jax.Array, current: jax.Array) -> jax.Array:
        mask = crossed.reshape((-1,) + (1,) * (current.ndim - 1))
        return jnp.where(mask, upcoming, current)

    arrays = [*inputs, *labels]
    if reading is Reading.COPY:  # each epoch's permuted copy: rows of one or the other
        upcoming = [*lying["next_inputs"], *lying["next_labels"]]
        rows = [
            where_crossed(take(following, at), take(current, at))
            for current, following in zip(arrays, upcoming, strict=True)
        ]
    elif reading is Reading.GATHER:  # the examples the epochs' permutations name
        examples = where_crossed(take(lying["next_order"], at), take(lying["order"], at))
        rows = [take(array, examples) for array in arrays]
    else:  # in order: position i is example i in every epoch
        rows = [take(array, at) for array in arrays]
    rows = [shaped(array) for array in rows]
    return rows[: len(inputs)], rows[len(inputs) :]
