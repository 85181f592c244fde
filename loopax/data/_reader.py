"""What the loop hands the Trainer to run, and the reader that makes it from a dataset.

A `StepReader` turns a dataset's batches into dispatches, one typed record per kind;
`Trainer.run(dispatch)` runs one as one compiled call. With `Loop(trainer,
steps_per_execution=K)` a read is a group of up to K steps, whose length the loop sets (it
ends at the next step a scheduled hook fires). The group is split where the batches
change spec or shape (they cannot be stacked), and each run of equal batches into
power-of-two chunks, so a spec and shape compile at most log2(K) + 1 programs. An
on-device `ArrayDataset` on the Trainer's devices takes nothing here: its dispatches say
where their batches lie (`OnDevice`) and the Trainer's program takes them itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np

from .._devices import Device
from ._datasets import ArrayDataset, Batch, as_list, bad_batch_error, checked_batch, shown_name
from ._device_data import DeviceChunk


class OneStep(NamedTuple):
    """One optimizer step's batch, as the dataset yielded it (host or device arrays).

    With `Trainer(accumulate_steps=K)`, each array carries a leading axis of micro-batches.
    An immutable record like the other dispatches, but a named tuple: one is built per
    step, from the batch tuple, in ~0.1 µs (a frozen dataclass takes ~0.35 µs).
    """

    spec: Any
    inputs: list[Any]
    labels: list[Any]

    @property
    def count(self) -> int:  # pyright: ignore[reportIncompatibleMethodOverride]
        """Optimizer steps this dispatch runs: one."""
        return 1


@dataclasses.dataclass(frozen=True, slots=True)
class Stacked:
    """`count` steps' batches stacked on a leading steps axis, run in one program.

    The Loop stacks groups of two or more; `Trainer.train_steps` also stacks one.
    """

    count: int
    spec: Any
    inputs: list[Any]
    labels: list[Any]


class OnDevice(NamedTuple):
    """`chunk.count` steps whose batches the compiled program takes from the devices' arrays.

    The arrays of an on-device `ArrayDataset` (`on_device=True`) on the Trainer's devices;
    nothing is gathered or stacked on the host. A named tuple, as `OneStep`: the per-step
    read builds one a step, by `tuple.__new__` without a Python call.
    """

    spec: Any
    chunk: DeviceChunk

    @property
    def count(self) -> int:  # pyright: ignore[reportIncompatibleMethodOverride]
        """Optimizer steps this dispatch runs."""
        return self.chunk.count


Dispatch = OneStep | Stacked | OnDevice
_new_tuple = tuple.__new__  # a `OneStep` from a checked batch tuple, without unpacking it


def join_arrays(arrays: list[Any], *, stack: bool = True) -> Any:
    """`arrays` stacked on a new leading axis, or concatenated on the first (`stack=False`).

    With numpy when they are all host arrays, else with `jax.numpy` on their device.
    """
    if all(isinstance(a, np.ndarray) for a in arrays):
        return np.stack(arrays) if stack else np.concatenate(arrays)
    import jax.numpy as jnp  # noqa: PLC0415  (only for batches already on a device)

    return jnp.stack(arrays) if stack else jnp.concatenate(arrays)


def power_of_two_at_most(n: int) -> int:
    """The largest power of two <= n (n >= 1)."""
    return 1 << (n.bit_length() - 1)


def power_of_two_parts(total: int) -> Iterator[tuple[int, int]]:
    """`(start, count)` of each part of `total` items cut into powers of two, largest first.

    >>> list(power_of_two_parts(13))
    [(0, 8), (8, 4), (12, 1)]
    """
    start = 0
    while start < total:
        count = power_of_two_at_most(total - start)
        yield start, count
        start += count


def group_sizes(steps: int, most: int) -> set[int]:
    """The sizes of the groups `steps` steps are read in, at most `most` steps a group.

    A group takes the largest power of two that is at most `most` and the steps left (as
    the loop asks `StepReader.read`), so 21 steps at most 8 a group are 8, 8, 4, 1.
    """
    sizes: set[int] = set()
    if steps >= most:  # full groups: their count in one step, however long the run
        full = power_of_two_at_most(most)
        sizes.add(full)
        steps -= ((steps - most) // full + 1) * full  # leaves fewer than `most`
    sizes.update(count for _, count in power_of_two_parts(steps))
    return sizes


def _abstract(array: Any, shape: tuple[int, ...]) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, np.dtype(array.dtype))


def with_count(dispatch: Dispatch, count: int) -> Dispatch:
    """A dispatch like `dispatch` but of `count` steps, its batches' shapes only.

    What a program for a group of `count` steps is compiled from before such a group comes:
    `OneStep` and `Stacked` hold `jax.ShapeDtypeStruct`s (one step's batch, or `count`
    stacked); an `OnDevice` chunk keeps its arrays (they are the program's arguments) and
    takes the count.
    """
    if isinstance(dispatch, OnDevice):
        return OnDevice(dispatch.spec, dataclasses.replace(dispatch.chunk, count=count))
    steps_axes = 0 if isinstance(dispatch, OneStep) else 1  # before one step's batch
    inputs, labels = as_list(dispatch.inputs), as_list(dispatch.labels)

    def resized(arrays: list[Any]) -> list[Any]:
        leading = (count,) if count > 1 else ()
        return [_abstract(a, (*leading, *np.shape(a)[steps_axes:])) for a in arrays]

    if count == 1:
        return OneStep(dispatch.spec, resized(inputs), resized(labels))
    return Stacked(count, dispatch.spec, resized(inputs), resized(labels))


def _kind(batch: Batch, steps_axes: int = 0) -> tuple:
    """What batches must share to be stacked: their spec, and shapes and dtypes.

    The shapes behind the first `steps_axes` axes (1 for batches stacked on a steps axis).
    """
    spec, inputs, labels = batch
    return (
        repr(spec),
        tuple((np.shape(a)[steps_axes:], str(getattr(a, "dtype", ""))) for a in inputs),
        tuple((np.shape(a)[steps_axes:], str(getattr(a, "dtype", ""))) for a in labels),
    )


def _joined(batches: list[Batch], *, stack: bool = True) -> tuple[list[Any], list[Any]]:
    """The inputs and the labels of `batches` (of one kind), each joined as `join_arrays` does."""
    first = batches[0]
    inputs = [join_arrays([b[1][i] for b in batches], stack=stack) for i in range(len(first[1]))]
    labels = [join_arrays([b[2][i] for b in batches], stack=stack) for i in range(len(first[2]))]
    return inputs, labels


def _chunks_of_run(run: list[Batch]) -> list[Dispatch]:
    """A run of batches of one kind as power-of-two chunks, largest first."""
    chunks: list[Dispatch] = []
    for start, count in power_of_two_parts(len(run)):
        spec, inputs, labels = run[start]
        if count == 1:
            chunks.append(OneStep(spec, inputs, labels))
        else:
            chunks.append(Stacked(count, spec, *_joined(run[start : start + count])))
    return chunks


def _chunks_of_stacked(spec: Any, inputs: list[Any], labels: list[Any]) -> list[Dispatch]:
    """Batches stacked on a leading steps axis as power-of-two chunks, largest first."""
    total = int(np.shape(inputs[0])[0])
    chunks: list[Dispatch] = []
    for start, count in power_of_two_parts(total):
        if count == total:
            chunks.append(
                Stacked(count, spec, inputs, labels)
                if count > 1
                else OneStep(spec, [a[0] for a in inputs], [a[0] for a in labels])
            )
        elif count == 1:
            chunks.append(OneStep(spec, [a[start] for a in inputs], [a[start] for a in labels]))
        else:
            part = slice(start, start + count)
            inputs_part, labels_part = [a[part] for a in inputs], [a[part] for a in labels]
            chunks.append(Stacked(count, spec, inputs_part, labels_part))
    return chunks


def _read_stacked(
    dataset: Any, yield_batches: Callable[[int], Any], n: int
) -> tuple[list[Dispatch], bool]:
    """A group from a dataset that stacks batches itself (`yield_batches`).

    E.g. gathered on the device. It is read on across the dataset's epoch ends (a looping
    dataset stops a stack there), so that a group keeps its length, and split into chunks
    only where the kind of batch changes.
    """
    ended = False
    first = checked_batch(dataset, yield_batches(n))  # StopIteration: no batch left
    piece = (first[0], as_list(first[1]), as_list(first[2]))
    count = int(np.shape(piece[1][0])[0])
    if count == n:  # the common case: one stack of the whole group
        return _chunks_of_stacked(*piece), False
    pieces = [piece]
    while count < n:
        try:
            batch = checked_batch(dataset, yield_batches(n - count))
        except StopIteration:  # a dataset that does not loop ended after `pieces`
            ended = True
            break
        piece = (batch[0], as_list(batch[1]), as_list(batch[2]))
        pieces.append(piece)
        count += int(np.shape(piece[1][0])[0])
        if _kind(piece, 1) != _kind(pieces[0], 1):
            break  # another kind (a short last batch): it starts its own chunks
    chunks: list[Dispatch] = []
    run = [pieces[0]]
    for piece in [*pieces[1:], None]:
        if piece is not None and _kind(piece, 1) == _kind(run[0], 1):
            run.append(piece)
            continue
        spec, inputs, labels = run[0]
        if len(run) > 1:
            inputs, labels = _joined(run, stack=False)
        chunks.extend(_chunks_of_stacked(spec, inputs, labels))
        if piece is not None:
            run = [piece]
    return chunks, ended


def _read_on_device(dataset: ArrayDataset, n: int) -> tuple[list[Dispatch], bool]:
    """A group of an on-device `ArrayDataset`, as power-of-two chunks left on the devices."""
    spec = dataset.spec
    runs, ended = dataset.device_steps(n)
    if len(runs) == 1 and runs[0].count == n:  # the common case: one chunk
        return [OnDevice(spec, runs[0])], ended
    chunks: list[Dispatch] = []
    for run in runs:
        chunks.extend(
            OnDevice(spec, run.part(start, count)) for start, count in power_of_two_parts(run.count)
        )
    return chunks, ended


def _on_device_step_reader(dataset: ArrayDataset) -> Callable[[int], tuple[list[Dispatch], bool]]:
    """`read` of the next step of an on-device `ArrayDataset`, left on the devices.

    One `OnDevice` a read, of the step `yield_batch` would read (from the epoch's permuted
    copy, if it makes one), taken by the Trainer's step program itself: one call a step.
    The read runs every step, so it is a call of `device_step` and a tuple.
    """
    next_step = dataset.device_step

    def read(n: int) -> tuple[list[Dispatch], bool]:
        del n  # always one
        return [_new_tuple(OnDevice, (dataset.spec, next_step()))], False

    return read


def _batches_up_to(dataset: Any, read: Callable[[], Any], n: int) -> tuple[list[Batch], bool]:
    """Up to n batches of `read()`, checked, and whether the dataset ended before n.

    Raises `StopIteration` when no batch is left.
    """
    batches: list[Batch] = []
    while len(batches) < n:
        try:
            batch = checked_batch(dataset, read())
        except StopIteration:
            if not batches:
                raise
            return batches, True
        batches.append((batch[0], as_list(batch[1]), as_list(batch[2])))
    return batches, False


def _read_batches(
    dataset: Any, read_step: Callable[[], Any], n: int
) -> tuple[list[Dispatch], bool]:
    """A group of up to n steps' batches, each read by `read_step`, as chunks."""
    batches, ended = _batches_up_to(dataset, read_step, n)
    chunks: list[Dispatch] = []
    run = [batches[0]]
    for batch in batches[1:]:
        if _kind(batch) == _kind(run[0]):
            run.append(batch)
        else:
            chunks.extend(_chunks_of_run(run))
            run = [batch]
    chunks.extend(_chunks_of_run(run))
    return chunks, ended


