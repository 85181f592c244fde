"""The device half of `ArrayDataset(..., on_device=True)`: arrays placed once, batches sliced.

The arrays are replicated over the devices once, since any example may fall in any
device's shard of a batch once the epoch's permutation changes. Each epoch's permutation
goes to the devices once too, and (`shuffled_copy=True`, the default) one compiled gather
permutes the arrays into a copy in the epoch's order, so that every batch of the epoch is a
contiguous slice of it, as a hand-written loop over pre-shuffled data reads its batches: a
gather of the whole epoch at once costs a fraction of gathering each batch's rows inside the
steps. A batch (or a group of batches) is then one compiled program that takes only its
start offset, a scalar already on the devices: each program returns the offset after its
batches, where the next read starts, so a run copies nothing from the host but a new
epoch's permutation. The fused Loop goes further: it hands the Trainer a `DeviceChunk`
(where a group's batches lie) and the Trainer's compiled program reads them itself, so a
group of steps is a single dispatch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .._devices import AXIS, Device
from ._epoch_rows import EpochOrder, Reading, joined_orders, permuted_copy, rows_of

Gather = Callable[..., Any]
_KEPT_POSITIONS = 8  # device scalars of positions the host named, kept for reuse


def check_devices(devices: Sequence[Device] | None, name: str) -> list[Device]:
    """The devices to hold the arrays: `devices`, or all of `jax.devices()`.

    Raises:
      ValueError: `devices` is empty, holds something that is not a jax device, or a
        device of another process (each process holds its own data).
    """
    if devices is None:
        return list(jax.devices())
    if isinstance(devices, jax.Device):
        devices = [devices]
    chosen = list(devices)
    if not chosen:
        raise ValueError(
            f"ArrayDataset {name!r} got devices=[]; pass devices=None (all of jax.devices()) "
            "or the Trainer's devices"
        )
    for position, device in enumerate(chosen):
        if not isinstance(device, jax.Device):
            raise ValueError(
                f"ArrayDataset {name!r} devices[{position}] is a {type(device).__name__}, not "
                "a jax device; pass devices from jax.devices() (the Trainer's devices)"
            )
        if device.process_index != jax.process_index():
            raise ValueError(
                f"ArrayDataset {name!r} devices[{position}] ({device}) belongs to process "
                f"{device.process_index}, not this one ({jax.process_index()}); with "
                "on_device=True pass this process's devices (jax.local_devices())"
            )
    return chosen


class DeviceArrays:
    """An `ArrayDataset`'s arrays and epoch order on devices, and its compiled gathers.

    Batches come out split over the devices on their batch axis (as the Trainer's compiled
    step takes them) when the batch size divides by the device count, else replicated.

    Args:
      inputs: the inputs, host or device arrays.
      labels: the labels.
      devices: the devices to hold a copy of every array.
      shuffled_copy: with a permutation set, permute the arrays into a copy in the epoch's
        order once per epoch (twice the data's memory on every device), so that a batch is
        a slice of it; else pick each batch's rows through the permutation.

    Attributes:
      devices: the devices holding a copy of every array.
      inputs: the inputs on the devices (dtypes as JAX canonicalizes them), in order.
      labels: the labels on the devices, in order.
      shuffled_copy: whether each shuffled epoch is read from a permuted copy.
    """

    def __init__(
        self,
        inputs: list[Any],
        labels: list[Any],
        devices: Sequence[Device],
        shuffled_copy: bool = True,
    ):
        self.devices = list(devices)
        self.shuffled_copy = shuffled_copy
        self._mesh = Mesh(np.array(self.devices), (AXIS,))
        self._replicated = NamedSharding(self._mesh, P())
        self.inputs, self.labels = jax.device_put((inputs, labels), self._replicated)
        self._order: jax.Array | None = None
        self._epoch: EpochOrder | None = None
        self._group_epoch: EpochOrder | None = None
        self._key: Hashable | None = None
        self._gathers: dict[tuple[int, int, bool], Gather] = {}
        # Epoch positions as device scalars, so that no step copies one from the host: the
        # position after the last read, as its program computed it (`advance`), and a few
        # the host names otherwise (0 at each epoch's start, an epoch's end, a restored one).
        self._cursor: tuple[int, jax.Array] | None = None
        self._positions: dict[int, jax.Array] = {}
        # The joined permutations fused groups read (`joined`), for the last pairs of epochs.
        self._joined: list[tuple[EpochOrder, EpochOrder, int, jax.Array]] = []

    def set_order(self, order: np.ndarray | None) -> None:
        """Puts the epoch's permutation on the devices (None: examples in order).

        The previous epoch's permuted copy is dropped here (its memory goes once the steps
        reading it are done); this epoch's is made when its first batch is read, so an epoch
        that is never read (a restored position's replaced start, the epoch a last `reset`
        begins) costs no copy.
        """
        self._order = (
            None if order is None else jax.device_put(order.astype(np.int32), self._replicated)
        )
        self._epoch = self._group_epoch = None

    @property
    def order(self) -> jax.Array | None:
        """The current epoch's permutation on the devices (None: examples in order)."""
        return self._order

    @property
    def epoch(self) -> EpochOrder:
        """The current epoch's order, with its permuted copy (made here on first use)."""
        epoch = self._epoch
        if epoch is None:
            copy = None
            if self._order is not None and self.shuffled_copy:
                # A module function, not a jit bound at construction: tests count copies.
                copy = permuted_copy(self.inputs, self.labels, self._order, self._replicated)
            epoch = self._epoch = EpochOrder(self._order, copy)
        return epoch

    @property
    def group_epoch(self) -> EpochOrder:
        """The current epoch's order as fused groups read it: through the permutation.

        A fused group reads all its rows by one gather before its steps whichever way they
        lie, so a permuted copy would add only its own cost (a gather of the whole epoch at
        its start, and the data's memory again); single batches read the copy (`epoch`).
        """
        epoch = self._group_epoch
        if epoch is None:
            epoch = self._group_epoch = EpochOrder(self._order, None)
        return epoch

    def joined(self, epoch: EpochOrder, upcoming: EpochOrder, end: int) -> jax.Array:
        """`epoch`'s permutation up to position `end`, then `upcoming`'s, on the devices.

        What a fused group reads its examples from (`joined_orders`): one slice of it
        names a group's examples, across the epochs' boundary or not, so that the program
        does no arithmetic on positions. Joined once per pair of epochs (a group within
        one epoch joins it with itself, so that every group's program takes the same
        shape), on the devices: nothing is copied from the host.
        """
        for held in self._joined:
            if held[0] is epoch and held[1] is upcoming and held[2] == end:
                return held[3]
        assert epoch.order is not None and upcoming.order is not None, "join needs orders"
        joined = joined_orders(epoch.order, upcoming.order, end, self._replicated)
        # The pairs in use: a group's within the epoch, or the one crossing into the next,
        # then the next epoch's (a pair let go is joined again if a chunk still needs it).
        self._joined = [*self._joined[-1:], (epoch, upcoming, end, joined)]
        return joined

    @property
    def key(self) -> Hashable:
        """What a program compiled for these arrays depends on: their avals and devices."""
        if self._key is None:
            avals = tuple(a.aval for a in [*self.inputs, *self.labels])
            self._key = (len(self.inputs), avals, tuple(self.devices))
        return self._key

    def position(self, value: int) -> jax.Array:
        """Epoch position `value` as an int32 scalar on the devices (replicated).

        The position the last read's program computed, when it is that one (the steady
        state: one batch or group after another); else one kept for `value` (an epoch's
        start or end), put on the devices once. So a step reading the next batches copies
        nothing from the host: on an accelerator each copy is a transfer and a wait.
        """
        cursor = self._cursor
        if cursor is not None and cursor[0] == value:
            return cursor[1]
        held = self._positions.get(value)
        if held is None:
            if len(self._positions) >= _KEPT_POSITIONS:  # e.g. positions restored many times
                self._positions.clear()
            held = jax.device_put(np.int32(value), self._replicated)
            self._positions[value] = held
        return held

    def advance(self, value: int, position: jax.Array) -> None:
        """Records `position`, a program's device scalar, as epoch position `value`."""
        self._cursor = (value, position)

    def gather(
        self, start: int, count: int, size: int, stacked: bool, epoch: EpochOrder | None = None
    ) -> tuple[list[jax.Array], list[jax.Array]]:
        """The `count` batches of `size` examples from epoch position `start`, on the devices.

        With `stacked` each array has shape `(count, size, ...)`, else `(size, ...)` (for
        `count == 1`). `epoch` is the epoch's order on the devices (default: the current
        epoch's); from its permuted copy the batches are a slice. The program also returns
        the position after them, which the next read of the epoch starts from (`position`).
        """
        key = (count, size, stacked)
        gather = self._gathers.get(key)
        if gather is None:
            gather = self._gathers[key] = self._compile(count, size, stacked)
        epoch = self.epoch if epoch is None else epoch
        at = self.position(start)
        if epoch.copy is not None:
            inputs, labels, after = gather(*epoch.copy, None, at)
        else:
            inputs, labels, after = gather(self.inputs, self.labels, epoch.order, at)
        self.advance(start + count * size, after)
        return inputs, labels

    def _compile(self, count: int, size: int, stacked: bool) -> Gather:
        def gather(inputs: list, labels: list, order: jax.Array | None, start: jax.Array) -> Any:
            # Within one epoch: the end is past the last position read.
            end = start + count * size
            rows = rows_of([*inputs, *labels], order, order, start, end, count * size)
            if stacked:
                rows = [array.reshape((count, size, *array.shape[1:])) for array in rows]
            return rows[: len(inputs)], rows[len(inputs) :], end

        gather.__name__ = "gather_batches" if stacked else "gather_batch"
        leading = (None,) if stacked else ()
        split = size % len(self.devices) == 0
        batch = NamedSharding(self._mesh, P(*leading, AXIS)) if split else self._replicated
        return jax.jit(gather, out_shardings=(batch, batch, self._replicated))


