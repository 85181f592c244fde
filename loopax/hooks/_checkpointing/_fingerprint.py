"""Checksums of arrays that do not depend on how the arrays are laid out over devices.

The fingerprint of an array is `sum_i(bits_i * (2 i + 1) + (i ^ SALT)) mod 2**32` over its
elements in row-major order (`i` the flat index, `bits_i` the element's bits as an unsigned
integer): a sum of terms that each element computes from its own value and position. So it
is the same whatever the layout (whole on one device, replicated, or sharded over devices of
several processes), it is computed where the shards lie, by a compiled reduction over the
global array, with no array gathered to one host, and the host computes the same number from
a numpy array read back from disk. One element changed by one unit in the last place changes
it (by an odd multiple of 1 modulo 2**32); so does a swap of two different elements (by
`2 (a - b) (i - j)`, nonzero but for rare multiples of 2**32).

A stored fingerprint reads `"<dtype>[<shape>]:<8 hex digits>"`, so that an array read back
with another shape or dtype does not match either.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

SALT = 0x9E3779B9  # odd, so that `i ^ SALT` tells apart arrays of different sizes
_HIGH_MIX = 0x85EBCA6B  # mixes the high word of a 64-bit element into its low word
_CHUNK = 1 << 20  # elements per host chunk: bounds the host's index arrays to a few MiB


def describe(dtype: Any, shape: Sequence[int], value: int) -> str:
    """The stored form of a fingerprint: `"float32[8,64]:1a2b3c4d"`."""
    dims = ",".join(str(int(d)) for d in shape)
    return f"{np.dtype(dtype).name}[{dims}]:{int(value) & 0xFFFFFFFF:08x}"


# -- on the host ---------------------------------------------------------------------------


def _host_words(array: np.ndarray) -> np.ndarray:
    """The bits of each element as uint32, flat in row-major order."""
    flat = np.ascontiguousarray(array).reshape(-1)
    size = flat.dtype.itemsize
    if size == 8:
        words = flat.view(np.uint32).reshape(-1, 2)
        low, high = (words[:, 0], words[:, 1]) if _little_endian() else (words[:, 1], words[:, 0])
        return low ^ (high * np.uint32(_HIGH_MIX))
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32}[size]
    return flat.view(unsigned).astype(np.uint32, copy=False)


def _little_endian() -> bool:
    return np.little_endian


def _salt_sum(count: int) -> int:
    """`sum(i ^ SALT for i in range(count)) mod 2**32`, bit by bit (it holds no data)."""
    total = 0
    for bit in range(32):
        period, half = 1 << (bit + 1), 1 << bit
        ones = (count // period) * half + max(0, count % period - half)  # i < count with bit
        if SALT >> bit & 1:
            ones = count - ones
        total += ones << bit
    return total & 0xFFFFFFFF


@functools.lru_cache(maxsize=1)
def _odd() -> np.ndarray:
    """`2 j + 1` for the positions `j` of a chunk (4 MiB, made once)."""
    odd = np.arange(_CHUNK, dtype=np.uint32) * np.uint32(2) + np.uint32(1)
    odd.setflags(write=False)
    return odd


def host_fingerprint(array: Any) -> str:
    """The fingerprint of a host array (numpy or anything `np.asarray` takes).

    The same number as on the devices, computed as `sum(bits * (2 i + 1)) + sum(i ^ SALT)`:
    per chunk at `start`, `sum(bits * (2 j + 1)) + 2 start sum(bits)` over its own `j`.
    """
    array = np.asarray(array)
    words = _host_words(array)
    size = min(words.size, _CHUNK)
    odd = _odd()
    product = np.empty(size, np.uint32)
    total = _salt_sum(words.size)
    with np.errstate(over="ignore"):
        for start in range(0, words.size, _CHUNK):
            chunk = words[start : start + _CHUNK]
            part = product[: chunk.size]
            np.multiply(chunk, odd[: chunk.size], out=part)
            total += int(part.sum(dtype=np.uint32))
            total += 2 * start * int(chunk.sum(dtype=np.uint32))
    return describe(array.dtype, array.shape, total & 0xFFFFFFFF)


# -- on the devices ------------------------------------------------------------------------


def _device_words(x: jax.Array) -> jax.Array:
    """The bits of each element as uint32, in `x`'s own shape (no reshape: no data moves)."""
    size = x.dtype.itemsize
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if size == 8:
        words = jax.lax.bitcast_convert_type(x, jnp.uint32)  # trailing axis: 2 words
        low, high = (
            (words[..., 0], words[..., 1]) if _little_endian() else (words[..., 1], words[..., 0])
        )
        return low ^ (high * jnp.uint32(_HIGH_MIX))
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _flat_index_of(local: Sequence[int], global_shape: Sequence[int], offsets: Sequence[Any]):
    index = jnp.zeros(tuple(local), jnp.uint32)
    stride = 1
    for axis in reversed(range(len(local))):  # built where each block is: no data moves
        along = jax.lax.broadcasted_iota(jnp.uint32, tuple(local), axis) + offsets[axis]
        index = index + along * jnp.uint32(stride)
        stride = (stride * int(global_shape[axis])) & 0xFFFFFFFF
    return index


