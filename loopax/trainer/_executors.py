"""The executor cache: one compiled step per (program, spec, shapes and dtypes)."""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable, Hashable
from typing import Any

from .._validate import positive_int
from ._batches import signature, spec_key, validate_batch
from ._program import MICRO_BATCHES, Program

logger = logging.getLogger("loopax")


@dataclasses.dataclass(frozen=True)
class ExecInfo:
    """Describes one compiled executable, as reported to `Trainer.on_exec_creation`.

    Attributes:
      graph_type: `"train"`, `"train_steps"` (n fused steps: inputs carry a leading steps
        axis), `"eval"` or `"predict"`.
      spec: the dataset spec the executable was compiled for.
      input_shapes, input_dtypes, label_shapes, label_dtypes: the global batch's
        shapes and dtype names.
      compile_seconds: wall time of tracing, lowering and compiling (a program compiled in
        the background: its tracing and lowering on the training thread and its compiling
        on the background thread, which may overlap with training).
      flops: XLA's cost analysis of one call, summed over the devices, or None when the
        backend gives none (XLA counts a loop's body once: a fused program's is about one
        step's).
      flops_per_step: the FLOPs of one optimizer step over all devices, from `flops`, for
        a train program; else None.
      steps: optimizer steps one call takes (n for `"train_steps"`; 0 for evaluation and
        prediction).
      examples: examples one call reads (all processes).
      prediction_shapes: the shapes of the predictions the loss function gets in one step
        (one device's share of the batch under data parallelism, the global batch on a
        `mesh`; one micro-batch's with `accumulate_steps`), one per prediction; () for
        prediction programs. E.g. `((32, 10),)`: a sparse categorical loss takes class ids
        in `[0, 10)`. The Loop checks a non-finite step's labels against the last axis.
    """

    graph_type: str
    spec: Any
    input_shapes: tuple
    input_dtypes: tuple
    label_shapes: tuple
    label_dtypes: tuple
    compile_seconds: float
    flops: float | None = None
    flops_per_step: float | None = None
    steps: int = 0
    examples: int = 0
    prediction_shapes: tuple[tuple[int, ...], ...] = ()


@dataclasses.dataclass
class Executor:
    """A compiled step with its description and how often the cache returned it."""

    info: ExecInfo
    run: Callable[..., Any] = dataclasses.field(repr=False)
    hits: int = 0
    key: Hashable = dataclasses.field(default=None, repr=False)


@dataclasses.dataclass(frozen=True)
class Pending:
    """A program compiling in the background, cached from when it was lowered.

    The cache asks `resolve()` for the executor the first time the program is needed: it
    waits for the compilation if it is still running (never compiles it again) and
    reports the program then, on the thread that uses it.

    Attributes:
      info: the program's description, without its compile seconds and costs yet.
      resolve: the `Executor`, once compiled; None when the programs compiled so far no
        longer fit the train state (the cache was cleared: compile it anew).
    """

    info: ExecInfo
    resolve: Callable[[], Executor | None] = dataclasses.field(repr=False)


