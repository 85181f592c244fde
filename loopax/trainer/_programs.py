"""The Trainer's compiled programs: built from the step bodies, cached, and run on its state."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..data._datasets import as_list
from ..data._reader import Dispatch, OnDevice, OneStep, Stacked
from ._executors import ExecInfo, Executor, ExecutorCache
from ._models import no_parameters_message
from ._named import fused_metrics, named_metrics
from ._program import EVAL_MASKED, STEPS, TRAIN, TRAIN_STEPS, TRAIN_STEPS_GATHERED, Program
from ._state import TrainState, from_plain, to_plain
from ._steps import StepBuilder, StepConfig

if TYPE_CHECKING:
    import optax

    from ..data._device_data import DeviceChunk
    from ._parallel import Strategy
    from ._placed_state import PlacedState


class StepResult(NamedTuple):
    """What `Trainer.run` returns: the metrics of a dispatch's steps.

    Attributes:
      last: the last step's metrics, as `train_step` returns them (on the device).
      stacked: every step's metrics with a leading axis of the steps, or None for a
        dispatch of one step (its `last` are its own).
    """

    last: dict[str, Any]
    stacked: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class Model:
    """What the programs build the state from: the model, its seed and its start.

    Attributes:
      given: the model as the user gave it (for messages).
      adapted: the model as the step bodies call it (`_models.adapt`).
      optimizer: builds the optimizer state.
      seed: seeds the parameters' initialization.
      init_params: the parameters to start from (host arrays), or None for fresh ones.
    """

    given: Any
    adapted: Any
    optimizer: optax.GradientTransformation
    seed: int
    init_params: Any


class Programs:
    """Compiles each `Program` once per batch kind, caches it, and runs it on the state.

    The first program compiled creates the train state (or checks a loaded one against the
    model's variables): only a batch shows the variables' shapes.

    Args:
      model: what the state is built from.
      config: the step bodies' configuration.
      placed: the train state the programs run on.
      cache: the compiled programs.

    Attributes:
      steps: the step bodies, rebuilt by `configure`.
      metric_names: the keys of a train step's metrics, in order (the step bodies'
        `train_keys`).
    """

    def __init__(
        self,
        model: Model,
        config: StepConfig,
        placed: PlacedState,
        cache: ExecutorCache,
    ):
        self._model = model
        self._strategy: Strategy = config.strategy
        self._placed = placed
        self._cache = cache
        self._exec_handlers: list[Callable[[ExecInfo], None]] = []
        # The same host metric objects across configs: they hold the host states. None
        # when there are none: a test of None costs a step less than `HostMetrics.__bool__`.
        self._host_train = config.host_train or None
        self.steps = StepBuilder(model.adapted, config)
        self.metric_names = self.steps.train_keys

    def configure(self, **changes: Any) -> None:
        """Rebuilds the step bodies with `changes` to their config; drops compiled programs."""
        config = dataclasses.replace(self.steps.config, **changes)
        self.steps = StepBuilder(self._model.adapted, config)
        self.metric_names = self.steps.train_keys
        self._cache.clear()

    def add_exec_handler(self, handler: Callable[[ExecInfo], None]) -> None:
        """Calls `handler(info)` whenever a program is compiled."""
        self._exec_handlers.append(handler)

    def executors(self) -> list[Executor]:
        """The cached compiled programs, least recently used first."""
        return self._cache.values()

    # -- running --------------------------------------------------------------------------

    def train_step(self, spec: Any, inputs: Any, labels: Any) -> dict[str, jax.Array]:
        """Runs `TRAIN` on a batch: one optimizer step; its metrics."""
        inputs = as_list(inputs)
        labels = as_list(labels)
        executor = self._cache.executor(TRAIN, spec, inputs, labels, self._compile_train)
        placed = self._placed
        placed.placed, values = executor.run(placed.placed, inputs, labels)
        placed.global_step += 1
        return named_metrics(self.metric_names, values, self._host_train)

    def train_steps(self, spec: Any, inputs: Any, labels: Any) -> StepResult:
        """Runs `TRAIN_STEPS` on stacked batches: one step per batch."""
        inputs = as_list(inputs)
        labels = as_list(labels)
        executor = self._cache.executor(TRAIN_STEPS, spec, inputs, labels, self._compile_train)
        placed = self._placed
        placed.placed, values = executor.run(placed.placed, inputs, labels)
        placed.global_step += int(inputs[0].shape[0])
        stacked, last = fused_metrics(self.metric_names, values, self._host_train)
        return StepResult(last, stacked)

    def train_gathered(self, spec: Any, chunk: DeviceChunk) -> StepResult:
        """Runs `TRAIN_STEPS_GATHERED` on `chunk`'s batches: one step per batch.

        Each step slices its batch from the arrays on the devices (shuffled: from the
        epoch's permuted copy, or gathers its rows through the permutation without one),
        inside the program.
        """
        executor = self._cache.executor_for(
            TRAIN_STEPS_GATHERED,
            spec,
            (chunk.count, chunk.size, chunk.reading, chunk.source.key),
            chunk.shapes,
            functools.partial(self._compile, chunk=chunk),
        )
        placed = self._placed
        placed.placed, values = executor.run(placed.placed, *chunk.arguments())
        placed.global_step += chunk.count
        stacked, last = fused_metrics(self.metric_names, values, self._host_train)
        return StepResult(last, stacked)

    def dispatch(
        self,
        dispatch: Dispatch,
        train_step: Callable[..., dict[str, Any]],
        train_steps: Callable[..., tuple[dict[str, Any], dict[str, Any]]],
    ) -> StepResult:
        """Runs one dispatch of the loop as one compiled call; see `Trainer.run`.

        `OneStep` and `Stacked` go through `train_step` and `train_steps`, the Trainer's
        public methods, so that a subclass or wrapper of them sees every step.

        Raises:
          TypeError: `dispatch` is none of `OneStep`, `Stacked` and `OnDevice`.
        """
        if isinstance(dispatch, OneStep):
            return StepResult(train_step(*dispatch))
        if isinstance(dispatch, Stacked):
            stacked, last = train_steps(dispatch.spec, dispatch.inputs, dispatch.labels)
            return StepResult(last, stacked)
        if isinstance(dispatch, OnDevice):
            return self.train_gathered(dispatch.spec, dispatch.chunk)
        raise TypeError(
            "Trainer.run takes a OneStep, Stacked or OnDevice record, got "
            f"{type(dispatch).__name__}"
        )

    def run(self, program: Program, spec: Any, inputs: list, labels: list, *states: Any) -> Any:
        """Runs `program` (not a train program) on a batch; its outputs.

        `states` are its replicated arguments after the train state (the running eval
        metric states); a program compiled now is compiled with them.
        """
        build = functools.partial(self._compile, states=states) if states else self._compile
        executor = self._cache.executor(program, spec, inputs, labels, build)
        arguments = program.arguments(self._strategy, (inputs, labels), 0)
        return executor.run(self._placed.placed, *states, *arguments)

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
        return executor.run(self._placed.placed, states, *map(strategy.global_batch, pieces))

    # -- compiling ------------------------------------------------------------------------

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
        """Compiles `program` for this (validated) batch of `batch` examples.

        Creates the state first if there is none. With `chunk` the batch is abstract:
        the program takes it from `chunk`'s arrays on the devices.
        """
        strategy, placed = self._strategy, self._placed
        source = (inputs, labels) if chunk is None else chunk
        leading = len(program.axes(self._cache.accumulating))  # axes before the batch axis
        if placed.placed is None or placed.unverified_source is not None:
            model_inputs = program.model_inputs(strategy, source, leading)
            if placed.placed is None:
                self._initialize(spec, model_inputs)
            else:
                self._verify_loaded_state(spec, strategy.global_batch(model_inputs))
        started = time.perf_counter()
        arguments = program.arguments(strategy, source, leading)
        sharded = len(arguments) if program.sharded is None else program.sharded
        run = program.wrap(
            program, strategy, self.steps, spec, placed.rng, source, leading, sharded
        )
        compiled = run.lower(placed.placed, *states, *arguments).compile()
        info = ExecInfo(
            graph_type=program.graph_type,
            spec=spec,
            input_shapes=tuple(tuple(a.shape) for a in inputs),
            input_dtypes=tuple(str(a.dtype) for a in inputs),
            label_shapes=tuple(tuple(a.shape) for a in labels),
            label_dtypes=tuple(str(a.dtype) for a in labels),
            compile_seconds=time.perf_counter() - started,
            **_costs(compiled, program, inputs, program.axes(self._cache.accumulating), strategy),
        )
        for handler in self._exec_handlers:
            handler(info)
        return Executor(info=info, run=compiled)

    # -- the state, created from the first batch ------------------------------------------

    def _initializer(self, spec: Any) -> Callable[..., Any]:
        per_device = self.steps.init_variables
        return self._strategy.initializer(lambda key, xs: per_device(spec, key, xs))

    def _initialize(self, spec: Any, inputs: list[Any]) -> None:
        model = self._model
        init_params = model.init_params

        def given(params: Any) -> Any:
            return from_plain(
                params,
                init_params,
                "init_params",
                hint="pass the parameters of this model, e.g. loopax.load_params(directory) "
                "of a checkpoint of the same model",
            )

        per_device = self.steps.init_variables
        state = self._strategy.create_state(
            lambda key, xs: per_device(spec, key, xs),
            self._build_state,
            jax.random.PRNGKey(model.seed),
            self._strategy.global_batch(inputs),
            None if init_params is None else given,
        )
        self._placed.create(state)

    def _build_state(self, variables: dict, rng: Any, start: Any) -> TrainState:
        """The train state of the model's `variables`, from parameters `start` if given."""
        variables = dict(variables)
        params = variables.pop("params", {})
        if start is not None:
            params = start
        if not jax.tree.leaves(params):
            raise ValueError(no_parameters_message(self._model.given))
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=self._model.optimizer.init(params),
            model_state=variables,
            rng=rng,
            train_metrics=self.steps.fresh_train_metrics(),
            loss_scale=self.steps.fresh_loss_scale(),
        )

    def _verify_loaded_state(self, spec: Any, inputs: list[Any]) -> None:
        """Checks a state loaded before the first batch against the model's variables."""
        where, state = self._placed.take_unverified()
        key = jax.random.PRNGKey(self._model.seed)
        expected = dict(jax.eval_shape(self._initializer(spec), key, inputs))
        expected_params = expected.pop("params", {})
        from_plain(
            {"params": expected_params, "model_state": expected},
            to_plain({"params": state.params, "model_state": state.model_state}),
            where,
        )
        per_device = self.steps.init_variables
        if self._strategy.plan_layout(lambda k, xs: per_device(spec, k, xs), key, inputs):
            self._placed.state = state  # moved into the layout's shardings


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
