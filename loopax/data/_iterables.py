"""Any iterable of batches as a dataset: lists, generators, grain's datasets and loaders.

`IterableDataset` wraps one (re-iterable, or a factory of iterators) and gives it a name and,
when its iterator has one, a checkpointable position; `as_dataset` and
`evaluation_dataset` turn what a run or an evaluation was given into a `Dataset`.
"""

from __future__ import annotations

import base64
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple, TypeGuard

import jax
import numpy as np

from .. import _validate, _warnings
from ._datasets import ArrayDataset, Batch, Dataset, as_list

_ELEMENT_FORMS = (
    "(inputs, labels), (spec, inputs, labels) or a dict {'inputs': ..., 'labels': ...} "
    "(inputs and labels: an array or a sequence of arrays; 'labels' and 'spec' optional)"
)
_ELEMENT_KEYS = frozenset({"inputs", "labels", "spec"})


def _is_array(value: Any) -> TypeGuard[np.ndarray | jax.Array]:
    # numpy scalars (np.int64(3)) are hashable and may be specs; arrays cannot be.
    return hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, np.generic)


def batch_from_element(element: Any, name: str) -> Batch:
    """One element of an iterable of batches as `(spec, inputs, labels)`.

    Raises:
      ValueError: the element is none of `(inputs, labels)`, `(spec, inputs, labels)` or a
        dict with "inputs" (and optionally "labels", "spec"); or its spec is an array.
    """
    if isinstance(element, tuple) and len(element) in (2, 3):
        spec, inputs, labels = (None, *element) if len(element) == 2 else element
    elif isinstance(element, Mapping) and "inputs" in element and _ELEMENT_KEYS.issuperset(element):
        spec, inputs, labels = element.get("spec"), element["inputs"], element.get("labels")
    else:
        if isinstance(element, tuple):
            what = f"a tuple of {len(element)} items"
        elif isinstance(element, Mapping):
            what = f"a dict with keys {sorted(map(str, element))}"
        else:
            what = f"an element of type {type(element).__name__}"
        raise ValueError(
            f"dataset {name!r} yielded {what}; each element must be {_ELEMENT_FORMS} (other dict "
            "keys would be dropped silently: remove them first, e.g. with grain's .map)"
        )
    if _is_array(spec):
        raise ValueError(
            f"dataset {name!r} yielded a spec that is an array of shape {tuple(spec.shape)}: a "
            "3-tuple is read as (spec, inputs, labels); for several inputs yield "
            "((input1, input2), labels)"
        )
    return spec, as_list(inputs), as_list(labels)


class ReadOnce(NamedTuple):
    """An iterator for an `IterableDataset` that reads it once and cannot `reset()`.

    What `Loop.run_steps` makes of a generator it is given directly.
    """

    iterator: Iterator[Any]


