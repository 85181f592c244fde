"""Uneven shares across processes: every process runs the same programs, whatever it holds.

When several processes evaluate (or predict), each reads its own share of the data, and the
shares need not be equal: 7 examples on one process and 3 on another, or none on one. Every
compiled call is a collective over all the processes' devices, so each process must make the
same calls with the same shapes. Before each of its batches, the processes agree on every
process's batch size (one tiny all-gather); a process whose share is used up feeds padding
that no metric counts.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from .._distributed import coordination_client
from ..data._internal import as_list

# Evaluations of this process that agreed through the coordination service, counted in the
# order they run (the same order on every process): a key of its own for each.
_EXCHANGES = itertools.count()
_TEMPLATE_MS = 300_000


@dataclasses.dataclass(frozen=True)
class Batch:
    """One process's batch: its spec, inputs and labels (lists of arrays)."""

    spec: Any
    inputs: list[Any]
    labels: list[Any]

    @property
    def size(self) -> int:
        """Its number of examples."""
        return int(self.inputs[0].shape[0])

    def rows(self, rows: np.ndarray) -> tuple[list[Any], list[Any]]:
        """`(inputs, labels)` of the examples `rows`, in that order."""
        return [a[rows] for a in self.inputs], [a[rows] for a in self.labels]


@dataclasses.dataclass(frozen=True)
class Round:
    """One batch's turn: this process's batch (or padding) and every process's batch size.

    Attributes:
      batch: this process's batch, or, when its share is used up, a batch whose rows serve
        only as padding (its last batch, or one of zeros shaped as the others' batches).
      sizes: every process's number of real examples this turn, in process order (0 where
        the share is used up).
      process: this process's index in `sizes`.
    """

    batch: Batch
    sizes: np.ndarray
    process: int

    @property
    def even(self) -> bool:
        """Whether every process holds a batch of the same size (the ordinary case)."""
        return bool(np.all(self.sizes == self.sizes[0]))


def spans_processes(devices: list[Any]) -> bool:
    """Whether `devices` belong to more than one process."""
    return len({device.process_index for device in devices}) > 1


def gather(values: list[int]) -> np.ndarray:
    """`values` of every process, one row each, in process order (a device all-gather)."""
    from jax.experimental import multihost_utils  # noqa: PLC0415

    gathered = multihost_utils.process_allgather(np.asarray(values, np.int64))
    return np.asarray(gathered).reshape(jax.process_count(), len(values))


def rounds(batches: Iterator[tuple[Any, Any, Any]]) -> Iterator[Round]:
    """This process's batches as turns every process agrees on, until all shares are used up.

    Args:
      batches: this process's `(spec, inputs, labels)` batches.

    Raises:
      ValueError: a process holds no example at all, and the batches' spec cannot be sent to
        it (it is not a JSON value).
    """
    exchange = next(_EXCHANGES)
    template: Batch | None = None
    for turn in itertools.count():
        item = next(batches, None)
        batch = None if item is None else Batch(item[0], as_list(item[1]), as_list(item[2]))
        if batch is not None:
            template = batch
        table = gather([0 if batch is None else batch.size, template is not None])
        sizes = table[:, 0]
        if not sizes.any():
            return
        if not table[:, 1].all():  # a process has seen no batch: it learns their shapes
            template = _share_template(f"loopax/eval/{exchange}/{turn}", sizes, template)
        assert template is not None, "a process without a batch received the batches' shapes"
        yield Round(batch or template, sizes, jax.process_index())


def masked_pieces(round_: Round, local_devices: int) -> Iterator[tuple[list, list, np.ndarray]]:
    """An uneven round as batches of one shard per local device, all real or all padding.

    Every process computes the same pieces from `round_.sizes`: a shard size `s` that the
    largest share left fills at least once, the shards each process fills with real
    examples, padding (copies of a real row) in the others; then again with what is left,
    each time with fewer than `s` examples left on every process.

    Yields:
      `(inputs, labels, valid)` for this process: `valid[i]` says whether its local device
      i's shard is real.
    """
    remaining = round_.sizes.astype(np.int64)
    process = round_.process
    offset = 0
    while remaining.max() > 0:
        shard = -(-int(remaining.max()) // local_devices)
        full = np.minimum(remaining // shard, local_devices)
        mine = int(full[process])
        rows = np.concatenate(
            [
                np.arange(offset, offset + mine * shard),
                np.zeros((local_devices - mine) * shard, int),
            ]
        )
        inputs, labels = round_.batch.rows(rows)
        yield inputs, labels, np.arange(local_devices) < mine
        offset += mine * shard
        remaining -= full * shard


def _describe(batch: Batch) -> str:
    try:
        spec = json.dumps(batch.spec)
    except TypeError:
        spec = None
    if (
        spec is None
        or json.loads(spec) != batch.spec
        or type(json.loads(spec)) is not type(batch.spec)
    ):
        return json.dumps({"error": repr(batch.spec)})
    arrays = {
        name: [[list(a.shape[1:]), str(a.dtype)] for a in arrays]
        for name, arrays in (("inputs", batch.inputs), ("labels", batch.labels))
    }
    return json.dumps({"spec": batch.spec, **arrays})


def _share_template(key: str, sizes: np.ndarray, template: Batch | None) -> Batch:
    """The first process with a batch sends its shapes; a process with none receives them."""
    client = coordination_client()
    assert client is not None, "processes whose devices work together run jax.distributed"
    sender = int(np.flatnonzero(sizes)[0])
    if jax.process_index() == sender:
        assert template is not None, "the sender holds a batch"
        client.key_value_set(key, _describe(template))
    elif template is None:
        description = json.loads(client.blocking_key_value_get(key, _TEMPLATE_MS))
        if "error" not in description:
            zeros = {
                name: [np.zeros((1, *shape), dtype) for shape, dtype in description[name]]
                for name in ("inputs", "labels")
            }
            return Batch(description["spec"], zeros["inputs"], zeros["labels"])
    if template is None or "error" in json.loads(_describe(template)):
        no_batch = np.flatnonzero(sizes == 0).tolist()
        raise ValueError(
            f"process(es) {no_batch} hold no example of this dataset, so they must be sent "
            f"the shape of its batches, but their spec is not a JSON value (None, a str, "
            "an int, ...); give every process at least one example or use such a spec"
        )
    return template
