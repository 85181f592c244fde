"""The `Dataset` protocol, `ArrayDataset`, and helpers every reader of datasets shares.

`ArrayDataset` holds in-memory arrays; iterables (grain's too) are in `_iterables`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import jax
import numpy as np

from ._device_data import DeviceArrays, DeviceChunk, check_devices

if TYPE_CHECKING:
    from .._devices import Device

Batch = tuple[Any, list[Any], list[Any]]


@runtime_checkable
class Dataset(Protocol):
    """What the `Loop` and `Trainer.evaluate` read batches from.

    `yield_batch()` returns `(spec, inputs, labels)` and raises `StopIteration` at the
    end of the data; `reset()` starts over. A dataset may also implement
    `get_state() -> dict` and `set_state(dict)` so checkpoints save its position.
    Where a `Dataset` is taken, any iterable of batches is too (see `IterableDataset`).
    """

    name: str

    def yield_batch(self) -> Batch: ...

    def reset(self) -> None: ...


def _as_array_list(arrays: Any, what: str) -> list[np.ndarray]:
    if isinstance(arrays, (list, tuple)):
        items = list(arrays)
    else:
        items = [arrays]
    result = []
    for position, item in enumerate(items):
        if not hasattr(item, "shape") or not hasattr(item, "dtype"):
            raise TypeError(
                f"ArrayDataset {what}[{position}] is a {type(item).__name__}, not an array; "
                "pass numpy or jax arrays (np.asarray(...) converts lists)"
            )
        if np.ndim(item) == 0:
            raise ValueError(
                f"ArrayDataset {what}[{position}] is a scalar; every array needs a first "
                "(example) dimension"
            )
        result.append(item)
    return result


class ArrayDataset:
    """Batches of in-memory numpy or jax arrays, reshuffled each epoch from a seed.

    Args:
      inputs: an array or a sequence of arrays, all with the same first dimension.
      labels: an array, a sequence of arrays (same first dimension), or `()` for none.
      batch_size: examples per batch.
      name: the dataset's name in messages, logs and plots.
      shuffle: reshuffle every epoch; epoch `e` uses the permutation drawn from
        `(seed, e)`, so a run is reproducible and a restored position continues exactly.
      seed: the shuffling seed.
      drop_remainder: drop the last incomplete batch of each epoch (default), which keeps
        one input shape and so one compiled step.
      loop_forever: start the next epoch instead of raising `StopIteration`.
      spec: the spec yielded with every batch (selects the compiled step).
      on_device: put the arrays on `devices` once, here, and take every batch on the
        devices with one compiled program from the epoch's permutation (kept on the
        devices), so a step copies no data from the host. Batches, order, epochs and
        `get_state` are those of the host dataset with the same arguments; the batches are
        jax arrays (dtypes as JAX makes them: float64 becomes float32 unless x64 is on),
        split over `devices` on the batch axis when the batch size divides by their count,
        as the Trainer's step takes them. Every device holds all the arrays.
      devices: with `on_device=True`, the devices to hold the arrays: the Trainer's
        (default: all of `jax.devices()`, as the Trainer's default).
      shuffled_copy: with `on_device=True` and `shuffle=True`, permute the arrays into a
        copy in each epoch's order, once per epoch (one gather on the devices, when the
        epoch's first batch is read), so that every batch is a contiguous slice of it:
        the fast path for single steps. The copy doubles the data's memory on every
        device (three times for a moment at an epoch's start, while steps of the previous
        epoch finish). False keeps no copy and gathers each batch's rows through the
        permutation instead (slower per step). Fused steps (`steps_per_execution`) never
        make the copy: a group reads all its rows by one gather through the permutation
        before its steps. Batches are the same either way.
      shard_by_process: for several JAX processes: every process is given the same (whole)
        arrays, `batch_size` is the global batch, and each process yields its own slice of
        every global batch (process i of n: rows `[i * b / n, (i + 1) * b / n)`). The
        order and the position are global, the same on every process, so a checkpoint's
        position resumes exactly on any process count. One process yields whole batches.

    Raises:
      TypeError: an input or label is not an array.
      ValueError: first dimensions differ, no inputs, batch_size < 1, not a single
        batch with `drop_remainder=True`, bad `devices` (given without
        `on_device=True`, empty, or not this process's jax devices), or
        `shuffled_copy=False` without `on_device=True`.

    Example:
      >>> import numpy as np
      >>> ds = ArrayDataset(np.arange(10.0), np.arange(10), batch_size=4, shuffle=False)
      >>> spec, inputs, labels = ds.yield_batch()
      >>> inputs[0].tolist(), labels[0].tolist()
      ([0.0, 1.0, 2.0, 3.0], [0, 1, 2, 3])
      >>> on_device = ArrayDataset(np.arange(10.0), np.arange(10), batch_size=4, shuffle=False,
      ...                          on_device=True)
      >>> spec, inputs, labels = on_device.yield_batch()  # gathered on the devices
      >>> inputs[0].tolist(), labels[0].tolist()
      ([0.0, 1.0, 2.0, 3.0], [0, 1, 2, 3])
    """

    inputs: list[np.ndarray]
    labels: list[np.ndarray]
    num_examples: int
    batch_size: int

    def __init__(
        self,
        inputs: Any,
        labels: Any,
        batch_size: int,
        *,
        name: str = "array",
        shuffle: bool = True,
        seed: int = 0,
        drop_remainder: bool = True,
        loop_forever: bool = False,
        spec: Any = None,
        on_device: bool = False,
        devices: Sequence[Device] | None = None,
        shard_by_process: bool = False,
        shuffled_copy: bool = True,
    ):
        self.inputs = _as_array_list(inputs, "inputs")
        self.labels = _as_array_list(labels, "labels") if not _is_empty(labels) else []
        if not self.inputs:
            raise ValueError("ArrayDataset needs at least one input array")
        sizes = {int(np.shape(a)[0]) for a in self.inputs + self.labels}
        if len(sizes) != 1:
            shapes = [tuple(np.shape(a)) for a in self.inputs + self.labels]
            raise ValueError(
                f"ArrayDataset arrays have different first dimensions {sorted(sizes)} "
                f"(shapes {shapes}); every input and label needs one row per example"
            )
        self.num_examples = sizes.pop()
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"ArrayDataset batch_size must be a positive int, got {batch_size!r}")
        if drop_remainder and batch_size > self.num_examples:
            raise ValueError(
                f"ArrayDataset batch_size {batch_size} is larger than its {self.num_examples} "
                "examples with drop_remainder=True, so it would yield no batch; use a smaller "
                "batch_size or drop_remainder=False"
            )
        self.name = name
        self.batch_size = int(batch_size)
        self.shuffle = shuffle
        self.seed = seed
        self.drop_remainder = drop_remainder
        self.loop_forever = loop_forever
        self.spec = spec
        self.shard_by_process = bool(shard_by_process)
        self._device: DeviceArrays | None = None
        if on_device and self.shard_by_process:
            raise ValueError(
                f"ArrayDataset {name!r}: on_device=True holds every row on this process's "
                "devices; shard_by_process slices host batches. Use one or the other"
            )
        if on_device:
            held = check_devices(devices, name)
            self._device = DeviceArrays(self.inputs, self.labels, held, bool(shuffled_copy))
        elif devices is not None or not shuffled_copy:
            given = f"devices={devices!r}" if devices is not None else "shuffled_copy=False"
            raise ValueError(
                f"ArrayDataset {name!r} got {given} without on_device=True; devices= and "
                "shuffled_copy= say how on_device=True holds the arrays, so pass on_device=True "
                "or leave them out"
            )
        self._epoch = 0
        self._position = 0
        self._set_order(0)

    @property
    def on_device(self) -> bool:
        """Whether the arrays are on the devices and batches are gathered there."""
        return self._device is not None

    @property
    def devices(self) -> list[Device] | None:
        """The devices holding the arrays (`on_device=True`), else None."""
        return None if self._device is None else self._device.devices

    def _permutation(self, epoch: int) -> np.ndarray | None:
        if not self.shuffle:
            return None
        return np.random.default_rng((self.seed, epoch)).permutation(self.num_examples)

    def _set_order(self, epoch: int) -> None:
        self._order = self._permutation(epoch)
        if self._device is not None:
            self._device.set_order(self._order)

    def _batches_per_epoch_end(self) -> int:
        if self.drop_remainder:
            return self.num_examples - self.num_examples % self.batch_size
        return self.num_examples

    def _next_epoch(self) -> None:
        self._epoch += 1
        self._position = 0
        self._set_order(self._epoch)

    def _start_batch(self) -> int:
        """The epoch position of the next batch (a new epoch if looping).

        Raises:
          StopIteration: the epoch ended and the dataset does not loop.
        """
        if self._position >= self._batches_per_epoch_end():
            if not self.loop_forever:
                raise StopIteration
            self._next_epoch()
        return self._position

    def _take(self, start: int, count: int, size: int, stacked: bool) -> Batch:
        if self._device is not None:
            inputs, labels = self._device.gather(start, count, size, stacked)
            return self.spec, inputs, labels
        stop = start + count * size
        index = slice(start, stop) if self._order is None else self._order[start:stop]

        share = self._process_share(size)

        def take(array: Any) -> Any:
            rows = array[index]
            if share is not None:  # this process's rows of each batch
                rows = rows.reshape((count, size, *rows.shape[1:]))[:, share]
                return rows if stacked else rows[0]
            return rows.reshape((count, size, *rows.shape[1:])) if stacked else rows

        return self.spec, [take(a) for a in self.inputs], [take(a) for a in self.labels]

    def _process_share(self, size: int) -> slice | None:
        """This process's rows of a global batch of `size`; None: all (not sharded)."""
        if not self.shard_by_process:
            return None
        count, index = jax.process_count(), jax.process_index()
        return slice(index * size // count, (index + 1) * size // count)

    def yield_batch(self) -> Batch:
        """Returns the next `(spec, inputs, labels)`; raises `StopIteration` at epoch end."""
        start = self._start_batch()
        stop = min(start + self.batch_size, self.num_examples)
        self._position = stop
        return self._take(start, 1, stop - start, stacked=False)

    def yield_batches(self, count: int) -> Batch:
        """Returns the next `count` batches stacked: each array has shape `(count, batch, ...)`.

        The result equals `np.stack` of the next `count` `yield_batch()` results and leaves
        the dataset where they would, but is gathered at once (with `on_device=True`, by one
        compiled program). A group stops early at the end of an epoch (looping or not) and
        before a batch of another size (the smaller last batch with `drop_remainder=False`,
        which comes alone in the next group), so it may hold fewer than `count` batches.

        Args:
          count: how many batches at most, >= 1.

        Returns:
          `(spec, inputs, labels)` with the batches stacked on a new leading axis.

        Raises:
          ValueError: `count` is not a positive int.
          StopIteration: no batch is left (as `yield_batch`).

        Example:
          >>> import numpy as np
          >>> ds = ArrayDataset(np.arange(10.0), np.arange(10), batch_size=3, shuffle=False)
          >>> spec, inputs, labels = ds.yield_batches(2)
          >>> inputs[0].tolist()
          [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
          >>> ds.yield_batches(2)[1][0].shape  # the epoch ends after one more batch
          (1, 3)
        """
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
            raise ValueError(
                f"ArrayDataset {self.name!r} yield_batches needs a count >= 1 of batches to "
                f"stack, got {count!r}"
            )
        start, batches, size = self._advance(count)
        return self._take(start, batches, size, stacked=True)

    def _advance(self, count: int) -> tuple[int, int, int]:
        """Moves past up to `count` batches as `yield_batch` would; `(start, batches, size)`.

        It stops at the end of the epoch or before a batch of another size (which could
        not be stacked with these).

        Raises:
          StopIteration: no batch is left (as `yield_batch`).
        """
        start = self._start_batch()
        end = self._batches_per_epoch_end()
        size = min(start + self.batch_size, self.num_examples) - start
        batches, position = 0, start
        while batches < count and position < end:
            if min(position + self.batch_size, self.num_examples) - position != size:
                break
            batches += 1
            position += size
        self._position = position
        return start, batches, size

    def device_steps(self, count: int) -> tuple[list[DeviceChunk], bool]:
        """The next `count` batches (or fewer at the data's end) as chunks left on the devices.

        For the fused Loop's `StepReader` (`on_device=True` only): the dataset moves on as
        `count` calls of `yield_batch` would, but nothing is taken; the Trainer's program
        slices (or gathers) each `DeviceChunk`. A chunk holds batches of one size and spans
        at most two epochs. The flag says the data ended (`loop_forever=False`) before
        `count` batches.

        Raises:
          StopIteration: no batch is left.
        """
        device = self._device
        assert device is not None, "device_steps needs on_device=True"
        chunks: list[DeviceChunk] = []
        end = self._batches_per_epoch_end()
        read, crossed = 0, True  # `crossed`: the last chunk already spans two epochs
        while read < count:
            epoch = self._epoch
            try:
                start, batches, size = self._advance(count - read)
            except StopIteration:
                if not chunks:
                    raise
                return chunks, True
            read += batches
            last = chunks[-1] if chunks else None
            if (
                last is not None
                and not crossed
                and start == 0
                and self._epoch == epoch + 1
                and size == last.size
                and last.start + last.count * size == end
            ):  # the run goes on into the next epoch: one chunk
                chunks[-1] = dataclasses.replace(
                    last, count=last.count + batches, next_epoch=device.group_epoch
                )
                crossed = True
                continue
            held = device.group_epoch  # read through the permutation: no copy for groups
            chunks.append(DeviceChunk(device, batches, size, start, end, held, held))
            crossed = False
        return chunks, False

    def device_step(self) -> DeviceChunk:
        """The next batch as a one-step chunk left on the devices: the per-step Loop's read.

        For the per-step `StepReader` (`on_device=True` only), as `device_steps` is for
        fused groups: the dataset moves on as `yield_batch` would, but nothing is taken;
        the Trainer's step program slices the batch (from the epoch's permuted copy, when
        it makes one). Called once a step, so it is kept to attribute reads, one method,
        one property and one `DeviceChunk` (a new epoch's order on its first step only).

        Raises:
          StopIteration: no batch is left.
        """
        device = self._device
        assert device is not None, "device_step needs on_device=True"
        size, count = self.batch_size, self.num_examples
        end = self._batches_per_epoch_end()
        start = self._position
        if start >= end:
            start = self._start_batch()  # the next epoch, or StopIteration
        stop = start + size if start + size < count else count
        self._position = stop
        epoch = device.epoch  # the epoch's order, with its permuted copy made on first use
        return DeviceChunk(device, 1, stop - start, start, end, epoch, epoch)

    def reset(self) -> None:
        """Starts the next epoch (with its own shuffle) from the beginning."""
        if self._position > 0:
            self._next_epoch()

    def get_state(self) -> dict[str, Any]:
        """Returns the position (epoch and offset) as a JSON-serializable dict.

        With `shard_by_process` it says so (`"process_independent": True`): the position is
        global, so a checkpoint may give it to any number of processes.
        """
        state: dict[str, Any] = {"epoch": self._epoch, "position": self._position}
        state["seed"] = self.seed
        if self.shard_by_process:
            state["process_independent"] = True
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores a position returned by `get_state`.

        Raises:
          ValueError: the state was saved with another seed or is out of range.
        """
        if int(state["seed"]) != self.seed:
            raise ValueError(
                f"ArrayDataset {self.name!r} state was saved with seed {state['seed']} but "
                f"this dataset has seed {self.seed}; restoring it would replay other batches"
            )
        position = int(state["position"])
        if not 0 <= position <= self.num_examples:
            raise ValueError(
                f"ArrayDataset {self.name!r} position {position} is outside its "
                f"{self.num_examples} examples"
            )
        self._epoch = int(state["epoch"])
        self._position = position
        self._set_order(self._epoch)

    def __repr__(self) -> str:
        on_device = ", on_device=True" if self._device is not None else ""
        return (
            f"ArrayDataset(name={self.name!r}, examples={self.num_examples}, "
            f"batch_size={self.batch_size}{on_device})"
        )


def _is_empty(labels: Any) -> bool:
    return labels is None or (isinstance(labels, (list, tuple)) and len(labels) == 0)


def as_list(arrays: Any) -> list[Any]:
    """One array, a sequence of arrays, or None -> a list (a list is returned as is)."""
    if type(arrays) is list:
        return arrays
    if arrays is None:
        return []
    if isinstance(arrays, (list, tuple)):
        return list(arrays)
    return [arrays]


def shown_name(dataset: Any) -> Any:
    """What messages call `dataset`: its `name`, or the object itself when it has none."""
    return getattr(dataset, "name", dataset)


def dataset_name(dataset: Any) -> str:
    """The dataset's `name`, which results are stored and shown under.

    Raises:
      ValueError: the dataset has no non-empty str `name`.
    """
    name = getattr(dataset, "name", None)
    if not isinstance(name, str) or not name:
        shown = (
            repr(dataset)
            if callable(getattr(dataset, "yield_batch", None))
            else (f"a {type(dataset).__name__}")
        )
        raise ValueError(
            f"dataset {shown} needs a non-empty str `name` so its results can be stored and "
            "shown under it; e.g. ArrayDataset(..., name='test'), or for an iterable of batches "
            "(a list, a grain dataset) loopax.IterableDataset(batches, name='test')"
        )
    return name


class BadBatchError(ValueError):
    """A dataset yielded something other than `(spec, inputs, labels)`."""


def checked_batch(dataset: Any, batch: Any) -> Batch:
    """`batch`, the result of one `yield_batch()` of `dataset`, checked to be a batch.

    The check every read of a batch makes.

    Raises:
      BadBatchError: `batch` is not a `(spec, inputs, labels)` tuple.
    """
    if type(batch) is tuple and len(batch) == 3:
        return batch
    raise bad_batch_error(dataset, batch)


def bad_batch_error(dataset: Any, batch: Any) -> BadBatchError:
    """The error for a `yield_batch()` result that is not `(spec, inputs, labels)`."""
    size = (
        f"a tuple of {len(batch)} items"
        if isinstance(batch, tuple)
        else f"a {type(batch).__name__}"
    )
    return BadBatchError(
        f"dataset {shown_name(dataset)!r} yielded {size}; yield_batch() must "
        "return (spec, inputs, labels). For (inputs, labels) pairs return "
        "(None, inputs, labels), or wrap a generator in loopax.IterableDataset, which "
        "accepts both"
    )


def read_batches(dataset: Any, during: str) -> Iterator[Batch]:
    """Every batch `dataset` yields from where it is, each checked to be `(spec, inputs, labels)`.

    Raises:
      ValueError: a batch is not `(spec, inputs, labels)`.
      RuntimeError: the dataset raised (the message names it and `during`).
    """
    while True:
        try:
            batch = dataset.yield_batch()
        except StopIteration:
            return
        except Exception as err:
            raise RuntimeError(
                f"dataset {shown_name(dataset)!r} failed during {during}: "
                f"{type(err).__name__}: {err}"
            ) from err
        yield checked_batch(dataset, batch)
