"""The device half of `ArrayDataset(..., on_device=True)`: arrays placed once, batches gathered.

The arrays are replicated over the devices once, since any example may fall in any
device's shard of a batch once the epoch's permutation changes. Each epoch's permutation
goes to the devices once too; a batch (or a group of batches) is then one compiled gather
that takes only its start offset from the host, a scalar.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ._parallel import AXIS, Device

Gather = Callable[..., Any]


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
    """An `ArrayDataset`'s arrays and epoch permutation on devices, and its compiled gathers.

    Batches come out split over the devices on their batch axis (as the Trainer's compiled
    step takes them) when the batch size divides by the device count, else replicated.

    Attributes:
      devices: the devices holding a copy of every array.
      inputs: the inputs on the devices (dtypes as JAX canonicalizes them).
      labels: the labels on the devices.
    """

    def __init__(self, inputs: list[Any], labels: list[Any], devices: Sequence[Device]):
        self.devices = list(devices)
        self._mesh = Mesh(np.array(self.devices), (AXIS,))
        self._replicated = NamedSharding(self._mesh, P())
        self.inputs, self.labels = jax.device_put((inputs, labels), self._replicated)
        self._order: jax.Array | None = None
        self._gathers: dict[tuple[int, int, bool], Gather] = {}

    def set_order(self, order: np.ndarray | None) -> None:
        """Puts the epoch's permutation on the devices (None: examples in order)."""
        self._order = (
            None if order is None else jax.device_put(order.astype(np.int32), self._replicated)
        )

    def gather(
        self, start: int, count: int, size: int, stacked: bool
    ) -> tuple[list[jax.Array], list[jax.Array]]:
        """The `count` batches of `size` examples from epoch position `start`, on the devices.

        With `stacked` each array has shape `(count, size, ...)`, else `(size, ...)` (for
        `count == 1`).
        """
        key = (count, size, stacked)
        gather = self._gathers.get(key)
        if gather is None:
            gather = self._gathers[key] = self._compile(count, size, stacked)
        return gather(self.inputs, self.labels, self._order, np.int32(start))

    def _compile(self, count: int, size: int, stacked: bool) -> Gather:
        examples = count * size

        def take(array: jax.Array, order: jax.Array | None, start: jax.Array) -> jax.Array:
            if order is None:
                rows = lax.dynamic_slice_in_dim(array, start, examples)
            else:
                rows = jnp.take(array, lax.dynamic_slice_in_dim(order, start, examples), axis=0)
            return rows.reshape((count, size, *array.shape[1:])) if stacked else rows

        def gather(inputs: list, labels: list, order: jax.Array | None, start: jax.Array) -> Any:
            return (
                [take(array, order, start) for array in inputs],
                [take(array, order, start) for array in labels],
            )

        gather.__name__ = "gather_batches" if stacked else "gather_batch"
        leading = (None,) if stacked else ()
        split = size % len(self.devices) == 0
        batch = NamedSharding(self._mesh, P(*leading, AXIS)) if split else self._replicated
        return jax.jit(gather, out_shardings=batch)
