"""The `Trainer`: compiles and caches one data-parallel step per spec and input shape."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from . import _steps
from ._batches import signature, spec_key, split_uneven_batch, validate_batch
from ._context import ModelFn
from ._datasets import as_list
from ._evaluation import EvalSteps
from ._executors import ExecInfo, Executor, ExecutorCache
from ._host_metrics import is_host_metric
from ._models import NnxModel, adapt, no_parameters_message
from ._predict import Predict
from ._state import TrainState, from_plain
from ._trainer_state import StateAccess

_METRIC_METHODS = ("init", "update", "merge", "compute")
_RESERVED_TRAIN_NAMES = ("loss", "moving_average_loss")
SKIPPED_STEPS = "skipped_steps"  # a train metric while `skip_non_finite_steps` is on
_RESERVED_EVAL_NAMES = ("mean_loss",)


def _check_metrics(metrics: Sequence[Any], kind: str, reserved: tuple[str, ...]) -> tuple:
    metrics = tuple(metrics)
    names = list(reserved)
    for metric in metrics:
        missing = [m for m in _METRIC_METHODS if not callable(getattr(metric, m, None))]
        missing = [] if is_host_metric(metric) else missing  # a loopax.metrics.HostMetric
        if missing or not isinstance(getattr(metric, "name", None), str):
            raise TypeError(
                f"{kind} metric {metric!r} does not follow the loopax.metrics.Metric protocol "
                f"(missing {missing or ['name']}); subclass loopax.metrics.Metric"
            )
        if metric.name in names:
            raise ValueError(
                f"duplicate {kind} metric name {metric.name!r} (names in use: {names}); "
                "give each metric a unique name"
            )
        names.append(metric.name)
    return metrics


class Trainer(StateAccess, EvalSteps, Predict):
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
      train_metrics: `loopax.metrics.Metric` (or `HostMetric`) objects updated in every train step.
      eval_metrics: `loopax.metrics.Metric` (or `HostMetric`) objects updated in every eval step.
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

    Raises:
      TypeError: the model is none of the above, loss_fn not callable, optimizer not an
        optax transformation, or a metric not following the Metric protocol.
      ValueError: duplicate metric names, unknown `parallel`, empty `devices`; at the first
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
        devices: Sequence[jax.Device] | None = None,
        parallel: str = "shard_map",
        max_executors: int = 20,
        init_params: Any = None,
    ):
        adapted = adapt(model, _steps.AXIS)
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(
                f"loss_fn must be callable or None, got {type(loss_fn).__name__}; "
                "loopax.losses.from_name('mse') builds one from a name"
            )
        if not (
            callable(getattr(optimizer, "init", None))
            and callable(getattr(optimizer, "update", None))
        ):
            raise TypeError(
                f"optimizer must be an optax.GradientTransformation, got {type(optimizer).__name__}; "
                "e.g. optax.adam(1e-3) or loopax.optimizers.from_name('adam')"
            )
        if parallel not in ("shard_map", "pmap"):
            raise ValueError(f"parallel must be 'shard_map' or 'pmap', got {parallel!r}")
        devices = list(jax.devices() if devices is None else devices)
        if not devices:
            raise ValueError("devices is empty; pass None for all devices or a non-empty list")
        if parallel == "pmap" and any(d.process_index != jax.process_index() for d in devices):
            raise ValueError("parallel='pmap' runs on this process's devices only; use 'shard_map'")
        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.train_metrics = _check_metrics(
            train_metrics, "train", (*_RESERVED_TRAIN_NAMES, SKIPPED_STEPS)
        )
        self.eval_metrics = _check_metrics(eval_metrics, "eval", _RESERVED_EVAL_NAMES)
        self.seed = seed
        self.parallel = parallel
        self.devices = devices
        self.mesh = Mesh(np.array(devices), (_steps.AXIS,))
        self.num_devices = len(devices)
        self._local_devices = sum(1 for d in devices if d.process_index == jax.process_index())
        self._multi_process = jax.process_count() > 1
        self._replicated = NamedSharding(self.mesh, P())
        self._batch_sharding = NamedSharding(self.mesh, P(_steps.AXIS))
        self._model = adapted
        self._init_params = None if init_params is None else jax.tree.map(np.asarray, init_params)
        self._per_step_updates: list[Callable[[Any], Any]] = []
        self._steps = _steps.StepBuilder(
            adapted,
            loss_fn,
            optimizer,
            self.train_metrics,
            self.eval_metrics,
            self._per_step_updates,
            self.num_devices,
            parallel,
        )
        self._train_metric_names = (*_RESERVED_TRAIN_NAMES, *(m.name for m in self.train_metrics))
        self._step_metric_names = self._train_metric_names  # what train_step returns now
        self.eval_metric_names = (*_RESERVED_EVAL_NAMES, *(m.name for m in self.eval_metrics))
        self._cache = ExecutorCache(max_executors)
        self._input_counts: dict[Hashable, tuple[int, int]] = {}
        self._exec_handlers: list[Callable[[ExecInfo], None]] = []
        self._state_initializers: list[Callable[[TrainState], TrainState]] = []
        # The train state with `rng=None`: the key lives in `_rng` (see `_adopt`).
        self._state: TrainState | None = None
        self._rng: jax.Array | None = None
        self._eval_states: tuple | None = None
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
        return self._step_metric_names

    def skip_non_finite_steps(self, enabled: bool = True) -> None:
        """Compiles train steps that skip an update whose loss or gradient is not finite.

        A skipped step leaves the parameters, optimizer state, model state and train
        metric states unchanged (the global step still advances), and `train_step` then
        also returns `"skipped_steps"`: the steps skipped since the train metrics were last
        reset. `hooks.nan_guard` turns this on. Compiled steps are dropped.
        """
        enabled = bool(enabled)
        if enabled != self._steps.skip_non_finite:
            self._steps.skip_non_finite = enabled
            self._step_metric_names = (
                (*self._train_metric_names, SKIPPED_STEPS) if enabled else self._train_metric_names
            )
            self._cache.clear()

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
        self._per_step_updates.append(fn)
        self._cache.clear()

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
        if self._state is not None:
            self.state = fn(self.state)

    def executors(self) -> list[Executor]:
        """The cached compiled steps (least recently used first), with their hit counts."""
        return self._cache.values()

    # -- state management -----------------------------------------------------------------

    def _place_state(self, state: Any) -> Any:
        if self.parallel == "pmap":
            # pmap takes host arrays with a leading device axis and keeps its outputs there.
            n = self.num_devices
            return jax.tree.map(
                lambda leaf: np.broadcast_to(np.asarray(leaf), (n, *np.shape(leaf))), state
            )
        return jax.device_put(state, self._replicated)

    def reset_train_metrics(self) -> None:
        """Resets every train metric, the loss's moving average included."""
        self._steps.host_train.reset()  # host metrics' states
        if self._state is None:
            return
        fresh = self._steps.fresh_train_metrics()
        placed = self._place_state(fresh)
        self._state = self._state.replace(train_metrics=placed)

    def _make_initializer(self, spec: Any) -> Callable[..., Any]:
        per_device = self._steps.init_variables
        return _steps.make_initializer(lambda key, xs: per_device(spec, key, xs), self.mesh)

    def _initialize(self, spec: Any, inputs: list[Any]) -> None:
        rng = jax.random.PRNGKey(self.seed)
        if self._multi_process:
            inputs = self._to_global(inputs)
        variables = self._make_initializer(spec)(rng, inputs)
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
        )
        for initializer_fn in self._state_initializers:
            state = initializer_fn(state)
        self._adopt(state)

    # -- compilation ----------------------------------------------------------------------

    def _to_global(self, arrays: list[Any]) -> list[Any]:
        """Multi-process: global arrays assembled from each process's local share."""
        return [
            jax.make_array_from_process_local_data(self._batch_sharding, np.asarray(a))
            for a in arrays
        ]

    def _compile(self, graph: str, key: Hashable, spec: Any, inputs, labels) -> Executor:
        batch = validate_batch(
            graph, spec, key[1], inputs, labels, self._input_counts, self._local_devices
        )
        # Only an eval batch gets here undivided; its step takes it in pieces that divide.
        pieces = (
            split_uneven_batch(inputs, labels, self._local_devices)
            if batch % self._local_devices
            else None
        )
        model_inputs = inputs if pieces is None else pieces[0]
        if self._state is None:
            self._initialize(spec, model_inputs)
        elif self._unverified_source is not None:
            self._verify_loaded_state(
                spec, self._to_global(model_inputs) if self._multi_process else model_inputs
            )
        started = time.perf_counter()
        global_inputs, global_labels = inputs, labels
        if self._multi_process and pieces is None:
            global_inputs, global_labels = self._to_global(inputs), self._to_global(labels)
        if graph == "train":
            body = functools.partial(self._steps.train, spec, self._rng)
            step = _steps.make_parallel(body, self.mesh, self.parallel, 1, 2, donate=(0,))
            compiled = step.lower(self._state, global_inputs, global_labels).compile()
        elif graph == "predict":
            body = functools.partial(self._steps.predict, spec, self._rng)
            step = _steps.make_parallel(
                body, self.mesh, self.parallel, 1, 1, donate=(), per_example_output=True
            )
            compiled = step.lower(self._state, global_inputs).compile()
        elif pieces is None:
            body = functools.partial(self._steps.eval, spec, self._rng)
            step = _steps.make_parallel(body, self.mesh, self.parallel, 2, 2, donate=(1,))
            compiled = step.lower(
                self._state, self._fresh_eval_states(), global_inputs, global_labels
            ).compile()
        else:
            body = functools.partial(self._steps.eval_uneven, spec, self._rng)
            step = _steps.make_parallel(body, self.mesh, self.parallel, 2, len(pieces), donate=(1,))
            compiled = step.lower(
                self._state, self._fresh_eval_states(), *self._globalize(pieces)
            ).compile()
        info = ExecInfo(
            graph_type=graph,
            spec=spec,
            input_shapes=tuple(tuple(a.shape) for a in inputs),
            input_dtypes=tuple(str(a.dtype) for a in inputs),
            label_shapes=tuple(tuple(a.shape) for a in labels),
            label_dtypes=tuple(str(a.dtype) for a in labels),
            compile_seconds=time.perf_counter() - started,
        )
        executor = Executor(info=info, run=compiled)
        self._cache.put(key, executor)
        for handler in self._exec_handlers:
            handler(info)
        return executor

    def _executor(self, graph: str, spec: Any, inputs: list, labels: list) -> Executor:
        # The fast path: JAX arrays carry their abstract value (shape, dtype, weak type,
        # sharding), cheap to read and hash. Keying on shapes and dtypes costs ~3 µs a
        # step, 2-3% of a small model's step.
        try:
            fast_key = (
                graph,
                spec,
                len(inputs),
                *[a.aval for a in inputs],
                *[a.aval for a in labels],
            )
            executor = self._cache.get_fast(fast_key)
        except (AttributeError, TypeError):  # numpy batches, or an unhashable spec
            fast_key = executor = None
        if executor is not None:
            return executor
        key_spec = spec_key(spec)
        key = (
            graph,
            key_spec,
            signature(inputs, "inputs", spec),
            signature(labels, "labels", spec),
        )
        executor = self._cache.get(key)
        if executor is None:
            executor = self._compile(graph, key, spec, inputs, labels)
        if fast_key is not None:
            self._cache.remember(fast_key, executor)
        return executor

    # -- steps ----------------------------------------------------------------------------

    def train_step(self, spec: Any, inputs: Any, labels: Any) -> dict[str, jax.Array]:
        """Runs one optimizer step on a global batch; returns the train metrics.

        The values stay on the device: reading one (e.g. `float(m["loss"])`) waits for
        the step.

        Returns:
          `{"loss": ..., "moving_average_loss": ..., <train metric name>: ...}`.

        Raises:
          TypeError: an input or label is not an array.
          ValueError: no inputs, mismatched batch sizes, a batch not divisible by the
            device count, or the spec used before with another number of inputs/labels.
        """
        inputs = as_list(inputs)
        labels = as_list(labels)
        executor = self._executor("train", spec, inputs, labels)
        if self._multi_process:
            inputs, labels = self._to_global(inputs), self._to_global(labels)
        self._state, values = executor.run(self._state, inputs, labels)
        self._global_step += 1
        if self._steps.host_train:  # host metrics: their step values wait, unread
            return self._steps.host_train.results(self._step_metric_names, values)
        return dict(zip(self._step_metric_names, values))

    def nnx_module(self) -> Any:
        """The `flax.nnx.Module` this trainer trains, updated in place with the current
        parameters and model state, ready to call (`module.eval()` for inference).

        Raises:
          TypeError: the trainer's model is not an NNX module.
        """
        if not isinstance(self._model, NnxModel):
            raise TypeError(
                f"nnx_module() is for a Trainer of a flax.nnx.Module; this one trains a "
                f"{type(self.model).__name__} (its parameters are trainer.params)"
            )
        state = self.state
        if state is None:
            return self._model.module
        params, model_state = jax.device_get((state.params, state.model_state))
        return self._model.update_module(params, model_state)

    def __repr__(self) -> str:
        return (
            f"Trainer(global_step={self._global_step}, devices={self.num_devices}, "
            f"parallel={self.parallel!r}, executors={len(self._cache.values())})"
        )
