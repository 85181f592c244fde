"""Compiled programs of fused steps that take their batches from arrays on the devices.

The data side (`loopax.data`) says where a group's batches lie (`DeviceChunk`); these
programs slice or gather them inside the compiled step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .._devices import AXIS
from ..data._device_data import rows_of


def gathering_steps(
    scan_steps: Callable[..., Any], count: int, size: int, num_devices: int
) -> Callable[..., Any]:
    """A per-device program of `count` fused steps that takes each step's shard itself.

    `scan_steps(state, xs, batch_of)` runs a step on `batch_of(x)` per `x` of `xs`
    (`StepBuilder.scan_steps`); here each step slices (or, shuffled, gathers) this
    device's `size // num_devices` examples of its batch from the arrays on the device,
    inside the scan, as a hand-written scan indexes its stacked batches. The result takes
    `(state, *DeviceChunk.arguments())`, all replicated.
    """
    local = size // num_devices

    def program(state, inputs, labels, order, next_order, start, end):
        device = lax.axis_index(AXIS)

        def batch_of(step: jax.Array) -> tuple[list[jax.Array], list[jax.Array]]:
            first = start + step * size + device * local
            rows = rows_of([*inputs, *labels], order, next_order, first, end, local)
            return rows[: len(inputs)], rows[len(inputs) :]

        return scan_steps(state, jnp.arange(count, dtype=jnp.int32), batch_of)

    return program


def gathering(run: Callable[..., Any], count: int, size: int) -> Callable[..., Any]:
    """`run(state, inputs, labels)` (fused steps) with its batches gathered first.

    For strategies whose per-device program cannot take the arrays replicated (pmap):
    the `count` batches are gathered into one stacked array, then run. The result takes
    `(state, *DeviceChunk.arguments())`.
    """

    def program(state, inputs, labels, order, next_order, start, end):
        def batch(step: jax.Array) -> list[jax.Array]:
            first = start + step * size
            return rows_of([*inputs, *labels], order, next_order, first, end, size)

        rows = lax.map(batch, jnp.arange(count, dtype=jnp.int32))
        return run(state, rows[: len(inputs)], rows[len(inputs) :])

    return program