class IterableDataset:
    """Reads batches from an iterable.

    A list of batches, a grain `MapDataset`, `IterDataset` or `DataLoader`, or a zero-argument
    callable returning an iterator (a generator function).

    Each element is `(inputs, labels)`, `(spec, inputs, labels)` or a dict
    `{"inputs": ..., "labels": ..., "spec": ...}` ("labels" and "spec" optional, no other key;
    grain batches dict records into such dicts); inputs and labels are an array or a sequence
    of arrays. `reset()` starts a new iterator: `iter(source)`, or `source()`.

    `Loop.run_*` and `Trainer.evaluate` also take such a source directly, named "train" (or
    "eval"): a run on the object the loop's last run read goes on where that one stopped.
    Wrap it yourself to name it (evaluations are stored under the name) or to keep its
    position across runs on other data.
    `Trainer.evaluate` reads an `IterableDataset` with an iterator of its own, from the start,
    so evaluating the data a run trains on does not move the run's position.

    The position is the iterator's: when it has `get_state()`/`set_state()` (grain's do),
    `get_state()` returns it (bytes, as a `DataLoader`'s, base64-encoded) and a checkpoint
    resumes exactly. Other iterators (a list's, a generator) have no position to save: a run
    restored from a checkpoint reads them from where they are, with a warning.

    Args:
      source: an iterable that starts from its beginning at every `iter(source)`, or a
        zero-argument callable returning an iterator.
      name: the dataset's name in messages, logs, plots and checkpoints.

    Attributes:
      name: the name.
      source: the source read.
      can_reset: False only for an iterator the Loop was given directly.

    Raises:
      TypeError: `source` is neither, or is an iterator (a generator), which can be read only
        once (`Loop.run_steps` takes one directly, but nothing can read it again).

    Example:
      >>> import numpy as np
      >>> ds = IterableDataset([(np.ones(2), np.zeros(2))], name="one")
      >>> spec, inputs, labels = ds.yield_batch()
      >>> spec, len(inputs), len(labels)
      (None, 1, 1)
      >>> ds.get_state()  # a list's iterator has no position to save
      {'iterator': None}
    """

    can_reset: bool

    def __init__(
        self, source: Iterable[Any] | Callable[[], Iterator[Any]] | ReadOnce, *, name: str
    ):
        iterator = source.iterator if isinstance(source, ReadOnce) else None
        if iterator is not None:
            source = iterator
        elif isinstance(source, Iterator):
            raise TypeError(
                f"IterableDataset {name!r} got an iterator ({type(source).__name__}), which can "
                "be read only once; pass the iterable it reads (a list, a grain dataset) or a "
                "zero-argument callable returning a fresh iterator, e.g. `lambda: make_batches()`"
            )
        if not isinstance(source, Iterable) and not callable(source):
            raise TypeError(
                f"IterableDataset needs an iterable of batches or a zero-argument callable "
                f"returning an iterator, got {type(source).__name__}"
            )
        self.name = name
        self.source: Any = source
        self.can_reset = iterator is None
        self._iterator: Iterator[Any] | None = iterator

    def _new_iterator(self) -> Iterator[Any]:
        source = self.source
        return iter(source if isinstance(source, Iterable) else source())

    def _current(self) -> Iterator[Any]:
        # Made on first use: a grain DataLoader starts its workers when iterated.
        if self._iterator is None:
            self._iterator = self._new_iterator()
        return self._iterator

    def yield_batch(self) -> Batch:
        """Returns the next `(spec, inputs, labels)`; raises `StopIteration` at the end.

        Raises:
          ValueError: the element is not a batch (the message says the accepted forms).
        """
        iterator = self._iterator
        if iterator is None:
            iterator = self._current()
        return batch_from_element(next(iterator), self.name)

    def reset(self) -> None:
        """Starts over with a new iterator over the source.

        Raises:
          TypeError: the source is an iterator, which cannot start over.
        """
        if not self.can_reset:
            raise TypeError(self._read_once_error("reset()"))
        self._iterator = self._new_iterator()

    def _read_once_error(self, reader: str) -> str:
        """Why `reader` cannot read this dataset, when its source is an iterator."""
        return (
            f"{reader} reads its dataset from the start, and dataset {self.name!r} is an "
            f"iterator ({type(self.source).__name__}) that can be read only once; pass the "
            "iterable it comes from (a list, a grain MapDataset, IterDataset or DataLoader), "
            "or loopax.IterableDataset(make_batches, name=...) with a generator function to "
            "read it again"
        )

    def check_passes(self, reader: str) -> None:
        """Checks that `reader` (evaluate, run_epochs) can read whole passes.

        The source must start over and end.

        Raises:
          TypeError: the source is an iterator, which cannot start over.
          ValueError: the source says it is endless (`len` is `sys.maxsize`, as after grain's
            `repeat()`); an endless source without `len` cannot be told.
        """
        if not self.can_reset:
            raise TypeError(self._read_once_error(reader))
        try:
            size = len(self.source)
        except TypeError:  # no len: a generator function, an IterDataset, a DataLoader
            return
        if size >= sys.maxsize:
            raise ValueError(
                f"dataset {self.name!r} ({type(self.source).__name__}) repeats forever (its "
                f"length is sys.maxsize, as after grain's .repeat()), so {reader} would never "
                "reach its end; pass the dataset without .repeat()"
            )

    def get_state(self) -> dict:
        """The iterator's position as JSON.

        `{"iterator": its get_state()}` (`{"iterator_bytes": base64}` for bytes), or `{"iterator":
        None}` when the iterator has no `get_state()`.

        Raises:
          TypeError: the iterator's state is neither bytes nor JSON.
        """
        getter = getattr(self._current(), "get_state", None)
        if not callable(getter):
            return {"iterator": None}
        state = getter()
        if isinstance(state, bytes):
            return {"iterator_bytes": base64.b64encode(state).decode("ascii")}
        _validate.json_value(
            state,
            lambda err: (
                f"dataset {self.name!r}: its iterator's get_state() returned a "
                f"{type(state).__name__} that is not JSON ({err}); checkpoints keep dataset "
                "positions as JSON, so return ints, floats, strings, lists, dicts or bytes"
            ),
        )
        return {"iterator": state}

    def set_state(self, state: dict) -> None:
        """Restores a position returned by `get_state`.

        One without a position (its iterator had no `get_state()`) leaves the dataset where it is,
        with a warning.

        Raises:
          ValueError: `state` did not come from `IterableDataset.get_state`, or holds a
            position that this dataset's iterator has no `set_state()` to take.
        """
        if not isinstance(state, dict) or not {"iterator", "iterator_bytes"} & set(state):
            raise ValueError(
                f"dataset {self.name!r} got the state {state!r}, which no "
                "IterableDataset.get_state() returned; restore what get_state() saved"
            )
        if "iterator_bytes" in state:
            position = base64.b64decode(state["iterator_bytes"])
        else:
            position = state["iterator"]
        iterator = self._current()
        if position is None:
            _warnings.warn(
                f"dataset {self.name!r} has no saved position: its iterator "
                f"({type(iterator).__name__}) has no get_state()/set_state(), so it goes on "
                "from where it is and its batches differ from an uninterrupted run; for an "
                "exact resume feed a grain dataset, or a loopax Dataset with "
                "get_state()/set_state()"
            )
            return
        setter = getattr(iterator, "set_state", None)
        if not callable(setter):
            raise ValueError(
                f"dataset {self.name!r} was saved with its iterator's position, but its "
                f"iterator now ({type(iterator).__name__}) has no set_state() to take it; feed "
                "the same kind of source as the run that saved it"
            )
        setter(position)

    def __repr__(self) -> str:
        return f"IterableDataset(name={self.name!r}, source={type(self.source).__name__})"


