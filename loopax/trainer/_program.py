"""The Trainer's compiled programs, one frozen record each: what it runs and what it takes.

A `Program` says which step body it wraps, how many of its arguments are replicated (state)
and split over the devices (the batch), which it donates, which axes its batches carry in
front of the batch axis, and how a batch becomes its arguments. `Programs` compiles and runs
them; the records hold no state of their own.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import jax
import numpy as np

from ._batches import split_uneven_batch
from ._gather import gathering, gathering_steps

if TYPE_CHECKING:
    from jax.stages import Wrapped

    from ..data._internal import DeviceChunk
    from ._parallel import Strategy
    from ._steps import StepBuilder

MICRO_BATCHES = "micro-batches"  # a leading axis only under gradient accumulation
STEPS = "steps"

# A batch as the programs take it: `(inputs, labels)`, each a list of arrays.
Batch: TypeAlias = "tuple[list, list]"
# What a program's arguments come from: a batch, or where an on-device group's batches lie
# (`TRAIN_STEPS_GATHERED`'s). Each program's `arguments` and `model_inputs` take its kind.
Source: TypeAlias = "Batch | DeviceChunk"


def _batches(strategy: Strategy, source: Source, leading: int) -> tuple:
    """`(inputs, labels)` as the program takes them: split on the axis behind `leading`."""
    inputs, labels = cast("Batch", source)
    return strategy.global_batch(inputs, leading), strategy.global_batch(labels, leading)


def _inputs(strategy: Strategy, source: Source, leading: int) -> tuple:
    """The inputs alone (predictions take no labels)."""
    return (strategy.global_batch(cast("Batch", source)[0], leading),)


def _pieces(strategy: Strategy, source: Source, leading: int) -> tuple:
    """An eval batch the local devices do not divide, in the pieces `eval_uneven` takes."""
    inputs, labels = cast("Batch", source)
    pieces = split_uneven_batch(inputs, labels, strategy.local_devices)
    return tuple(strategy.global_batch(piece) for piece in pieces)


def _chunk_arrays(strategy: Strategy, source: Source, leading: int) -> tuple:
    """The devices' arrays and where the group's batches lie in them."""
    return cast("DeviceChunk", source).arguments()


def _first_batch(strategy: Strategy, source: Source, leading: int) -> list:
    """One step's (micro-)batch of inputs, to create the state from."""
    return [a[(0,) * leading] for a in cast("Batch", source)[0]]


def _first_piece(strategy: Strategy, source: Source, leading: int) -> list:
    """The padded remainder's inputs: one example per local device."""
    inputs, labels = cast("Batch", source)
    return split_uneven_batch(inputs, labels, strategy.local_devices)[0]


def _chunk_first_batch(strategy: Strategy, source: Source, leading: int) -> list:
    return cast("DeviceChunk", source).first_batch()[0]


def _wrapped(
    program: Program,
    strategy: Strategy,
    steps: StepBuilder,
    spec: Any,
    rng: Any,
    source: Source,
    leading: int,
    sharded: int,
) -> Wrapped:
    """The program's body over the strategy's devices, one jit-compiled program."""
    body = functools.partial(program.body(steps), spec, rng)
    return strategy.wrap(body, program, sharded, batch_axis=leading)


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """One kind of compiled program of the Trainer.

    Attributes:
      name: the cache's key and the name batch checks give it (`"eval"` for both eval
        programs: an even and an uneven batch never share a shape).
      graph_type: `ExecInfo.graph_type`, as `on_exec_creation` reports it.
      body: the per-device step body, from the `StepBuilder`.
      replicated: how many leading arguments are replicated (the states; default 1, the
        train state).
      sharded: how many batch arguments are split over the devices; None: as many as
        `arguments` builds.
      donate: the arguments whose buffers the program reuses (default none).
      leading_axes: the axes a batch carries in front of its batch axis; `"micro-batches"`
        only when the trainer accumulates gradients (default none).
      arguments: `arguments(strategy, source, leading)`, the batch arguments.
      model_inputs: `model_inputs(strategy, source, leading)`, one step's inputs, to create
        or check the state from (default: the source's inputs, one step's (micro-)batch).
      per_example_output: whether the body returns per-example values (predictions).
      updates_state: whether the body returns a new train state first (train programs).
      split_batch: whether the batch is split over the devices; off for a global-batch
        program (a mesh's) taking an eval batch that the data shards do not divide.
      wrap: `wrap(program, strategy, steps, spec, rng, source, leading, sharded)`, the
        program ready to lower.
    """

    name: str
    graph_type: str
    body: Callable[[StepBuilder], Callable[..., Any]]
    sharded: int | None
    arguments: Callable[[Strategy, Source, int], tuple]
    replicated: int = 1
    donate: tuple[int, ...] = ()
    leading_axes: tuple[str, ...] = ()
    model_inputs: Callable[[Strategy, Source, int], list] = _first_batch
    per_example_output: bool = False
    updates_state: bool = False
    split_batch: bool = True
    wrap: Callable[..., Wrapped] = _wrapped

    def axes(self, accumulating: bool) -> tuple[str, ...]:
        """The leading axes of this program's batches, given gradient accumulation."""
        if accumulating:
            return self.leading_axes
        return tuple(axis for axis in self.leading_axes if axis != MICRO_BATCHES)

    def __repr__(self) -> str:
        return f"Program({self.name!r})"


