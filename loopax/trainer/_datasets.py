"""The `Dataset` protocol, `ArrayDataset` (in-memory arrays), and the helpers every reader of
datasets shares; iterables (grain's too) are in `_iterables`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

import numpy as np

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

    Raises:
      TypeError: an input or label is not an array.
      ValueError: first dimensions differ, no inputs, batch_size < 1, or not a single
        batch with `drop_remainder=True`.

    Example:
      >>> import numpy as np
      >>> ds = ArrayDataset(np.arange(10.0), np.arange(10), batch_size=4, shuffle=False)
      >>> spec, inputs, labels = ds.yield_batch()
      >>> inputs[0].tolist(), labels[0].tolist()
      ([0.0, 1.0, 2.0, 3.0], [0, 1, 2, 3])
    """

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
        self._epoch = 0
        self._position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray | None:
        if not self.shuffle:
            return None
        return np.random.default_rng((self.seed, epoch)).permutation(self.num_examples)

    def _batches_per_epoch_end(self) -> int:
        if self.drop_remainder:
            return self.num_examples - self.num_examples % self.batch_size
        return self.num_examples

    def _next_epoch(self) -> None:
        self._epoch += 1
        self._position = 0
        self._order = self._permutation(self._epoch)

    def yield_batch(self) -> Batch:
        """Returns the next `(spec, inputs, labels)`; raises `StopIteration` at epoch end."""
        if self._position >= self._batches_per_epoch_end():
            if not self.loop_forever:
                raise StopIteration
            self._next_epoch()
        start = self._position
        stop = min(start + self.batch_size, self.num_examples)
        self._position = stop
        if self._order is None:
            index = slice(start, stop)
        else:
            index = self._order[start:stop]
        return (
            self.spec,
            [array[index] for array in self.inputs],
            [array[index] for array in self.labels],
        )

    def reset(self) -> None:
        """Starts the next epoch (with its own shuffle) from the beginning."""
        if self._position > 0:
            self._next_epoch()

    def get_state(self) -> dict:
        """Returns the position (epoch and offset) as a JSON-serializable dict."""
        return {"epoch": self._epoch, "position": self._position, "seed": self.seed}

    def set_state(self, state: dict) -> None:
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
        self._order = self._permutation(self._epoch)

    def __repr__(self) -> str:
        return (
            f"ArrayDataset(name={self.name!r}, examples={self.num_examples}, "
            f"batch_size={self.batch_size})"
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


def bad_batch_error(dataset: Any, batch: Any) -> ValueError:
    """The error for a `yield_batch()` result that is not `(spec, inputs, labels)`."""
    size = (
        f"a tuple of {len(batch)} items"
        if isinstance(batch, tuple)
        else f"a {type(batch).__name__}"
    )
    return ValueError(
        f"dataset {getattr(dataset, 'name', dataset)!r} yielded {size}; yield_batch() must "
        "return (spec, inputs, labels). For (inputs, labels) pairs return "
        "(None, inputs, labels), or wrap a generator in loopax.IterableDataset, which "
        "accepts both"
    )


def read_batches(dataset: Any, during: str) -> Iterator[Batch]:
    """Every batch `dataset` yields from where it is, each checked to be `(spec, inputs,
    labels)`.

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
                f"dataset {getattr(dataset, 'name', dataset)!r} failed during {during}: "
                f"{type(err).__name__}: {err}"
            ) from err
        if type(batch) is not tuple or len(batch) != 3:
            raise bad_batch_error(dataset, batch)
        yield batch


def _stack(arrays: list[Any]) -> Any:
    if all(isinstance(a, np.ndarray) for a in arrays):
        return np.stack(arrays)
    import jax.numpy as jnp  # noqa: PLC0415  (only for batches already on a device)

    return jnp.stack(arrays)


def micro_batch_reader(dataset: Any, count: int) -> Callable[[], Batch]:
    """`yield_batch` for gradient accumulation: up to `count` consecutive batches of
    `dataset`, each input and label stacked on a new leading axis.

    A group ends early when the dataset ends after its first batch (one optimizer step
    over fewer micro-batches); `StopIteration` only when no batch is left.

    Raises:
      ValueError: a batch is not `(spec, inputs, labels)`, or the batches of one group
        differ in spec, number of arrays or shapes (they cannot be stacked).
    """
    yield_batch = dataset.yield_batch

    def read() -> Batch:
        group = []
        while len(group) < count:
            try:
                batch = yield_batch()
            except StopIteration:
                if not group:
                    raise
                break
            if type(batch) is not tuple or len(batch) != 3:
                raise bad_batch_error(dataset, batch)
            spec, inputs, labels = batch[0], as_list(batch[1]), as_list(batch[2])
            if group:
                _check_same_kind(dataset, group[0], (spec, inputs, labels), len(group), count)
            group.append((spec, inputs, labels))
        spec = group[0][0]
        inputs = [_stack([g[1][i] for g in group]) for i in range(len(group[0][1]))]
        labels = [_stack([g[2][i] for g in group]) for i in range(len(group[0][2]))]
        return spec, inputs, labels

    return read


def _check_same_kind(dataset: Any, first: tuple, batch: tuple, index: int, count: int) -> None:
    def shapes(b: tuple) -> tuple:
        return [np.shape(a) for a in b[1]], [np.shape(a) for a in b[2]]

    if first[0] != batch[0] or shapes(first) != shapes(batch):
        raise ValueError(
            f"dataset {getattr(dataset, 'name', dataset)!r}: with accumulate_steps={count} the "
            f"{count} batches of one optimizer step are stacked, so they need one spec and one "
            f"shape; micro-batch {index} has spec {batch[0]!r} and shapes {shapes(batch)}, the "
            f"first has spec {first[0]!r} and shapes {shapes(first)}. Give every batch the same "
            "size (e.g. ArrayDataset(..., drop_remainder=True))"
        )
