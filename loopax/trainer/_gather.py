"""Compiled programs of fused steps that take their batches from arrays on the devices.

The data side (`loopax.data`) says where a group's batches lie (`DeviceChunk`) and how
to read them (`Reading`: a slice of arrays in the epoch's order, its permuted copy's
included, or the rows a permutation picks); these programs read them inside the
compiled step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .._devices import AXIS
from ..data._epoch_rows import Reading, batch_rows


def gathering_steps(
    scan_steps: Callable[..., Any], count: int, size: int, num_devices: int, reading: Reading
) -> Callable[..., Any]:
    """A per-device program of `count` fused steps that takes each step's shard itself.

    `scan_steps(state, xs, batch_of)` runs a step on `batch_of(x)` per `x` of `xs`
    (`StepBuilder.scan_steps`); here each step slices (or, reading through a permutation,
    gathers) this device's `size // num_devices` examples of its batch from the arrays on
    the device, inside the scan, as a hand-written scan indexes its stacked batches. The
    result takes `(state, *DeviceChunk.arguments())`, all replicated.
    """
    local = size // num_devices

    def program(state, lying, start, end):
        device = lax.axis_index(AXIS)

        def batch_of(step: jax.Array) -> tuple[list[jax.Array], list[jax.Array]]:
            first = start + step * size + device * local
            return batch_rows(reading, lying, first, end, local)

        return scan_steps(state, jnp.arange(count, dtype=jnp.int32), batch_of)

    return program


def gathering(
    run: Callable[..., Any], count: int, size: int, reading: Reading
) -> Callable[..., Any]:
    """`run(state, inputs, labels)` (fused steps) with its batches taken first.

    For strategies whose per-device program cannot take the arrays replicated (pmap, a
    mesh's global batch): the `count` batches are taken into one stacked array, then run.
    The result takes `(state, *DeviceChunk.arguments())`.
    """

    def program(state, lying, start, end):
        def batch(step: jax.Array) -> tuple[list[jax.Array], list[jax.Array]]:
            return batch_rows(reading, lying, start + step * size, end, size)

        inputs, labels = lax.map(batch, jnp.arange(count, dtype=jnp.int32))
        return run(state, inputs, labels)

    return program