class StepReader:
    """Reads a dataset's batches as dispatches, up to n optimizer steps per `read(n)`.

    A step's batch is one `yield_batch()`, or `accumulate_steps` of them stacked. With
    `steps_per_read=1` a read is one `OneStep` of the batch as the dataset yielded it
    (nothing is chunked or copied: the per-step path), or for an on-device `ArrayDataset`
    on the Trainer's devices one `OnDevice` step that the Trainer's program reads itself
    (one program call a step, where a gather would be a call of its own); else the steps
    are chunked as the module says.

    Args:
      dataset: the `Dataset` to read.
      steps_per_read: the most steps one read returns (the loop's `steps_per_execution`).
      accumulate_steps: batches stacked per optimizer step (`Trainer.accumulate_steps`).
      gathers_on: whether the Trainer's compiled steps take batches from arrays on these
        devices (`Trainer.gathers_on`); an on-device `ArrayDataset` on them is then read
        as `OnDevice` records.

    Attributes:
      read: `read(n) -> (dispatches, ended)`: up to n steps' dispatches, and whether the
        dataset ended before n steps. It raises `StopIteration` when the dataset has no
        batch left, and `ValueError` for a batch that is not `(spec, inputs, labels)` (a
        `BadBatchError`) or (accumulating) batches of one step of another spec or shape.
    """

    def __init__(
        self,
        dataset: Any,
        steps_per_read: int = 1,
        accumulate_steps: int = 1,
        gathers_on: Callable[[list[Device]], bool] | None = None,
    ) -> None:
        read_step = (
            dataset.yield_batch
            if accumulate_steps == 1
            else micro_batch_reader(dataset, accumulate_steps)
        )

        def one_step(n: int) -> tuple[list[Dispatch], bool]:
            del n  # always one
            batch = read_step()
            # `checked_batch`'s test, inline: its call would add ~50 ns to every step
            if type(batch) is tuple and len(batch) == 3:
                return [_new_tuple(OneStep, batch)], False
            raise bad_batch_error(dataset, batch)

        self.read: Callable[[int], tuple[list[Dispatch], bool]]
        devices = dataset.devices if isinstance(dataset, ArrayDataset) else None
        yield_batches = getattr(dataset, "yield_batches", None)
        on_devices = devices is not None and gathers_on is not None and gathers_on(devices)
        # Per step: the step's program takes its batch itself (one call a step), unless a
        # subclass yields its batches otherwise.
        own_batches = on_devices and type(dataset).yield_batch is ArrayDataset.yield_batch
        if steps_per_read == 1 and accumulate_steps == 1 and own_batches:
            self.read = _on_device_step_reader(dataset)
        elif steps_per_read == 1:
            self.read = one_step
        elif accumulate_steps != 1 or yield_batches is None:
            self.read = lambda n: _read_batches(dataset, read_step, n)
        elif on_devices:
            self.read = lambda n: _read_on_device(dataset, n)
        else:
            self.read = lambda n: _read_stacked(dataset, yield_batches, n)