def is_dataset(data: Any) -> bool:
    """Whether `data` is a loopax `Dataset` (it has `yield_batch()`), not an iterable to wrap."""
    return callable(getattr(data, "yield_batch", None))


def as_dataset(data: Any, name: str) -> Dataset:
    """`data` if it is a `Dataset`, else an `IterableDataset` over it.

    The `IterableDataset` is named `data.name` (a non-empty str) or `name`.

    Raises:
      TypeError: `data` is neither a `Dataset` nor an iterable of batches.
    """
    if is_dataset(data):
        return data
    own_name = getattr(data, "name", None)
    name = own_name if isinstance(own_name, str) and own_name else name
    hint = ""
    if _is_array(data):
        hint = "; for in-memory arrays use loopax.ArrayDataset(inputs, labels, batch_size)"
    elif isinstance(data, Mapping):
        hint = "; for a single batch pass [batch]"
    elif isinstance(data, (tuple, list)) and len(data) in (2, 3) and all(map(_is_array, data)):
        # Whole arrays, e.g. (x_train, y_train): no element is a batch.
        raise TypeError(
            f"got a {type(data).__name__} of {len(data)} arrays, as (inputs, labels) arrays "
            "look; a dataset is an iterable of batches, each (inputs, labels). For in-memory "
            "arrays use loopax.ArrayDataset(inputs, labels, batch_size), or [(inputs, labels)] "
            "for one batch"
        )
    elif isinstance(data, Iterator):
        return IterableDataset(ReadOnce(data), name=name)
    elif isinstance(data, Iterable) and not isinstance(data, (str, bytes)):
        return IterableDataset(data, name=name)
    elif callable(data):
        hint = (
            "; pass what it returns (make_batches()), or loopax.IterableDataset(make_batches, "
            "name=...) to call it again at every reset"
        )
    raise TypeError(
        f"expected a loopax Dataset (with yield_batch() and reset()) or an iterable of batches, "
        f"each {_ELEMENT_FORMS}; got {type(data).__name__}{hint}"
    )


