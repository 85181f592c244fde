"""The Trainer's compiled programs: built from the step bodies, cached, and run on its state."""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np

from .. import _warnings
from ..data._internal import Dispatch, OnDevice, OneStep, Stacked, as_list, with_count
from . import _background
from ._aux import may_return_aux
from ._compiler_options import compile_lowered
from ._creation import StateCreator, StateRecipe
from ._executors import ExecInfo, Executor, ExecutorCache, Pending
from ._gather import AFTER
from ._named import StepResult, fused_metrics, named_metrics
from ._program import (
    EVAL_MASKED,
    STEPS,
    TRAIN,
    TRAIN_STEPS,
    TRAIN_STEPS_GATHERED,
    Program,
    Source,
)
from ._slow_convolutions import slow_convolutions, slow_convolutions_message
from ._step_config import StepConfig
from ._steps import StepBuilder

if TYPE_CHECKING:
    from ..data._internal import DeviceChunk
    from ._parallel import Strategy
    from ._placed_state import PlacedState


class Programs:
    """Compiles each `Program` once per batch kind, caches it, and runs it on the state.

    The first program compiled creates the train state (or checks a loaded one against the
    model's variables): only a batch shows the variables' shapes (`StateCreator`).

    Args:
      recipe: what the state is built from: the model, its optimizer, seed and start.
      config: the step bodies' configuration.
      placed: the train state the programs run on.
      cache: the compiled programs.

    Attributes:
      steps: the step bodies, rebuilt by `configure`.
      metric_names: the keys of a train step's metrics, in order (the step bodies'
        `train_keys`, then `aux_names`).
    """

    def __init__(
        self,
        recipe: StateRecipe,
        config: StepConfig,
        placed: PlacedState,
        cache: ExecutorCache,
    ):
        self._recipe = recipe
        self._strategy: Strategy = config.strategy
        self._placed = placed
        self._cache = cache
        self._creator = StateCreator(recipe, config.strategy, placed)
        self._exec_handlers: list[Callable[[ExecInfo], None]] = []
        # Whether fused programs still need their convolutions checked (see `_report`).
        self._check_convolutions = self._strategy.devices[0].platform == "cpu"
        # The same host metric objects across configs: they hold the host states. None
        # when there are none: a test of None costs a step less than `HostMetrics.__bool__`.
        self._host_train = config.host_train or None
        self._gathered_key: _GatheredKey | None = None  # see `_train_gathered`
        self.steps = StepBuilder(recipe.adapted, config)

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The keys of a train step's metrics, in order.

        The step bodies' `train_keys`, then the names of the loss function's auxiliary
        outputs once a train step is traced.
        """
        return self.steps.train_keys + self.steps.aux_names

    @property
    def aux_names(self) -> tuple[str, ...] | None:
        """The loss function's auxiliary output names; None while no train step was traced.

        () at once where there can be none: no loss function (only `ctx.add_loss`), or one
        of `loopax.losses`.
        """
        steps = self.steps
        if steps.aux_traced or not may_return_aux(steps.config.loss_fn):
            return steps.aux_names
        return None

    def configure(self, **changes: Any) -> None:
        """Rebuilds the step bodies with `changes` to their config; drops compiled programs.

        The loss function's auxiliary output names carry over: the loss function is the same.
        """
        config = dataclasses.replace(self.steps.config, **changes)
        previous, self.steps = self.steps, StepBuilder(self._recipe.adapted, config)
        self.steps.carry_aux_names(previous)
        self._cache.clear()
        self._creator.cancel()

    def skip_non_finite(self, enabled: bool) -> None:
        """See `Trainer.skip_non_finite_steps`: recompiles only when it changes."""
        if enabled != self.steps.config.skip_non_finite:
            self.configure(skip_non_finite=enabled)

    def add_per_step_update(self, fn: Callable[[Any], Any]) -> None:
        """See `Trainer.add_per_step_update`."""
        if not callable(fn):
            raise TypeError(f"add_per_step_update needs a callable, got {type(fn).__name__}")
        self.configure(per_step_updates=(*self.steps.config.per_step_updates, fn))

    def reset_train_metrics(self) -> None:
        """Resets every train metric's state, the loss's moving average included."""
        self.steps.config.host_train.reset()  # host metrics' states
        if self._placed.device_state is not None:
            self._placed.replace_train_metrics(self._creator.fresh_train_metrics(self.steps))

    def add_exec_handler(self, handler: Callable[[ExecInfo], None]) -> None:
        """Calls `handler(info)` whenever a program is compiled (see `Trainer.on_exec_creation`)."""
        if not callable(handler):
            raise TypeError(f"on_exec_creation needs a callable, got {type(handler).__name__}")
        self._exec_handlers.append(handler)

    @property
    def has_start(self) -> bool:
        """Whether the state, once created, starts from given parameters (`init_params`)."""
        return self._recipe.init_params is not None

    def executors(self) -> list[Executor]:
        """The cached compiled programs, least recently used first."""
        return self._cache.values()

    # -- running --------------------------------------------------------------------------

    def dispatch(self, dispatch: Dispatch) -> StepResult:
        """Runs one dispatch of the loop as one compiled call; see `Trainer.run`.

        The placed state takes the new state and advances its global step by the steps run.

        Raises:
          TypeError: `dispatch` is none of `OneStep`, `Stacked` and `OnDevice`.
        """
        if isinstance(dispatch, OneStep):  # the per-step path, kept to one call here
            spec, inputs, labels = dispatch
            inputs = as_list(inputs)
            labels = as_list(labels)
            executor = self._cache.executor(TRAIN, spec, inputs, labels, self._compile_train)
            placed = self._placed
            state, values = executor.run(placed.device_state, inputs, labels)
            placed.advance(state, 1)
            return StepResult(named_metrics(self.metric_names, values, self._host_train))
        if isinstance(dispatch, Stacked):
            return self._train_stacked(dispatch)
        if isinstance(dispatch, OnDevice):
            return self._train_gathered(dispatch.spec, dispatch.chunk)
        raise TypeError(
            "Trainer.run takes a OneStep, Stacked or OnDevice record, got "
            f"{type(dispatch).__name__}"
        )

    def _train_stacked(self, dispatch: Stacked) -> StepResult:
        """Runs `TRAIN_STEPS` on stacked batches: one step per batch."""
        inputs = as_list(dispatch.inputs)
        labels = as_list(dispatch.labels)
        executor = self._cache.executor(
            TRAIN_STEPS, dispatch.spec, inputs, labels, self._compile_train
        )
        placed = self._placed
        state, values = executor.run(placed.device_state, inputs, labels)
        placed.advance(state, int(inputs[0].shape[0]))  # the steps its batches stack
        return fused_metrics(self.metric_names, values, self._host_train)

    def _train_gathered(self, spec: Any, chunk: DeviceChunk) -> StepResult:
        """Runs `TRAIN_STEPS_GATHERED` on `chunk`'s batches: one step per batch.

        Each step slices its batch from the arrays on the devices (shuffled: from the
        epoch's permuted copy, or gathers its rows through the permutation without one),
        inside the program.
        """
        # The executor's lookup key, kept from the last call while the chunks come from
        # the same epochs (their orders, by identity) with the same spec, count and size:
        # a step on the devices' arrays then costs no key building (see `_GatheredKey`).
        epoch, upcoming, count, size = chunk.epoch, chunk.next_epoch, chunk.count, chunk.size
        kept = self._gathered_key
        if (
            kept is not None
            and kept.epoch() is epoch
            and kept.next_epoch() is upcoming
            and kept.steps == count
            and kept.size == size
            and kept.spec is spec
            and kept.source() is chunk.source
        ):
            fast_key = kept.fast_key
        else:
            extra_key = _gathered_key(chunk)
            fast_key = self._cache.fast_key(TRAIN_STEPS_GATHERED, spec, extra_key)
            fields = (weakref.ref(epoch), weakref.ref(upcoming), count, size, spec)
            source = weakref.ref(chunk.source)
            self._gathered_key = _new_tuple(_GatheredKey, (*fields, source, fast_key))
        executor = self._cache.get_fast(fast_key)
        if executor is None:  # not compiled yet, or the cache was cleared
            executor = self._cache.executor_for(
                TRAIN_STEPS_GATHERED,
                spec,
                _gathered_key(chunk),
                chunk.shapes,
                functools.partial(self._compile, chunk=chunk),
            )
        placed = self._placed
        state, values = executor.run(placed.device_state, *chunk.arguments())
        chunk.source.advance(chunk.after, values.last.pop(AFTER))  # where the next group starts
        placed.advance(state, count)
        if values.stacked is None:  # one step (see `gathering_steps`)
            last = named_metrics(self.metric_names, values.last, self._host_train)
            return _new_tuple(StepResult, (last, None))  # without a Python call
        return fused_metrics(self.metric_names, values, self._host_train)

    def run(self, program: Program, spec: Any, inputs: list, labels: list, *states: Any) -> Any:
        """Runs `program` (not a train program) on a batch; its outputs.

        `states` are its replicated arguments after the train state (the running eval
        metric states); a program compiled now is compiled with them.
        """
        build = functools.partial(self._compile, states=states) if states else self._compile
        executor = self._cache.executor(program, spec, inputs, labels, build)
        arguments = program.arguments(self._strategy, (inputs, labels), 0)
        return executor.run(self._placed.device_state, *states, *arguments)

    def run_masked(
        self, spec: Any, inputs: list, labels: list, valid: np.ndarray, states: Any
    ) -> Any:
        """Runs `EVAL_MASKED` on a batch of one shard per local device; its outputs.

        `valid[i]` says whether local device i's shard holds real examples (else padding,
        left out of every metric); `states` are the running eval metric states.
        """
        build = functools.partial(self._compile, states=(states,))
        executor = self._cache.executor(
            EVAL_MASKED, spec, inputs, labels, build, extra_key=EVAL_MASKED
        )
        strategy = self._strategy
        pieces = (inputs, labels, [valid])
        return executor.run(self._placed.device_state, states, *map(strategy.global_batch, pieces))

    # -- compiling ------------------------------------------------------------------------

    def compile_ahead(self, dispatch: Dispatch, counts: Iterable[int]) -> None:
        """Starts compiling `dispatch`'s program for groups of each of `counts` steps.

        See `Trainer.compile_ahead`. The state is created from (or a loaded one checked
        against) `dispatch`'s batch first, if that has not happened.
        """
        strategy = self._strategy
        if not strategy.compiles_ahead:
            return
        program, (inputs, labels), chunk = _program_of(dispatch)
        source: Source = (inputs, labels) if chunk is None else chunk
        leading = len(program.axes(self._cache.accumulating))
        try:
            self._creator.prepare(
                self.steps, dispatch.spec, lambda: program.model_inputs(strategy, source, leading)
            )
            self._prepare(dispatch, counts)
        except BaseException:
            self._creator.abandon()
            raise

    def _prepare(self, dispatch: Dispatch, counts: Iterable[int]) -> None:
        """`compile_ahead`'s programs, lowered here, put in the cache as `Pending`."""
        for count in counts:
            program, (inputs, labels), chunk = _program_of(with_count(dispatch, count))
            if chunk is None:
                self._cache.prepare(program, dispatch.spec, inputs, labels, self._compile_later)
            else:
                build = functools.partial(self._compile_later, chunk=chunk)
                self._cache.prepare(
                    program, dispatch.spec, inputs, labels, build, extra_key=_gathered_key(chunk)
                )

    def _compile_train(
        self, program: Program, spec: Any, inputs: list, labels: list, batch: int
    ) -> Executor:
        """`_compile` for a train program that takes this process's batch as it comes.

        Under several processes its run first assembles the global arrays from this
        process's share; one process's run passes the batch on as it is (the hot path).
        """
        executor = self._compile(program, spec, inputs, labels, batch)
        strategy = self._strategy
        if strategy.multi_process:
            compiled = executor.run
            leading = len(program.axes(self._cache.accumulating))

            def run_global(state: Any, inputs: list, labels: list) -> Any:
                return compiled(state, *program.arguments(strategy, (inputs, labels), leading))

            executor.run = run_global
        return executor

    def _compile(
        self,
        program: Program,
        spec: Any,
        inputs: list,
        labels: list,
        batch: int,
        states: tuple = (),
        chunk: DeviceChunk | None = None,
    ) -> Executor:
        """Compiles `program` for this (validated) batch of `batch` examples, here and now.

        Creates the state first if there is none: its own program compiles in the
        background meanwhile. With `chunk` the batch is abstract: the program takes it from
        `chunk`'s arrays on the devices.
        """
        try:
            lowered, info, lowering = self._lower(program, spec, inputs, labels, states, chunk)
            started = time.perf_counter()
            compiled = compile_lowered(lowered, self.steps.config.options)
        except BaseException:
            self._creator.abandon()
            raise
        seconds = lowering + time.perf_counter() - started
        costs = self._costs(program, inputs)(compiled)
        if not self._creator.finish():  # an initializer changed the new state's key or layout
            self._cache.clear()
            return self._compile(program, spec, inputs, labels, batch, states, chunk)
        return self._report(info, compiled, seconds, costs)

    def _compile_later(
        self,
        program: Program,
        spec: Any,
        inputs: list,
        labels: list,
        batch: int,
        chunk: DeviceChunk | None = None,
    ) -> Pending:
        """`_compile`, with the compiling done in the background; lowered here and now."""
        lowered, info, lowering = self._lower(program, spec, inputs, labels, (), chunk)
        costs = self._costs(program, inputs)
        options = self.steps.config.options

        def compile_in_background() -> tuple[Any, float, dict]:
            started = time.perf_counter()
            compiled = compile_lowered(lowered, options)
            return compiled, time.perf_counter() - started, costs(compiled)

        future = _background.submit(compile_in_background)

        def resolve() -> Executor | None:
            compiled, seconds, program_costs = future.result()
            if not self._creator.finish():
                self._cache.clear()
                return None
            return self._report(info, compiled, lowering + seconds, program_costs)

        return Pending(info, resolve)

    def _lower(
        self,
        program: Program,
        spec: Any,
        inputs: list,
        labels: list,
        states: tuple,
        chunk: DeviceChunk | None,
    ) -> tuple[Any, ExecInfo, float]:
        """`program` lowered for the batch; its description (no costs yet) and the seconds taken."""
        strategy = self._strategy
        source: Source = (inputs, labels) if chunk is None else chunk
        leading = len(program.axes(self._cache.accumulating))  # axes before the batch axis
        self._creator.prepare(
            self.steps, spec, lambda: program.model_inputs(strategy, source, leading)
        )
        started = time.perf_counter()
        state, rng = self._creator.lowering_state()
        arguments = program.arguments(strategy, source, leading)
        sharded = len(arguments) if program.sharded is None else program.sharded
        run = program.wrap(program, strategy, self.steps, spec, rng, source, leading, sharded)
        lowered, prediction_shapes = self.steps.lower(run, state, *states, *arguments)
        info = ExecInfo(
            graph_type=program.graph_type,
            spec=spec,
            input_shapes=tuple(tuple(a.shape) for a in inputs),
            input_dtypes=tuple(str(a.dtype) for a in inputs),
            label_shapes=tuple(tuple(a.shape) for a in labels),
            label_dtypes=tuple(str(a.dtype) for a in labels),
            compile_seconds=0.0,
            prediction_shapes=prediction_shapes,
        )
        return lowered, info, time.perf_counter() - started

    def _costs(self, program: Program, inputs: list) -> Callable[[Any], dict]:
        """`_costs` of a compiled `program`, as a function of it (it may run on any thread)."""
        axes, strategy = program.axes(self._cache.accumulating), self._strategy
        return lambda compiled: _costs(compiled, program, inputs, axes, strategy)

    def _report(self, info: ExecInfo, compiled: Any, seconds: float, costs: dict) -> Executor:
        """The executor of a compiled program, reported to the exec handlers."""
        info = dataclasses.replace(info, compile_seconds=seconds, **costs)
        accumulating = self._cache.accumulating
        if self._check_convolutions and (info.steps > 1 or (info.steps and accumulating)):
            self._warn_slow_convolutions(compiled, info.steps, accumulating)
        for handler in self._exec_handlers:
            handler(info)
        return Executor(info=info, run=compiled)

    def _warn_slow_convolutions(self, compiled: Any, steps: int, accumulating: bool) -> None:
        """Warns, once per trainer, of convolutions left to XLA:CPU's generic path.

        A train program on CPU devices that loops (over a fused group's steps, or over a
        step's micro-batches) keeps them in the loop when their dimensions are not in
        XLA:CPU's canonical order (see `slow_convolutions`).
        """
        labels = slow_convolutions(compiled.as_text())  # about a millisecond, when compiled
        if labels:
            self._check_convolutions = False
            _warnings.warn(slow_convolutions_message(steps, accumulating, labels))