def micro_batch_reader(dataset: Any, count: int) -> Callable[[], Batch]:
    """`yield_batch` for gradient accumulation: up to `count` batches, stacked.

    Each input and label of up to `count` consecutive batches of `dataset` is stacked on
    a new leading axis. An on-device `ArrayDataset` gives them stacked already, by one
    compiled gather (`_stacked_reader`).

    A group ends early when the dataset ends after its first batch (one optimizer step
    over fewer micro-batches); `StopIteration` only when no batch is left.

    Raises:
      ValueError: a batch is not `(spec, inputs, labels)`, or the batches of one group
        differ in spec, number of arrays or shapes (they cannot be stacked).
    """
    if isinstance(dataset, ArrayDataset) and dataset.on_device:
        return _stacked_reader(dataset, count)
    yield_batch = dataset.yield_batch

    def read() -> Batch:
        group, _ = _batches_up_to(dataset, yield_batch, count)
        for index, batch in enumerate(group[1:], 1):
            _check_same_kind(dataset, group[0], batch, index, count)
        return (group[0][0], *_joined(group))

    return read


def _stacked_reader(dataset: ArrayDataset, count: int) -> Callable[[], Batch]:
    """`micro_batch_reader` of an on-device `ArrayDataset`: `yield_batches(count)`.

    One compiled program gathers a step's micro-batches already stacked, instead of a
    gather per micro-batch and a stacking program per array. Fewer programs per step also
    keep XLA's queue short: the Loop bounds the steps in flight, not their programs, and on
    several CPU devices a queue past XLA's cap deadlocks (`limit_for`). A group cut short
    by an epoch's end goes on in the next epoch (as `count` `yield_batch` calls would) and
    its pieces are joined; one stopped by a smaller last batch fails the same-shape check,
    as the batch-at-a-time reader does.
    """
    yield_batches = dataset.yield_batches

    def shapes_of(piece: Batch) -> tuple:
        """A stacked piece as one of its batches, for `_check_same_kind` (shapes only)."""

        def one(array: Any) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(array.shape[1:], array.dtype)

        spec, inputs, labels = piece
        return spec, [one(a) for a in inputs], [one(a) for a in labels]

    def read() -> Batch:
        pieces: list[Batch] = []
        taken = 0
        while taken < count:
            try:
                piece = yield_batches(count - taken)
            except StopIteration:
                if not pieces:
                    raise
                break
            if pieces:
                _check_same_kind(dataset, shapes_of(pieces[0]), shapes_of(piece), taken, count)
            pieces.append(piece)
            taken += piece[1][0].shape[0]
        if len(pieces) == 1:
            return pieces[0]
        return (pieces[0][0], *_joined(pieces, stack=False))

    return read


def _check_same_kind(dataset: Any, first: tuple, batch: tuple, index: int, count: int) -> None:
    def shapes(b: tuple) -> tuple:
        return [np.shape(a) for a in b[1]], [np.shape(a) for a in b[2]]

    if first[0] != batch[0] or shapes(first) != shapes(batch):
        raise ValueError(
            f"dataset {shown_name(dataset)!r}: with accumulate_steps={count} the "
            f"{count} batches of one optimizer step are stacked, so they need one spec and one "
            f"shape; micro-batch {index} has spec {batch[0]!r} and shapes {shapes(batch)}, the "
            f"first has spec {first[0]!r} and shapes {shapes(first)}. Give every batch the same "
            "size (e.g. ArrayDataset(..., drop_remainder=True))"
        )