@dataclasses.dataclass(frozen=True)
class DeviceChunk:
    """Where `count` steps' batches of `size` examples lie on the devices, not yet taken.

    They start at epoch position `start` of the epoch `epoch`; positions from `end` (that
    epoch's end) on continue the next epoch, `next_epoch`. A chunk spans at most these two
    epochs. The Trainer compiles the slicing (or gathering) into its fused steps
    (`gathering_steps`).
    """

    source: DeviceArrays
    count: int
    size: int
    start: int
    end: int
    epoch: EpochOrder
    next_epoch: EpochOrder

    @property
    def order(self) -> jax.Array | None:
        """The epoch's permutation on the devices (None: in order)."""
        return self.epoch.order

    @property
    def next_order(self) -> jax.Array | None:
        """The next epoch's permutation on the devices (None: in order)."""
        return self.next_epoch.order

    @property
    def reading(self) -> Reading:
        """How the program takes the batches (both epochs are read alike)."""
        return self.epoch.reading

    def arguments(self) -> tuple:
        """The compiled program's arguments after the state (see `gathering_steps`).

        Where the batches lie (a dict of named arrays, for `rows_at`), then the start
        and end positions, as device scalars (`DeviceArrays.position`: the start is the
        one the previous group's program returned, so nothing is copied from the host).
        """
        epoch, upcoming = self.epoch, self.next_epoch
        lying: dict[str, Any]
        if epoch.copy is not None and upcoming.copy is not None:
            (inputs, labels), (next_inputs, next_labels) = epoch.copy, upcoming.copy
            lying = {
                "inputs": inputs,
                "labels": labels,
                "next_inputs": next_inputs,
                "next_labels": next_labels,
            }
        else:
            lying = {"inputs": self.source.inputs, "labels": self.source.labels}
            if epoch.order is not None:  # the examples at consecutive positions of both
                lying["orders"] = self.source.joined(epoch, upcoming, self.end)
        source = self.source
        return lying, source.position(self.start), source.position(self.end)

    @property
    def after(self) -> int:
        """The epoch position after this chunk's batches (the next epoch's, past `end`)."""
        after = self.start + self.count * self.size
        return after - self.end if after > self.end else after

    def shapes(self) -> tuple[list[jax.ShapeDtypeStruct], list[jax.ShapeDtypeStruct]]:
        """The shapes and dtypes of the gathered batches, `(count, size, ...)`."""

        def stacked(array: jax.Array) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct((self.count, self.size, *array.shape[1:]), array.dtype)

        return [stacked(a) for a in self.source.inputs], [stacked(a) for a in self.source.labels]

    def first_batch(self) -> tuple[list[jax.Array], list[jax.Array]]:
        """The first step's batch, gathered now (to create or check the model's state)."""
        return self.source.gather(self.start, 1, self.size, stacked=False, epoch=self.epoch)

    def step_examples(self, index: int) -> np.ndarray:
        """The dataset's indices of the examples of this chunk's step `index`, in batch order.

        Read from the devices (the epoch's permutation): for diagnosing a bad step, not
        for the steps' path.
        """
        step = self.part(index, 1)
        positions = np.arange(step.start, step.start + self.size)
        order = step.epoch.order
        return positions if order is None else np.asarray(jax.device_get(order))[positions]

    def part(self, offset: int, count: int) -> DeviceChunk:
        """The `count` steps from step `offset` of this chunk."""
        start = self.start + offset * self.size
        if start >= self.end:  # all in the next epoch
            return dataclasses.replace(
                self, count=count, start=start - self.end, epoch=self.next_epoch
            )
        return dataclasses.replace(self, count=count, start=start)