TRAIN = Program(
    name="train",
    graph_type="train",
    body=operator.attrgetter("train"),
    sharded=2,
    donate=(0,),
    leading_axes=(MICRO_BATCHES,),
    arguments=_batches,
    updates_state=True,
)
TRAIN_STEPS = dataclasses.replace(
    TRAIN,
    name="train_steps",
    graph_type="train_steps",
    body=operator.attrgetter("train_steps"),
    leading_axes=(STEPS, MICRO_BATCHES),
)


def _gathering(
    program: Program,
    strategy: Strategy,
    steps: StepBuilder,
    spec: Any,
    rng: Any,
    source: DeviceChunk,
    leading: int,
    sharded: int,
) -> Wrapped:
    """Fused steps that take each step's batch from the devices' arrays themselves."""
    count, size, reading = source.count, source.size, source.reading
    if strategy.slices_in_scan:  # each step slices its own batch in the scan
        scan = functools.partial(program.body(steps), spec, rng)
        train = functools.partial(steps.train, spec, rng)  # a group of one step: no loop
        body = gathering_steps(scan, train, count, size, strategy.num_devices, reading)
        return strategy.wrap(body, program, sharded)
    # pmap: the group taken first, then the stacked steps
    run = TRAIN_STEPS.wrap(TRAIN_STEPS, strategy, steps, spec, rng, source, leading, 2)
    return jax.jit(gathering(run, count, size, reading), donate_argnums=program.donate)


TRAIN_STEPS_GATHERED = Program(
    name="train_steps_gathered",
    graph_type="train_steps",  # reported as the fused steps it runs
    body=operator.attrgetter("scan_steps"),
    replicated=4,  # the state, where the batches lie, start and end: all replicated
    sharded=0,
    donate=(0,),
    leading_axes=(STEPS,),
    arguments=_chunk_arrays,
    model_inputs=_chunk_first_batch,
    updates_state=True,
    wrap=_gathering,
)
EVAL = Program(
    name="eval",
    graph_type="eval",
    body=operator.attrgetter("evaluation.eval"),
    replicated=2,  # the train state and the running eval metric states
    sharded=2,
    donate=(1,),
    arguments=_batches,
)
# A global-batch program (a mesh's) takes a batch the data shards do not divide whole.
EVAL_WHOLE = dataclasses.replace(EVAL, split_batch=False)
EVAL_UNEVEN = dataclasses.replace(
    EVAL,
    body=operator.attrgetter("evaluation.eval_uneven"),
    sharded=None,  # 3 pieces, or 5 when the batch has a part the devices divide
    arguments=_pieces,
    model_inputs=_first_piece,
)


def _masked(strategy: Strategy, source: Source, leading: int) -> tuple:
    """A batch laid out as one shard per device, each all real or all padding.

    The third piece says which (`Programs.run_masked` passes the real flags; a program is
    compiled from these, all True, as only their shapes count).
    """
    inputs, labels = cast("Batch", source)
    every = np.ones(strategy.local_devices, bool)
    return tuple(strategy.global_batch(piece) for piece in (inputs, labels, [every]))


# Several processes with uneven evaluation shares: a batch whose devices' shards are each all
# real or all padding (`eval_uneven`'s padded piece with any number of examples per device).
EVAL_MASKED = dataclasses.replace(EVAL_UNEVEN, arguments=_masked, model_inputs=_first_batch)
PREDICT = Program(
    name="predict",
    graph_type="predict",
    body=operator.attrgetter("evaluation.predict"),
    sharded=1,
    arguments=_inputs,
    per_example_output=True,
)