def _program_of(dispatch: Dispatch) -> tuple[Program, tuple[list, list], DeviceChunk | None]:
    """The train program running `dispatch`, its batch (or shapes) and its on-device chunk."""
    if isinstance(dispatch, OneStep):
        return TRAIN, (as_list(dispatch.inputs), as_list(dispatch.labels)), None
    if isinstance(dispatch, OnDevice):
        return TRAIN_STEPS_GATHERED, dispatch.chunk.shapes(), dispatch.chunk
    return TRAIN_STEPS, (as_list(dispatch.inputs), as_list(dispatch.labels)), None


class _GatheredKey(NamedTuple):
    """The executor cache's fast key of the last gathering program run, and what it is for.

    `_gathered_key` reads a chunk's count, size, reading and source; the reading is its
    epochs' (`DeviceChunk.reading`), so chunks of the same epoch orders, by identity, count,
    size and source share the key. `epoch`, `next_epoch` and `source` are weak references:
    the kept key keeps neither a finished epoch's permuted copy nor a dropped dataset's
    arrays alive.
    """

    epoch: weakref.ref
    next_epoch: weakref.ref
    steps: int
    size: int
    spec: Any
    source: weakref.ref
    fast_key: tuple


_new_tuple = tuple.__new__  # a named tuple from a tuple of its fields, without a Python call


