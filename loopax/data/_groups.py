"""Fused execution: groups of steps read from a dataset and run as compiled calls.

With `Loop(trainer, steps_per_execution=K)` the loop runs up to K steps per dispatch. A
group's length is set by the loop (it ends at the next step a scheduled hook fires); the
group is read here, split where the batches change spec or shape (they cannot be stacked),
and each run of equal batches into power-of-two chunks: each chunk is one compiled call
(`Trainer.train_steps`, or `train_step` for a chunk of one), so a spec and shape compile at
most log2(K) + 1 programs. An on-device `ArrayDataset` on the Trainer's devices gathers
nothing here: its chunks say where their batches lie (`DeviceChunk`) and the Trainer's
program gathers them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ._datasets import Batch, as_list, bad_batch_error, join_arrays, micro_batch_reader
from ._device_data import DeviceArrays

# (step count, spec, inputs, labels): one compiled call's batches; stacked on a leading
# steps axis when the count is above one. Or (step count, spec, DeviceChunk, None): the
# batches left on the devices, for `Trainer._train_gathered`.
Chunk = tuple[int, Any, Any, Any]


def power_of_two_at_most(n: int) -> int:
    """The largest power of two <= n (n >= 1)."""
    return 1 << (n.bit_length() - 1)


def _kind(batch: Batch) -> tuple:
    spec, inputs, labels = batch
    return (
        repr(spec),
        tuple((np.shape(a), str(getattr(a, "dtype", ""))) for a in inputs),
        tuple((np.shape(a), str(getattr(a, "dtype", ""))) for a in labels),
    )


def _stacked_kind(piece: Batch) -> tuple:
    """`_kind` of stacked batches: their spec and the shapes behind the steps axis."""
    spec, inputs, labels = piece
    return (
        repr(spec),
        tuple((np.shape(a)[1:], str(getattr(a, "dtype", ""))) for a in inputs),
        tuple((np.shape(a)[1:], str(getattr(a, "dtype", ""))) for a in labels),
    )


def _chunks_of_run(run: list[Batch]) -> list[Chunk]:
    """A run of batches of one kind as power-of-two chunks, largest first."""
    chunks: list[Chunk] = []
    start = 0
    while start < len(run):
        count = power_of_two_at_most(len(run) - start)
        part = run[start : start + count]
        spec = part[0][0]
        if count == 1:
            chunks.append((1, spec, part[0][1], part[0][2]))
        else:
            inputs = [join_arrays([b[1][i] for b in part]) for i in range(len(part[0][1]))]
            labels = [join_arrays([b[2][i] for b in part]) for i in range(len(part[0][2]))]
            chunks.append((count, spec, inputs, labels))
        start += count
    return chunks


def _chunks_of_stacked(spec: Any, inputs: list[Any], labels: list[Any]) -> list[Chunk]:
    """Batches stacked on a leading steps axis as power-of-two chunks, largest first."""
    total = int(np.shape(inputs[0])[0])
    chunks: list[Chunk] = []
    start = 0
    while start < total:
        count = power_of_two_at_most(total - start)
        if count == total:
            chunks.append(
                (count, spec, inputs, labels)
                if count > 1
                else (1, spec, [a[0] for a in inputs], [a[0] for a in labels])
            )
        elif count == 1:
            chunks.append((1, spec, [a[start] for a in inputs], [a[start] for a in labels]))
        else:
            part = slice(start, start + count)
            chunks.append((count, spec, [a[part] for a in inputs], [a[part] for a in labels]))
        start += count
    return chunks


def _read_stacked(
    dataset: Any, yield_batches: Callable[[int], Any], n: int
) -> tuple[list[Chunk], bool]:
    """A group from a dataset that stacks batches itself (`yield_batches`).

    E.g. gathered on the device. It is read on across the dataset's epoch ends (a looping
    dataset stops a stack there), so that a group keeps its length, and split into chunks
    only where the kind of batch changes.
    """
    ended = False
    first = yield_batches(n)  # StopIteration: no batch left
    if type(first) is not tuple or len(first) != 3:
        raise bad_batch_error(dataset, first)
    piece = (first[0], as_list(first[1]), as_list(first[2]))
    count = int(np.shape(piece[1][0])[0])
    if count == n:  # the common case: one stack of the whole group
        return _chunks_of_stacked(*piece), False
    pieces = [piece]
    while count < n:
        try:
            batch = yield_batches(n - count)
        except StopIteration:  # a dataset that does not loop ended after `pieces`
            ended = True
            break
        if type(batch) is not tuple or len(batch) != 3:
            raise bad_batch_error(dataset, batch)
        piece = (batch[0], as_list(batch[1]), as_list(batch[2]))
        pieces.append(piece)
        count += int(np.shape(piece[1][0])[0])
        if _stacked_kind(piece) != _stacked_kind(pieces[0]):
            break  # another kind (a short last batch): it starts its own chunks
    chunks: list[Chunk] = []
    run = [pieces[0]]
    for piece in [*pieces[1:], None]:
        if piece is not None and _stacked_kind(piece) == _stacked_kind(run[0]):
            run.append(piece)
            continue
        spec, inputs, labels = run[0]
        if len(run) > 1:
            inputs = [join_arrays([p[1][i] for p in run], stack=False) for i in range(len(inputs))]
            labels = [join_arrays([p[2][i] for p in run], stack=False) for i in range(len(labels))]
        chunks.extend(_chunks_of_stacked(spec, inputs, labels))
        if piece is not None:
            run = [piece]
    return chunks, ended


def _read_on_device(spec: Any, device_steps: Callable[[int], Any], n: int) -> tuple[list, bool]:
    """A group of an on-device `ArrayDataset`, as power-of-two chunks of `DeviceChunk`s."""
    runs, ended = device_steps(n)
    if len(runs) == 1 and runs[0].count == n:  # the common case: one chunk
        return [(n, spec, runs[0], None)], ended
    chunks: list[Chunk] = []
    for run in runs:
        offset = 0
        while offset < run.count:
            count = power_of_two_at_most(run.count - offset)
            chunks.append((count, spec, run.part(offset, count), None))
            offset += count
    return chunks, ended


def group_reader(dataset: Any, trainer: Any) -> Callable[[int], tuple[list[Chunk], bool]]:
    """`read(n) -> (chunks, ended)`: up to n steps' batches of `dataset`, as chunks.

    A step's batch is one `yield_batch()`, or `trainer.accumulate_steps` of them stacked.
    `ended` says the dataset ended before n steps were read (the chunks hold what was
    read).

    Raises:
      StopIteration: the dataset has no batch left.
      ValueError: a batch is not `(spec, inputs, labels)`.
    """
    accumulate_steps = trainer.accumulate_steps
    source = getattr(dataset, "_device", None)
    if (
        accumulate_steps == 1
        and isinstance(source, DeviceArrays)
        and trainer.gathers_on(source.devices)
    ):
        spec, device_steps = dataset.spec, dataset._device_steps
        return lambda n: _read_on_device(spec, device_steps, n)
    read_step = (
        dataset.yield_batch
        if accumulate_steps == 1
        else micro_batch_reader(dataset, accumulate_steps)
    )

    yield_batches = getattr(dataset, "yield_batches", None) if accumulate_steps == 1 else None

    def read(n: int) -> tuple[list[Chunk], bool]:
        if yield_batches is not None:
            return _read_stacked(dataset, yield_batches, n)
        batches: list[Batch] = []
        ended = False
        while len(batches) < n:
            try:
                batch = read_step()
            except StopIteration:
                if not batches:
                    raise
                ended = True
                break
            if type(batch) is not tuple or len(batch) != 3:
                raise bad_batch_error(dataset, batch)
            batches.append((batch[0], as_list(batch[1]), as_list(batch[2])))
        chunks: list[Chunk] = []
        run = [batches[0]]
        for batch in batches[1:]:
            if _kind(batch) == _kind(run[0]):
                run.append(batch)
            else:
                chunks.extend(_chunks_of_run(run))
                run = [batch]
        chunks.extend(_chunks_of_run(run))
        return chunks, ended

    return read
