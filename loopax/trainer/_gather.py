"""Compiled programs of fused steps that take their batches from arrays on the devices.

The data side (`loopax.data`) says where a group's batches lie (`DeviceChunk`) and how
to read them (`Reading`: a slice of arrays in the epoch's order, its permuted copy's
included, or the rows a permutation picks); these programs read them inside the
compiled program, all of the group's at once before its steps, so that the steps' loop
is the one a hand-written `lax.scan` over stacked batches runs. They also return the
epoch position after the group (`AFTER`, beside the metrics), where the next group starts:
the host never copies a position to the devices between groups.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .._devices import AXIS
from ..data._internal import Reading, rows_at, rows_of
from ._named import StepResult

# The key of the position after a group, beside the last step's metrics; not a metric:
# the Trainer takes it out before any metric is named (`Programs._train_gathered`).
AFTER = "loopax:position_after"
# The fused programs' name (`jit(train_steps_gathered)`), as `TRAIN_STEPS_GATHERED` names them.
NAME = "train_steps_gathered"


def position_after(start: jax.Array, end: jax.Array, rows: int) -> jax.Array:
    """The epoch position `rows` after `start` (traced), in the next epoch past `end`.

    As `DeviceChunk.after` computes it on the host.
    """
    after = start + rows
    return jnp.where(after > end, after - end, after)


def _with_position_after(
    result: StepResult, start: jax.Array, end: jax.Array, rows: int
) -> StepResult:
    """A fused program's `result` with the epoch position after its group (`AFTER`) in `last`."""
    return result._replace(last={**result.last, AFTER: position_after(start, end, rows)})


def gathering_steps(
    scan_steps: Callable[..., Any],
    train: Callable[..., Any],
    count: int,
    size: int,
    num_devices: int,
    reading: Reading,
) -> Callable[..., Any]:
    """A per-device program of `count` fused steps that takes each step's shard itself.

    `scan_steps(state, xs, batch_of)` runs a step on `batch_of(x)` per `x` of `xs`
    (`StepBuilder.scan_steps`); here this device's `size // num_devices` examples of every
    step's batch are read first, by one gather per array (through the epoch's permutation
    or from its permuted copy; `rows_at`), and each step slices its rows of them
    (`_slicing`), as a hand-written scan indexes its stacked batches: nothing of the read
    but that slice is left inside the loop, whose body XLA:GPU launches once per step
    (before, each step computed its rows' positions, and sliced both epochs' copies and
    selected one, inside the loop). The cost is one gather kernel per array per group and
    the group's rows in memory once more. A group of one step (the per-step Loop's steps)
    reads its rows as `DeviceArrays.gather` does (a slice of the epoch's permuted copy or
    of the arrays in order, or the rows the permutation names; `_step_rows`), runs the
    step without a loop, and returns no stacked metrics (`StepResult.stacked` None, as a
    single step's): one program a step, where the gather was a program of its own. That
    step is `train(state, inputs, labels)` (`StepBuilder.train`), the host batches' step,
    called outside any loop: XLA:CPU canonicalizes a convolution's dimensions (so that
    it runs as a fast library convolution) only in a program's entry computation, and a
    `lax.scan`, even unrolled, leaves its body in a loop of one trip until after that
    pass; a CNN's gradient convolutions there ran ~15x slower (still so in fused steps).
    The result takes `(state, *DeviceChunk.arguments())`, all replicated.
    """
    local = size // num_devices

    def program(state, lying, start, end):
        if count == 1:  # one step: its rows, as the per-step read takes them, no loop
            state, values = train(state, *_step_rows(reading, lying, start, end, size, local))
            # one step's metrics are its last: no stacked copy to return
            return state, _with_position_after(StepResult(values, None), start, end, size)
        steps = jnp.arange(count, dtype=jnp.int32)
        first = lax.axis_index(AXIS) * local
        inputs, labels = rows_at(reading, lying, start, end, count, size, first, local)
        state, result = scan_steps(state, steps, _slicing(inputs, labels, local))
        return state, _with_position_after(result, start, end, count * size)

    program.__name__ = NAME  # in dumps, profiles and compilation logs
    return program


def _step_rows(
    reading: Reading, lying: dict, start: jax.Array, end: jax.Array, size: int, local: int
) -> tuple[list[jax.Array], list[jax.Array]]:
    """This device's `local` rows of the batch of `size` at epoch position `start`.

    As `DeviceArrays.gather` reads: a slice of the arrays (in order, or the epoch's
    permuted copy); through the epochs' permutations, the rows the joined permutations
    name (`rows_at`, as a group's).
    """
    first = lax.axis_index(AXIS) * local
    if reading is Reading.GATHER:
        return rows_at(reading, lying, start, end, 1, size, first, local)
    inputs, labels = lying["inputs"], lying["labels"]
    rows = rows_of([*inputs, *labels], None, None, start + first, end, local)
    return rows[: len(inputs)], rows[len(inputs) :]


def _slicing(inputs: list, labels: list, local: int) -> Callable[[jax.Array], tuple]:
    """`batch_of(step)`: step `step`'s `local` rows of the group's rows, read flat.

    Each step slices its rows at an offset XLA cannot see is a multiple of the batch (an
    `optimization_barrier` hides that the slices start at 0). Where it can see it (a
    scan over the rows stacked `(count, local, ...)`, or this slice at `step * local`),
    XLA vectorizes the step's reductions over the batch otherwise than in a single step
    on its batch argument, and its loss can differ in the last bit (a batch of 4 rows of
    `tests/trainer/test_on_device_fused.py`); at an unknown offset it compiles them as
    the single step does, so fused steps stay bit for bit single steps on a CPU. The
    slice is the one op of the read left in the loop (as in a hand-written scan).
    """
    origin = lax.optimization_barrier(jnp.zeros((), jnp.int32))

    def batch_of(step: jax.Array) -> tuple[list[jax.Array], list[jax.Array]]:
        first = origin + step * local
        return (
            [lax.dynamic_slice_in_dim(a, first, local) for a in inputs],
            [lax.dynamic_slice_in_dim(a, first, local) for a in labels],
        )

    return batch_of


def gathering(
    run: Callable[..., Any], count: int, size: int, reading: Reading
) -> Callable[..., Any]:
    """`run(state, inputs, labels)` (fused steps) with its batches taken first.

    For strategies whose per-device program cannot take the arrays replicated (pmap, a
    mesh's global batch): the `count` batches are taken into one stacked array, then run.
    The result takes `(state, *DeviceChunk.arguments())`.
    """

    def program(state, lying, start, end):
        inputs, labels = rows_at(reading, lying, start, end, count, size)

        def stacked(array: jax.Array) -> jax.Array:
            return array.reshape((count, size, *array.shape[1:]))

        state, result = run(state, [stacked(a) for a in inputs], [stacked(a) for a in labels])
        return state, _with_position_after(result, start, end, count * size)

    program.__name__ = NAME
    return program