class ExecutorCache:
    """A least-recently-used cache of compiled steps, at most `max_size` of them.

    Evicting warns, naming the evicted spec and shapes, because an input pipeline whose
    shapes keep changing pays a compilation per new shape.

    Keys are `(program name, spec, shapes and dtypes)`. Building such a key costs more than a
    small step's own dispatch, so `get_fast` also looks executors up by a cheaper key
    (e.g. the batch's JAX avals) that `remember` maps to an executor found the slow way.
    Fast keys are an index only: hits and recency are those of the executor's own key.
    """

    def __init__(self, max_size: int, local_devices: int = 1, accumulate_steps: int = 1):
        self.max_size = positive_int("max_executors", max_size)
        self.local_devices = local_devices
        self.accumulating = accumulate_steps > 1
        self.axis_limits = {MICRO_BATCHES: accumulate_steps}  # the most a leading axis may hold
        # Inputs and labels per spec, as first used: a spec keeps its arrangement.
        self._input_counts: dict[Hashable, tuple[int, int]] = {}
        self._entries: collections.OrderedDict[Hashable, Executor | Pending] = (
            collections.OrderedDict()
        )
        self._fast: dict[Hashable, Executor] = {}

    def executor(
        self,
        program: Program,
        spec: Any,
        inputs: list,
        labels: list,
        build: Callable[[Program, Any, list, list, int], Executor],
        extra_key: Hashable = None,
    ) -> Executor:
        """The compiled `program` for this batch: cached, or built after the batch is validated.

        Built by `build(program, spec, inputs, labels, batch size)`, once the batch passes
        `validate_batch`. `extra_key` is what else the program depends on (e.g. the
        arrays a program gathers its batches from).

        The fast path: JAX arrays carry their abstract value (shape, dtype, weak type,
        sharding), cheap to read and hash. Keying on shapes and dtypes costs ~3 µs a step,
        2-3% of a small model's step.

        Raises:
          TypeError, ValueError: the batch is not valid (as `validate_batch`).
        """
        try:
            avals = [a.aval for a in inputs]
            fast_key = (program, spec, len(inputs), *avals, *[a.aval for a in labels])
            executor = self.get_fast(fast_key)
        except (AttributeError, TypeError):  # numpy batches, or an unhashable spec
            fast_key = executor = None
        if executor is not None:
            return executor
        key = _key(program, spec, inputs, labels, extra_key)
        executor = self.get(key)
        if executor is None:
            executor = build(
                program, spec, inputs, labels, self._validate(program, spec, inputs, labels)
            )
            self.put(key, executor)
        if fast_key is not None:
            self.remember(fast_key, executor)
        return executor

    def prepare(
        self,
        program: Program,
        spec: Any,
        inputs: list,
        labels: list,
        build: Callable[[Program, Any, list, list, int], Pending],
        extra_key: Hashable = None,
    ) -> None:
        """Caches `build(...)`'s `Pending` program for this batch, unless one is cached.

        As `executor`, for a batch that has not come yet (its shapes, e.g. as
        `jax.ShapeDtypeStruct`s): the program is resolved when a batch of them comes.

        Raises:
          TypeError, ValueError: the batch is not valid (as `validate_batch`).
        """
        key = _key(program, spec, inputs, labels, extra_key)
        if key not in self._entries:
            batch = self._validate(program, spec, inputs, labels)
            self.put(key, build(program, spec, inputs, labels, batch))

    def _validate(self, program: Program, spec: Any, inputs: list, labels: list) -> int:
        """The batch's size, once `validate_batch` passed it."""
        return validate_batch(
            program.name,
            spec,
            spec_key(spec),
            inputs,
            labels,
            self._input_counts,
            self.local_devices,
            program.axes(self.accumulating),
            self.axis_limits,
        )

    def executor_for(
        self,
        program: Program,
        spec: Any,
        extra_key: tuple,
        shapes: Callable[[], tuple[list, list]],
        build: Callable[[Program, Any, list, list, int], Executor],
    ) -> Executor:
        """`executor` for a program whose batch is `extra_key` (e.g. the devices' arrays).

        Looked up by `(program, spec, *extra_key)` first; on a miss, as `executor` with
        the batch's abstract `shapes()` (inputs, labels).
        """
        fast_key = self.fast_key(program, spec, extra_key)
        executor = self.get_fast(fast_key)
        if executor is None:
            inputs, labels = shapes()
            executor = self.executor(program, spec, inputs, labels, build, extra_key=extra_key)
            self.remember(fast_key, executor)
        return executor

    def fast_key(self, program: Program, spec: Any, extra_key: tuple) -> tuple:
        """The key `executor_for` looks `program` up by for `spec` and `extra_key`.

        A caller may keep it and call `get_fast` with it while nothing in it changes.
        """
        fast_key = (program.name, spec, *extra_key)
        try:
            hash(fast_key)
        except TypeError:  # an unhashable spec
            return (program.name, spec_key(spec), *extra_key)
        return fast_key

    def get(self, key: Hashable) -> Executor | None:
        """The executor cached for `key` (a `Pending` one resolved first), or None."""
        executor = self._entries.get(key)
        if isinstance(executor, Pending):
            executor = executor.resolve()
            if executor is None:  # it no longer fits the state; the cache was cleared
                return None
            executor.key = key
            self._entries[key] = executor
        if executor is not None:
            self._entries.move_to_end(key)
            executor.hits += 1
        return executor

    def get_fast(self, fast_key: Hashable) -> Executor | None:
        """The executor `remember`ed for `fast_key` (counted as a hit), or None."""
        executor = self._fast.get(fast_key)
        if executor is not None:
            self._entries.move_to_end(executor.key)
            executor.hits += 1
        return executor

    def remember(self, fast_key: Hashable, executor: Executor) -> None:
        """Maps `fast_key` to a cached `executor` for `get_fast`."""
        if len(self._fast) >= 4 * self.max_size:  # e.g. many shardings of one shape
            self._fast.clear()
        self._fast[fast_key] = executor

    def put(self, key: Hashable, executor: Executor | Pending) -> None:
        if isinstance(executor, Executor):
            executor.key = key
        self._entries[key] = executor
        while len(self._entries) > self.max_size:
            self._fast.clear()
            _, evicted = self._entries.popitem(last=False)
            info = evicted.info
            logger.warning(
                "loopax: evicting the compiled %s step for spec %r with input shapes %s and "
                "label shapes %s: more than max_executors=%d distinct specs/shapes are in use. "
                "Pad or bucket batches to a few shapes, or raise max_executors.",
                info.graph_type,
                info.spec,
                info.input_shapes,
                info.label_shapes,
                self.max_size,
            )

    def values(self) -> list[Executor]:
        """The compiled executors, least recently used first (not those still compiling)."""
        return [entry for entry in self._entries.values() if isinstance(entry, Executor)]

    def clear(self) -> None:
        self._entries.clear()
        self._fast.clear()


def _key(program: Program, spec: Any, inputs: list, labels: list, extra_key: Hashable) -> tuple:
    """The cache's key of `program` for a batch: name, spec, shapes and dtypes, `extra_key`."""
    return (
        program.name,
        spec_key(spec),
        signature(inputs, "inputs", spec),
        signature(labels, "labels", spec),
        extra_key,
    )