def _gathered_key(chunk: DeviceChunk) -> tuple:
    """What a gathering program depends on besides its spec: the chunk's kind and arrays.

    The reading by its value: a str hashes in C, an enum member by a Python call each time
    the key is looked up.
    """
    return (chunk.count, chunk.size, chunk.reading.value, chunk.source.key)


def _costs(compiled: Any, program: Program, inputs: Any, axes: tuple, strategy: Any) -> dict:
    """`ExecInfo`'s flops (all devices), optimizer steps and examples of one call."""
    try:
        analysis = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - a backend without cost analysis: no FLOPs
        analysis = None
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else None
    per_device = analysis.get("flops") if isinstance(analysis, dict) else None
    flops = None if per_device is None else float(per_device) * strategy.num_devices
    shape = tuple(inputs[0].shape) if inputs else ()
    leading = len(axes)  # the axes before the batch axis
    examples = int(np.prod(shape[: leading + 1])) if len(shape) > leading else 0
    if strategy.multi_process:
        examples *= jax.process_count()  # each process passed its share
    steps = 0
    if program.graph_type in ("train", "train_steps"):
        steps = shape[axes.index(STEPS)] if STEPS in axes and shape else 1
    flops_per_step = None
    if flops is not None and steps:
        # XLA's cost analysis counts a loop's body once: a fused program's FLOPs are one
        # step's, unless XLA unrolled the loop (no while left in the program).
        looped = steps > 1 and " while(" in compiled.as_text()
        flops_per_step = flops if looped else flops / steps
    return {
        "flops": flops,
        "flops_per_step": flops_per_step,
        "steps": int(steps),
        "examples": examples,
    }
