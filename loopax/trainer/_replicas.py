"""`Trainer.check_replicas`: every copy of a replicated array holds the same bits.

A data-parallel step keeps the parameters, optimizer state and model state replicated: each
device holds a copy, and every step must leave the copies equal. A custom collective, a
nondeterministic op or a faulty device can make one drift silently (bobbin's
`assert_replica_integrity` catches it). Each device computes a fingerprint of each of its
blocks where it lies (one compiled call per device, nothing gathered), the fingerprint the
checkpoints store for a whole array (`sum_i bits_i (2 i + 1) + (i ^ SALT) mod 2**32`, `i` the
element's flat index within the block); with several processes the fingerprints are
exchanged (a few bytes per array and device), and the copies of each block are compared.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_SALT = 0x9E3779B9  # as the checkpoints' fingerprints
_HIGH_MIX = 0x85EBCA6B
_MISSING = -1  # in the exchanged table: a device of another process


class ReplicaMismatchError(RuntimeError):
    """The copies of a replicated array differ between devices.

    Attributes:
      path: the array's path in the train state, e.g. `"params/Dense_0/kernel"`.
      device: the device whose copy differs (from the first device holding that block).
      reference: the first device holding that block, whose copy the others are compared to.
    """

    def __init__(self, message: str, *, path: str, device: Any, reference: Any):
        super().__init__(message)
        self.path = path
        self.device = device
        self.reference = reference


def _words(x: jax.Array) -> jax.Array:
    """The bits of each element as uint32 (64-bit elements folded into one word)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = x.dtype.itemsize
    if size == 8:
        words = jax.lax.bitcast_convert_type(x, jnp.uint32)
        low, high = (
            (words[..., 0], words[..., 1]) if np.little_endian else (words[..., 1], words[..., 0])
        )
        return low ^ (high * jnp.uint32(_HIGH_MIX))
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _fingerprint(x: jax.Array) -> jax.Array:
    words = _words(x).reshape(-1)
    index = jnp.arange(words.shape[0], dtype=jnp.uint32)
    terms = words * (index * jnp.uint32(2) + jnp.uint32(1)) + (index ^ jnp.uint32(_SALT))
    return jnp.sum(terms, dtype=jnp.uint32)


@jax.jit
def _fingerprints(blocks: list[jax.Array]) -> list[jax.Array]:
    # Called with one device's blocks: it runs on that device.
    return [_fingerprint(block) for block in blocks]


def _block_key(index: tuple, device_axis: bool) -> tuple:
    if device_axis:
        index = index[1:]  # pmap's leading device axis: each device's slice is a copy
    return tuple((s.start, s.stop, s.step) if isinstance(s, slice) else s for s in index)


def check_replicas(
    leaves: Sequence[tuple[str, Any]], devices: Sequence[Any], *, device_axis: bool = False
) -> int:
    """Raises `ReplicaMismatchError` unless every block's copies have one fingerprint.

    Args:
      leaves: `(path, array)` in state order; leaves that are not `jax.Array`s are skipped.
      devices: every device of the trainer, in its order (the reference copy of a block is
        the first device holding it).
      device_axis: the arrays have a leading device axis (`parallel="pmap"`): the slices
        along it are the copies.

    Returns:
      How many arrays have copies on several devices (the ones compared).

    Raises:
      ReplicaMismatchError: naming the first array (in state order) and device that differ.
    """
    arrays = [(path, x) for path, x in leaves if isinstance(x, jax.Array)]
    order = {device.id: position for position, device in enumerate(devices)}
    by_device: dict[Any, list[tuple[int, jax.Array]]] = {}
    for number, (_, x) in enumerate(arrays):
        for shard in x.addressable_shards:
            by_device.setdefault(shard.device, []).append((number, shard.data))
    # Dispatched on every device first, then read: the devices compute at once.
    started = [
        (device, [number for number, _ in items], _fingerprints([block for _, block in items]))
        for device, items in by_device.items()
    ]
    # uint32 fingerprints and where they were taken: JAX's default 32-bit types exchange them
    values = np.zeros((len(arrays), len(devices)), np.uint32)
    taken = np.zeros((len(arrays), len(devices)), np.uint32)
    for device, numbers, fingerprints in started:
        for number, value in zip(numbers, jax.device_get(fingerprints), strict=True):
            values[number, order[device.id]] = value
            taken[number, order[device.id]] = 1
    if jax.process_count() > 1:  # each device's fingerprints come from its own process
        from jax.experimental import multihost_utils

        values, taken = (
            np.asarray(gathered).astype(np.uint64).sum(axis=0)
            for gathered in multihost_utils.process_allgather((values, taken))
        )
    table = np.where(taken > 0, values, _MISSING).astype(np.int64)
    compared = 0
    for number, (path, x) in enumerate(arrays):
        blocks: dict[tuple, list[Any]] = {}
        for device, index in x.sharding.devices_indices_map(tuple(x.shape)).items():
            blocks.setdefault(_block_key(index, device_axis), []).append(device)
        replicated = False
        shape = x.shape[1:] if device_axis else x.shape  # one copy's
        for holders in blocks.values():
            holders = sorted(holders, key=lambda device: order.get(device.id, len(order)))
            if len(holders) < 2:
                continue
            replicated = True
            reference = holders[0]
            expected = table[number, order[reference.id]]
            for device in holders[1:]:
                got = table[number, order[device.id]]
                if got != expected:
                    raise ReplicaMismatchError(
                        f"replica mismatch: {path} {x.dtype}{list(shape)} differs on device "
                        f"{device} (process {device.process_index}) from device {reference}: "
                        f"fingerprint {got:08x} vs {expected:08x}. The copies of a replicated "
                        "array must hold the same bits after every step; a custom collective, "
                        "a nondeterministic op or a faulty device made this one diverge. "
                        "Restore the last good checkpoint (hooks.checkpoint restores the newest "
                        "at attach) and look for the op that runs differently per device",
                        path=path,
                        device=device,
                        reference=reference,
                    )
        compared += replicated
    return compared
