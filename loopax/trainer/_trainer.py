"""The `Trainer`: compiles and caches one data-parallel step per spec and input shape."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..data._datasets import as_list
from ..data._device_data import DeviceChunk
from ..data._reader import Dispatch, OnDevice, OneStep, Stacked
from ._batches import split_uneven_batch
from ._context import ModelFn
from ._evaluation import EvalSteps
from ._executors import ExecInfo, Executor, ExecutorCache
from ._gather import gathering, gathering_steps
from ._host_metrics import split_host_metrics
from ._models import adapt, no_parameters_message
from ._parallel import AXIS, Device, choose
from ._precision import check_compute_dtype, check_loss_scale, dtype_name
from ._predict import Predict
from ._state import TrainState, from_plain
from ._steps import StepBuilder, StepConfig
from ._trainer_args import (
    RESERVED_EVAL_NAMES,
    RESERVED_TRAIN_NAMES,
    check_accumulate_steps,
    check_callables,
    check_metrics,
)
from ._trainer_fused import FusedSteps
from ._trainer_state import StateAccess


class StepResult(NamedTuple):
    """What `Trainer.run` returns: the metrics of a dispatch's steps.

    Attributes:
      last: the last step's metrics, as `train_step` returns them (on the device).
      stacked: every step's metrics with a leading axis of the steps, or None for a
        dispatch of one step (its `last` are its own).
    """

    last: dict[str, Any]
    stacked: dict[str, Any] | None


class Trainer(StateAccess, FusedSteps, EvalSteps, Predict):
    """Trains a model with an optax optimizer, one compiled step per batch kind.

    The model is one of:
    - a model function `model_fn(ctx, spec, inputs) -> predictions` (an array or a list),
      running inside a Flax Linen scope so `nn.Dense(10)(x)` works in it;
    - a `flax.linen.Module` instance, called as `module(*inputs)`, with `train=`,
      `training=` or `deterministic=` set for train and eval steps when it takes one;
    - a `flax.nnx.Module` instance, called as `module(*inputs)`: its `nnx.Param`s are
      trained, its other variables (`BatchStat`, ...) are model state averaged across
      devices, its `nnx.Rngs` streams are derived per step and device from `seed`, and it
      runs in `train()`/`eval()` mode in train/eval steps; `nnx_module()` gives it back
      holding the trained values.

    Args:
      model: the model function or module.
      loss_fn: `loss_fn(labels, predictions) -> loss` (non-scalars are mean-reduced),
        or None when the model adds its losses with `ctx.add_loss`.
      optimizer: an `optax.GradientTransformation`.
      train_metrics: `loopax.metrics.Metric` (or `HostMetric`) objects updated in every
        train step.
      eval_metrics: `loopax.metrics.Metric` (or `HostMetric`) objects updated in every eval
        step.
      seed: seeds parameter initialization and the per-step RNG.
      init_params: start from these parameters (nested dicts of arrays, e.g.
        `loopax.load_params(directory)`) instead of fresh ones; they must have the model's
        structure and shapes. To keep some fixed, mask the optimizer
        (`optax.multi_transform`).
      devices: the devices to split each batch over; default all of `jax.devices()`.
      parallel: `"shard_map"` (default: `jax.jit` of `jax.shard_map` over a 1-D mesh) or
        `"pmap"` (literal `jax.pmap` over local devices).
      max_executors: how many compiled steps to keep; the least recently used is evicted
        past it, with a warning.
      accumulate_steps: micro-batches per optimizer step (gradient accumulation). With K >
        1, `train_step` takes each input and label with a leading axis of k <= K
        micro-batches, shape `(k, batch, ...)` (the Loop stacks K consecutive batches of
        its dataset), and runs them in one compiled `lax.scan`: the activations of one
        micro-batch at a time, the gradient the mean of the micro-batches' (as one batch
        k times larger), one optimizer update, one global step. The returned loss is the
        mean over the micro-batches; train metrics are updated with every micro-batch.
      compute_dtype: `jnp.bfloat16` or `jnp.float16`: the model computes in it (floating
        parameters and inputs are cast at each step) while parameters and optimizer state
        stay float32; predictions are cast to float32 before the loss and metrics. None
        (default) computes in the parameters' dtype.
      loss_scale: with a reduced `compute_dtype`, `"dynamic"` scales the loss before
        differentiation (starting at 2**15): a step whose gradients overflow is skipped
        and the scale halved; it doubles after 2000 finite steps in a row. The scale is in
        the train state (checkpointed) and the train metrics report `"loss_scale"` and
        `"skipped_steps"`. A positive number is a static scale. None: no scaling.

    Raises:
      TypeError: the model is none of the above, loss_fn not callable, optimizer not an
        optax transformation, or a metric not following the Metric protocol.
      ValueError: duplicate metric names, unknown `parallel`, empty `devices`, a bad
        `accumulate_steps`, `compute_dtype` or `loss_scale`; at the first
        step, a model with no trainable parameters, or `init_params` not fitting the model
        (naming the first differing entry and both shapes).

    Example:
      >>> import numpy as np, optax, flax.linen as nn
      >>> def model_fn(ctx, spec, inputs):
      ...     return nn.Dense(1)(inputs[0])
      >>> def loss_fn(labels, predictions):
      ...     return (labels[0] - predictions[0]) ** 2
      >>> trainer = Trainer(model_fn, loss_fn, optax.sgd(0.1), devices=jax.devices()[:1])
      >>> x = np.ones((4, 3), np.float32)
      >>> metrics = trainer.train_step(None, [x], [x[:, :1]])
      >>> list(metrics), trainer.global_step
      (['loss', 'moving_average_loss'], 1)
    """

    def __init__(
        self,
        model: ModelFn | Any,
        loss_fn: Callable[[list[jax.Array], list[jax.Array]], jax.Array] | None,
        optimizer: optax.GradientTransformation,
        *,
        train_metrics: Sequence[Any] = (),
        eval_metrics: Sequence[Any] = (),
        seed: int = 0,
        devices: Sequence[Device] | None = None,
        parallel: str = "shard_map",
        max_executors: int = 20,
        init_params: Any = None,
        accumulate_steps: int = 1,
        compute_dtype: Any = None,
        loss_scale: float | str | None = None,
    ):
        adapted = adapt(model, AXIS)
        check_callables(loss_fn, optimizer)
        self.accumulate_steps = check_accumulate_steps(accumulate_steps)
        dtype = check_compute_dtype(compute_dtype)
        self.compute_dtype = dtype_name(dtype)
        self.loss_scale = check_loss_scale(loss_scale, dtype)
        self._strategy = choose(parallel, devices)
        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.train_metrics = check_metrics(train_metrics, "train", RESERVED_TRAIN_NAMES)
        self.eval_metrics = check_metrics(eval_metrics, "eval", RESERVED_EVAL_NAMES)
        self.seed = seed
        self._model = adapted
        self._init_params = None if init_params is None else jax.tree.map(np.asarray, init_params)
        # Host metrics (loopax.metrics.HostMetric) only return step values; see _host_metrics.
        num_devices = self._strategy.num_devices
        compiled_train, host_train = split_host_metrics(self.train_metrics, AXIS, num_devices)
        compiled_eval, host_eval = split_host_metrics(self.eval_metrics, AXIS, num_devices)
        config = StepConfig(
            loss_fn=loss_fn,
            optimizer=optimizer,
            train_metrics=compiled_train,
            eval_metrics=compiled_eval,
            strategy=self._strategy,
            host_train=host_train,
            host_eval=host_eval,
            train_order=tuple(m.name for m in self.train_metrics),
            eval_order=tuple(m.name for m in self.eval_metrics),
            accumulate=self.accumulate_steps > 1,
            compute_dtype=dtype,
            loss_scale=self.loss_scale,
        )
        self._steps = StepBuilder(adapted, config)
        self.eval_metric_names = self._steps.eval_keys
        micro: tuple[str, ...] = ("micro-batches",) if config.accumulate else ()
        self._leading_axes = {
            "train": micro,
            "train_steps": ("steps", *micro),
            "train_steps_gathered": ("steps",),
        }
        self._cache = ExecutorCache(
            max_executors,
            self._strategy.local_devices,
            self._leading_axes,
            {"micro-batches": self.accumulate_steps},
        )
        self._exec_handlers: list[Callable[[ExecInfo], None]] = []
        self._state_initializers: list[Callable[[TrainState], TrainState]] = []
        # The train state with `rng=None`: the key lives in `_rng` (see `_adopt`).
        self._state: TrainState | None = None
        self._rng: jax.Array | None = None
        self._eval_states: dict | None = None
        self._global_step = 0
        # Where a state loaded before the first batch came from; the model's variables
        # are checked against it when the first batch shows their shapes.
        self._unverified_source: str | None = None
        self._learning_rate_leaf: int | None = None
        self._constant_learning_rate: float | None = None

    # -- public attributes ----------------------------------------------------------------

    @property
    def global_step(self) -> int:
        """Optimizer steps taken (a Python int; reading it never syncs with the device)."""
        return self._global_step

    @property
    def params(self) -> Any:
        """The trainable parameters, or None before the first step."""
        state = self.state
        return None if state is None else state.params

    @property
    def train_metric_names(self) -> tuple[str, ...]:
        """The keys of `train_step`'s metrics, in order."""
        return self._steps.train_keys

    @property
    def train_metric_state_names(self) -> tuple[str, ...]:
        """The keys of `state.train_metrics`, in the order the metrics were given.

        `"moving_average_loss"`, then the compiled train metrics' names (a host metric
        keeps its state on the host). Checkpoints of format version 1 kept the states in
        this order, without the names.
        """
        return self._steps.train_state_keys

    @property
    def parallel(self) -> str:
        """The parallel strategy's name: `"shard_map"` or `"pmap"`."""
        return self._strategy.name

    @property
    def devices(self) -> list[Device]:
        """The devices each batch is split over."""
        return self._strategy.devices

    @property
    def num_devices(self) -> int:
        """How many devices each batch is split over (all processes')."""
        return self._strategy.num_devices

    @property
    def mesh(self) -> Any:
        """The 1-D `jax.sharding.Mesh` over `devices` (axis `"devices"`)."""
        return self._strategy.mesh

    @property
    def skipping_non_finite_steps(self) -> bool:
        """Whether `skip_non_finite_steps` is on."""
        return self._steps.config.skip_non_finite

    def _configure(self, **changes: Any) -> None:
        """Rebuilds the step bodies with `changes` to their config; drops compiled steps."""
        config = dataclasses.replace(self._steps.config, **changes)
        self._steps = StepBuilder(self._model, config)
        self._cache.clear()

    def skip_non_finite_steps(self, enabled: bool = True) -> None:
        """Compiles train steps that skip an update whose loss or gradient is not finite.

        A skipped step leaves the parameters, optimizer state, model state and train
        metric states unchanged (the global step still advances), and `train_step` then
        also returns `"skipped_steps"`: the steps skipped since the train metrics were last
        reset. `hooks.nan_guard` turns this on. Compiled steps are dropped.
        """
        if bool(enabled) != self._steps.config.skip_non_finite:
            self._configure(skip_non_finite=bool(enabled))

    # -- configuration --------------------------------------------------------------------

    def add_per_step_update(self, fn: Callable[[Any], Any]) -> None:
        """Adds `fn(params) -> params`, compiled into the train step after the update.

        Use it for constraints and projections. Compiled steps are dropped so the next
        step compiles with it.

        Raises:
          TypeError: `fn` is not callable.
        """
        if not callable(fn):
            raise TypeError(f"add_per_step_update needs a callable, got {type(fn).__name__}")
        self._configure(per_step_updates=(*self._steps.config.per_step_updates, fn))

    def on_exec_creation(self, handler: Callable[[ExecInfo], None]) -> None:
        """Calls `handler(info)` with an `ExecInfo` whenever a step is compiled."""
        if not callable(handler):
            raise TypeError(f"on_exec_creation needs a callable, got {type(handler).__name__}")
        self._exec_handlers.append(handler)

    def add_state_initializer(self, fn: Callable[[TrainState], TrainState]) -> None:
        """Calls `fn(state) -> state` when the state is created (now, if it exists).

        Checkpoint restoration uses it: the state's structure is known only after the
        first batch shows the input shapes.
        """
        self._state_initializers.append(fn)
        state = self.state  # None exactly when `self._state` is
        if state is not None:
            self.state = fn(state)

    def executors(self) -> list[Executor]:
        """The cached compiled steps (least recently used first), with their hit counts."""
        return self._cache.values()

    # -- state management -----------------------------------------------------------------

    def reset_train_metrics(self) -> None:
        """Resets every train metric, the loss's moving average included."""
        self._steps.config.host_train.reset()  # host metrics' states
        if self._state is None:
            return
        placed = self._strategy.place_state(self._steps.fresh_train_metrics())
        self._state = self._state.replace(train_metrics=placed)

    def _make_initializer(self, spec: Any) -> Callable[..., Any]:
        per_device = self._steps.init_variables
        return self._strategy.initializer(lambda key, xs: per_device(spec, key, xs))

    def _initialize(self, spec: Any, inputs: list[Any]) -> None:
        rng = jax.random.PRNGKey(self.seed)
        variables = self._make_initializer(spec)(rng, self._strategy.global_batch(inputs))
        params = variables.pop("params", {})
        if self._init_params is not None:
            params = from_plain(
                params,
                self._init_params,
                "init_params",
                hint="pass the parameters of this model, e.g. loopax.load_params(directory) "
                "of a checkpoint of the same model",
            )
        if not jax.tree.leaves(params):
            raise ValueError(no_parameters_message(self.model))
        state = TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=self.optimizer.init(params),
            model_state=variables,
            rng=rng,
            train_metrics=self._steps.fresh_train_metrics(),
            loss_scale=self._steps.fresh_loss_scale(),
        )
        for initializer_fn in self._state_initializers:
            state = initializer_fn(state)
        self._adopt(state)

    # -- compilation ----------------------------------------------------------------------

    def _compile(
        self,
        graph: str,
        spec: Any,
        inputs: list,
        labels: list,
        batch: int,
        chunk: DeviceChunk | None = None,
    ) -> Executor:
        """Compiles the `graph` step for this (validated) batch of `batch` examples.

        Creates the state first if there is none. For `"train_steps_gathered"` the batch
        is abstract: the program gathers it from `chunk`'s arrays on the devices.
        """
        strategy, steps = self._strategy, self._steps
        local = strategy.local_devices
        # Only an eval batch gets here undivided; its step takes it in pieces that divide.
        pieces = split_uneven_batch(inputs, labels, local) if batch % local else None
        leading = len(self._leading_axes.get(graph, ()))  # axes in front of the batch axis
        if self._state is None or self._unverified_source is not None:
            if chunk is not None:
                model_inputs = chunk.first_batch()[0]
            else:  # one step's (micro-)batch
                model_inputs = [a[(0,) * leading] for a in (pieces[0] if pieces else inputs)]
            if self._state is None:
                self._initialize(spec, model_inputs)
            else:
                self._verify_loaded_state(spec, strategy.global_batch(model_inputs))
        started = time.perf_counter()
        if graph.startswith("train"):
            body = steps.train if graph == "train" else steps.train_steps
            body = functools.partial(body, spec, self._rng)
            if chunk is None:
                run = strategy.wrap(body, 1, 2, donate=(0,), batch_axis=leading)
                batches = (strategy.global_batch(b, leading) for b in (inputs, labels))
                args = (self._state, *batches)
            else:  # the batches taken from the devices' arrays inside the program
                count, size = chunk.count, chunk.size
                if strategy.slices_in_scan:  # each step slices its own batch in the scan
                    scan = functools.partial(steps.scan_steps, spec, self._rng)
                    body = gathering_steps(scan, count, size, strategy.num_devices)
                    run = strategy.wrap(body, 7, 0, donate=(0,))
                else:  # pmap: the group gathered first, then the stacked steps
                    run = strategy.wrap(body, 1, 2, donate=(0,), batch_axis=leading)
                    run = jax.jit(gathering(run, count, size), donate_argnums=0)
                args = (self._state, *chunk.arguments())
        elif graph == "predict":
            body = functools.partial(steps.predict, spec, self._rng)
            run = strategy.wrap(body, 1, 1, donate=(), per_example_output=True)
            args = (self._state, strategy.global_batch(inputs))
        elif pieces is None:
            body = functools.partial(steps.eval, spec, self._rng)
            run = strategy.wrap(body, 2, 2, donate=(1,))
            batch_arrays = (strategy.global_batch(inputs), strategy.global_batch(labels))
            args = (self._state, self._fresh_eval_states(), *batch_arrays)
        else:
            body = functools.partial(steps.eval_uneven, spec, self._rng)
            run = strategy.wrap(body, 2, len(pieces), donate=(1,))
            args = (self._state, self._fresh_eval_states(), *self._globalize(pieces))
        compiled = run.lower(*args).compile()
        info = ExecInfo(
            graph_type="train_steps" if chunk is not None else graph,
            spec=spec,
            input_shapes=tuple(tuple(a.shape) for a in inputs),
            input_dtypes=tuple(str(a.dtype) for a in inputs),
            label_shapes=tuple(tuple(a.shape) for a in labels),
            label_dtypes=tuple(str(a.dtype) for a in labels),
            compile_seconds=time.perf_counter() - started,
        )
        for handler in self._exec_handlers:
            handler(info)
        return Executor(info=info, run=compiled)

    def _executor(self, graph: str, spec: Any, inputs: list, labels: list) -> Executor:
        return self._cache.executor(graph, spec, inputs, labels, self._compile)

    # -- steps ----------------------------------------------------------------------------

    def _run_train(self, graph: str, spec: Any, inputs: Any, labels: Any) -> Any:
        """Runs the compiled `graph` ("train" or "train_steps") on a batch; its values."""
        inputs = as_list(inputs)
        labels = as_list(labels)
        executor = self._cache.executor(graph, spec, inputs, labels, self._compile)
        strategy = self._strategy
        if strategy.multi_process:
            leading = len(self._leading_axes[graph])
            inputs = strategy.global_batch(inputs, leading)
            labels = strategy.global_batch(labels, leading)
        self._state, values = executor.run(self._state, inputs, labels)
        return values

    def train_step(self, spec: Any, inputs: Any, labels: Any) -> dict[str, jax.Array]:
        """Runs one optimizer step on a global batch; returns the train metrics.

        With `accumulate_steps` > 1, each input and label has a leading axis of
        micro-batches (see the class). The values stay on the device: reading one (e.g.
        `float(m["loss"])`) waits for the step.

        Returns:
          `{"loss": ..., "moving_average_loss": ..., <train metric name>: ...}`, then
          `"skipped_steps"` and `"loss_scale"` when on.

        Raises:
          TypeError: an input or label is not an array.
          ValueError: no inputs, mismatched batch sizes, a batch not divisible by the
            device count, the spec used before with another number of inputs/labels, or
            (accumulating) arrays without a common leading axis of micro-batches.
        """
        values = self._run_train("train", spec, inputs, labels)
        self._global_step += 1
        # In the documented order; host metrics' step values wait, unread.
        return self._steps.config.host_train.results(self._steps.train_keys, values)

    def run(self, dispatch: Dispatch) -> StepResult:
        """Runs one dispatch of the loop as one compiled call.

        `OneStep` runs `train_step`, `Stacked` `train_steps`, and `OnDevice` a program of
        `train_steps` that takes each step's batch from the devices' arrays itself.

        Returns:
          The `StepResult` of the dispatch's `dispatch.count` optimizer steps.

        Raises:
          TypeError: `dispatch` is none of the three records.
          As `train_step` and `train_steps` otherwise.
        """
        if isinstance(dispatch, OneStep):
            return StepResult(
                self.train_step(dispatch.spec, dispatch.inputs, dispatch.labels), None
            )
        if isinstance(dispatch, Stacked):
            stacked, last = self.train_steps(dispatch.spec, dispatch.inputs, dispatch.labels)
            return StepResult(last, stacked)
        if isinstance(dispatch, OnDevice):
            stacked, last = self._train_gathered(dispatch.spec, dispatch.chunk)
            return StepResult(last, stacked)
        raise TypeError(
            "Trainer.run takes a OneStep, Stacked or OnDevice record, got "
            f"{type(dispatch).__name__}"
        )

    def __repr__(self) -> str:
        return (
            f"Trainer(global_step={self._global_step}, devices={self.num_devices}, "
            f"parallel={self.parallel!r}, executors={len(self._cache.values())})"
        )
