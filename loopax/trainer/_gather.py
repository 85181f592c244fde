"""Compiled programs of fused steps that take their batches from arrays on the devices.

The data side (`loopax.data`) says where a group's batches lie (`DeviceChunk`) and how
to read them (`Reading`: a slice of arrays in the epoch's order, its permuted copy's
included, or the rows a permutation picks); these programs read them inside the
compiled step. They also return the epoch position after the group (`AFTER`, beside the
metrics), where the next group starts: the host never copies a position to the devices
between groups.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .._devices import AXIS
from ..data._epoch_rows import Reading, batch_rows

# The key of the position after a group, beside the last step's metrics; not a metric:
# the Trainer takes it out before any metric is named (`Programs.train_gathered`).
AFTER = "loopax:position_after"


def position_after(start: jax.Array, end: jax.Array, rows: int) -> jax.Array:
    """The epoch position `rows` after `start` (traced), in the next epoch past `end`.

    As `DeviceChunk.after` computes it on the host.
    """
    after = start + rows
    return jnp.where(after > end, after - end, after)


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

        state, (stacked, last) = scan_steps(state, jnp.arange(count, dtype=jnp.int32), batch_of)
        return state, (stacked, {**last, AFTER: position_after(start, end, count * size)})

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
        state, (stacked, last) = run(state, inputs, labels)
        return state, (stacked, {**last, AFTER: position_after(start, end, count * size)})

    return program