def evaluation_dataset(data: Any) -> Dataset:
    """What `Trainer.evaluate` reads.

    A `Dataset` as it is (evaluate resets it); an iterable or an `IterableDataset` as a new
    `IterableDataset` over the same source from its start, named "eval" unless named; a
    looping `ArrayDataset` (a training set) as one pass over its arrays, every example once
    in order. So evaluating never moves a training position.

    Raises:
      TypeError: not a dataset or an iterable, or an iterator (it can be read only once).
      ValueError: the source repeats forever.
    """
    dataset = as_dataset(data, "eval")
    if isinstance(dataset, ArrayDataset) and dataset.loop_forever:
        return ArrayDataset(
            dataset.inputs,
            dataset.labels,
            dataset.batch_size,
            name=dataset.name,
            shuffle=False,
            drop_remainder=False,
            spec=dataset.spec,
        )
    if not isinstance(dataset, IterableDataset):
        return dataset
    dataset.check_passes("evaluate")
    return IterableDataset(dataset.source, name=dataset.name)


def reads_a_copy(data: Any) -> bool:
    """Whether `evaluation_dataset(data)` reads a copy, leaving `data`'s position alone."""
    return isinstance(data, IterableDataset) or (
        isinstance(data, ArrayDataset) and data.loop_forever
    )


def check_restartable(dataset: Dataset, reader: str) -> None:
    """Checks that `reader` (run_epochs) can read `dataset` in passes that end and restart.

    Raises:
      TypeError: the dataset has no `reset()`, or reads an iterator.
      ValueError: the dataset reads a source that repeats forever.
    """
    if isinstance(dataset, IterableDataset):
        try:
            dataset.check_passes(reader)
        except TypeError as err:
            raise TypeError(f"{err}, or use run_steps") from None
    if not callable(getattr(dataset, "reset", None)):
        raise TypeError(
            f"{reader} needs a dataset with reset() to start each epoch over, and "
            f"{getattr(dataset, 'name', type(dataset).__name__)!r} has none; add reset(), "
            "or use run_steps"
        )


class RunIterable:
    """The `IterableDataset` of the iterable a `Loop`'s last run read.

    A run on the same object goes on where that one stopped, as with a `Dataset`. Only the last is
    kept: a loop given a new pipeline per run must not hold every old one (and its read-ahead).
    """

    def __init__(self) -> None:
        self._last: tuple[Any, Dataset] | None = None

    def dataset(self, data: Any, trainer: Any) -> Dataset:
        """`data` as a `Dataset` for `trainer`: itself, or an `IterableDataset` "train".

        For the same object, the last run's `IterableDataset`.

        Raises:
          TypeError: `data` is neither a `Dataset` nor an iterable of batches.
          ValueError: `data` is an on-device `ArrayDataset` on other devices than
            `trainer`'s.
        """
        if is_dataset(data):
            check_trainer_devices(data, trainer)
            return data
        if self._last is None or self._last[0] is not data:
            self._last = (data, as_dataset(data, "train"))
        return self._last[1]


def check_trainer_devices(dataset: Any, trainer: Any) -> None:
    """Refuses to train on an on-device dataset held on other devices than the trainer's.

    A batch gathered on the dataset's devices cannot enter a step compiled for other
    devices; this says so before the first step, in words. (With several processes each
    holds its own part of the data, which the trainer assembles.)

    Raises:
      ValueError: `dataset` holds its arrays on devices other than `trainer.devices`.
    """
    devices = dataset.devices if isinstance(dataset, ArrayDataset) else None
    if devices is None or jax.process_count() > 1:
        return
    if trainer.gathers_on(devices):
        return
    held = [device.id for device in devices]
    used = [device.id for device in trainer.devices]
    raise ValueError(
        f"ArrayDataset {dataset.name!r} holds its arrays on devices {held} (on_device=True), "
        f"but the Trainer trains on devices {used}; its batches cannot enter the Trainer's "
        "step. Build the dataset with devices=trainer.devices (the same devices, in the "
        "same order)"
    )