def _terms_sum(words: jax.Array, index: jax.Array) -> jax.Array:
    terms = words * (index * jnp.uint32(2) + jnp.uint32(1)) + (index ^ jnp.uint32(SALT))
    return jnp.sum(terms, dtype=jnp.uint32)


def _finite(x: jax.Array) -> jax.Array:
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.all(jnp.isfinite(x))
    return jnp.bool_(True)


def _entry_axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _block_checks(
    shape: tuple[int, ...], sharding: jax.sharding.NamedSharding
) -> Callable[[jax.Array], tuple[jax.Array, jax.Array]]:
    """Per device: the partial fingerprint of its block of `x` and whether it is finite.

    A `shard_map` over `x`'s own mesh and partition spec: each device sums the terms of its
    own block at its global positions; a block that is a replica (along a mesh axis the
    spec does not use) counts only on the first device of its replicas, so the partial sums
    of all devices add up to the fingerprint. No collective: the sums are added on the hosts.
    """
    mesh, spec = sharding.mesh, sharding.spec
    entries = list(spec) + [None] * (len(shape) - len(spec))
    used = {axis for entry in entries for axis in _entry_axes(entry)}
    unused = [axis for axis in mesh.axis_names if axis not in used]
    global_shape = shape

    def body(block: jax.Array) -> tuple[jax.Array, jax.Array]:
        offsets = []
        for dim, entry in enumerate(entries):
            position = jnp.uint32(0)
            for axis in _entry_axes(entry):
                position = position * jnp.uint32(mesh.shape[axis]) + jax.lax.axis_index(
                    axis
                ).astype(jnp.uint32)
            offsets.append(position * jnp.uint32(block.shape[dim]))
        index = _flat_index_of(block.shape, global_shape, offsets)
        partial = _terms_sum(_device_words(block), index)
        first = jnp.bool_(True)
        for axis in unused:
            first = first & (jax.lax.axis_index(axis) == 0)
        partial = jnp.where(first, partial, jnp.uint32(0))
        return partial.reshape(1), _finite(block).reshape(1)

    every = jax.sharding.PartitionSpec(tuple(mesh.axis_names))
    return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=(every, every), check_vma=False)


@functools.lru_cache(maxsize=8)
def _program(layouts: tuple[tuple[tuple[int, ...], Any], ...]) -> Callable[..., Any]:
    """One compiled program for arrays of these (shape, sharding): kept for the next save."""
    blocks = [_block_checks(shape, sharding) for shape, sharding in layouts]
    return jax.jit(lambda arrays: [block(x) for block, x in zip(blocks, arrays, strict=True)])


def device_checks(arrays: list[jax.Array]) -> list[tuple[jax.Array, jax.Array]]:
    """Starts computing, per device, each array's partial fingerprint and finite check.

    One compiled program over every array (each a `jax.Array` with a `NamedSharding`),
    with no collective: it only dispatches, and no process waits for another. Read the
    results with `local_checks` (each process its own devices' parts) and add the parts of
    every process with `combine`.
    """
    arrays = list(arrays)
    for x in arrays:
        if not isinstance(x.sharding, jax.sharding.NamedSharding):
            raise TypeError(
                f"fingerprints on the devices need arrays with a NamedSharding, got a "
                f"{type(x.sharding).__name__}"
            )
    return _program(tuple((tuple(x.shape), x.sharding) for x in arrays))(arrays)


def local_checks(checks: list[tuple[jax.Array, jax.Array]]) -> tuple[list[int], list[bool]]:
    """This process's part of `device_checks`: per array, its devices' sum and finiteness."""
    sums, finite = [], []
    for partial, ok in checks:
        total = 0
        for shard in partial.addressable_shards:
            total = (total + int(np.asarray(shard.data).sum(dtype=np.uint64))) & 0xFFFFFFFF
        sums.append(total)
        finite.append(all(bool(np.asarray(shard.data).all()) for shard in ok.addressable_shards))
    return sums, finite


def combine(parts: Sequence[tuple[list[int], list[bool]]]) -> tuple[list[int], list[bool]]:
    """Every process's `local_checks` added up: the fingerprint sums and finiteness."""
    count = len(parts[0][0])
    sums = [sum(part[0][i] for part in parts) & 0xFFFFFFFF for i in range(count)]
    finite = [all(part[1][i] for part in parts) for i in range(count)]
    return sums, finite
