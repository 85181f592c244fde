"""An epoch's rows on the devices: its order, its permuted copy, and a batch's traced read.

The arrays lie on the devices in the order they were given; with shuffling, the epoch's
permutation says which example each epoch position holds. `permuted_copy` applies it once
per epoch (one compiled gather of the whole epoch), after which every batch is a contiguous
slice of the copy; without the copy each batch's rows are gathered through the permutation
(`rows_of`), batch by batch. `rows_at` is the read that fused programs trace: all of a
group's rows at once, through the two epochs' permutations joined into one array
(`joined_orders`), so that a group's examples are a slice of it, and each array's rows one
gather with no index arithmetic (`take_rows`).
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


def take_rows(array: jax.Array, rows: jax.Array) -> jax.Array:
    """The rows `rows` (int32 indices, 1-d, each in bounds) of `array`, by one gather (traced).

    The gather XLA is given carries no index arithmetic: `array[rows]`, `jnp.take` and
    `array.at[rows].get(mode="promise_in_bounds")` all first map negative indices
    (`select(rows < 0, rows + n, rows)`), and `mode="clip"` clamps them; every index here
    is in bounds by construction (an epoch position or an example a permutation names),
    so neither is needed, and on a fused program's read they were a compare and two
    selects for every element read.
    """
    dimensions = lax.GatherDimensionNumbers(
        offset_dims=tuple(range(1, array.ndim)), collapsed_slice_dims=(0,), start_index_map=(0,)
    )
    return lax.gather(
        array,
        rows[:, None],
        dimensions,
        (1, *array.shape[1:]),
        mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS,
    )


@functools.cache
def _joining(sharding: NamedSharding, end: int) -> Callable[..., Any]:
    """The compiled join of two epochs' permutations as a fused group reads them."""

    def join(order: jax.Array, next_order: jax.Array) -> jax.Array:
        return jnp.concatenate([order[:end], next_order])

    join.__name__ = "join_epoch_orders"
    return jax.jit(join, out_shardings=sharding)


def joined_orders(
    order: jax.Array, next_order: jax.Array, end: int, sharding: NamedSharding
) -> jax.Array:
    """Two epochs' permutations as one array of the examples at consecutive positions.

    Position `p` of the epoch `order` is `joined[p]` up to the epoch's `end`, and the
    next epoch's position `p - end` (from `next_order`) after it, so the examples of a
    run of positions are a contiguous slice of `joined`, whether or not it crosses the
    epochs' boundary (what `rows_at` reads). Made by one compiled program on the devices
    (placed with `sharding`), not waited for.
    """
    return _joining(sharding, end)(order, next_order)


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
    return [take_rows(array, rows) for array in arrays]


def rows_at(
    reading: Reading,
    lying: dict[str, Any],
    start: jax.Array,
    end: jax.Array,
    count: int,
    size: int,
    first: Any = 0,
    local: int | None = None,
) -> tuple[list[jax.Array], list[jax.Array]]:
    """The inputs and labels of `count` batches of `size` from epoch position `start` (traced).

    Of each batch, its `local` rows from row `first` (default: all `size`, from 0: one
    device's share of every batch, on more), flat: each array has `count * local` rows.
    `lying` is where they lie, as `DeviceChunk.arguments` passes it, read as `reading`
    says; positions from `end` (the epoch's end) on are the next epoch's, from its position
    0. Each array is read by one gather of all the rows at once (a fused program reads its
    whole group so, before its steps, whose loop then indexes stacked batches as a
    hand-written scan does). Through the epochs' permutations (`Reading.GATHER`), the
    examples are a slice of the joined permutations (`joined_orders`: no position
    arithmetic), and the gathers carry no index arithmetic (`take_rows`).
    """
    local = size if local is None else local
    inputs, labels = lying["inputs"], lying["labels"]
    arrays = [*inputs, *labels]
    if reading is Reading.GATHER:  # the examples the joined permutations name, in a slice
        orders = lying["orders"]
        if count * size > orders.shape[0]:
            # More batches than two epochs hold: a chunk never has that many (it spans two
            # epochs at most), but a program for that count may be compiled ahead from a
            # shorter chunk's arguments (`with_count`); it is never run on them.
            orders = jnp.resize(orders, (count * size,))
        examples = lax.dynamic_slice_in_dim(orders, start, count * size)
        if local != size:  # this device's share of each batch
            examples = lax.dynamic_slice(
                examples.reshape(count, size), (jnp.zeros((), jnp.int32), first), (count, local)
            ).reshape(-1)
        rows = [take_rows(array, examples) for array in arrays]
        return rows[: len(inputs)], rows[len(inputs) :]
    steps = jnp.arange(count, dtype=jnp.int32)[:, None] * size
    positions = (start + first + steps + jnp.arange(local, dtype=jnp.int32)[None, :]).reshape(-1)
    crossed = positions >= end
    at = jnp.where(crossed, positions - end, positions)
    if reading is Reading.COPY:  # each epoch's permuted copy: rows of one or the other
        upcoming = [*lying["next_inputs"], *lying["next_labels"]]

        def where_crossed(following: jax.Array, current: jax.Array) -> jax.Array:
            mask = crossed.reshape((-1,) + (1,) * (current.ndim - 1))
            return jnp.where(mask, take_rows(following, at), take_rows(current, at))

        rows = [where_crossed(*pair) for pair in zip(upcoming, arrays, strict=True)]
    else:  # in order: position i is example i in every epoch
        rows = [take_rows(array, at) for array in arrays]
    return rows[: len(inputs)], rows[len(inputs) :]
