"""The `Trainer`: compiles and caches one data-parallel step per spec and input shape."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import jax
import numpy as np
import optax

from .._validate import positive_int
from ..data import Dataset
from ..data._internal import Dispatch, OneStep, Stacked, as_list
from ._compiler_options import OptionValue, check_compiler_options
from ._context import ModelFn
from ._creation import StateRecipe
from ._evaluation import Evaluator
from ._executors import ExecInfo, Executor, ExecutorCache
from ._host_metrics import HostMetrics
from ._layout import sharding_report
from ._mesh import choose_strategy
from ._models import adapt
from ._named import StepResult
from ._parallel import Device
from ._placed_state import PlacedState
from ._precision import check_compute_dtype, check_loss_scale, dtype_name
from ._predict import Predictor
from ._programs import Programs
from ._state import TrainState
from ._summary import parameter_summary
from ._trainer_args import (
    check_callables,
    check_ema_decay,
    check_mesh_context,
    checked,
    step_config,
)


class Trainer:
    """Trains a model with an optax optimizer, one compiled step per batch kind.

    The model is a function `model_fn(ctx, spec, inputs) -> predictions` run in a Flax Linen
    scope (`nn.Dense(10)(x)` works in it), a `flax.linen.Module` or a `flax.nnx.Module`
    instance, called as `module(*inputs)` (the models guide).

    Args:
      model: the model function or module.
      loss_fn: `loss_fn(labels, predictions) -> loss` (mean-reduced) or `(loss, {name:
        aux value})` (train metrics), or None when the model adds its losses (`ctx.add_loss`).
      optimizer: an `optax.GradientTransformation`.
      train_metrics: `loopax.metrics.Metric` (or `HostMetric`) objects for train steps.
      eval_metrics: `loopax.metrics.Metric` (or `HostMetric`) objects for eval steps.
      seed: seeds parameter initialization and the per-step RNG.
      init_params: start from these parameters (nested dicts of arrays, e.g.
        `loopax.load_params(directory)`) or variables (`loopax.load_variables(directory)`)
        instead of fresh ones; they must have the model's structure and shapes.
      devices: the devices to split each batch over; default all of `jax.devices()`.
      parallel: `"shard_map"` (default: `jax.jit` of `jax.shard_map` over a 1-D mesh) or
        `"pmap"` (literal `jax.pmap` over local devices).
      mesh: None (1-D data parallel), a dict of axis sizes such as `{"data": 2, "model":
        2}` (one may be -1), or a `jax.sharding.Mesh` with Auto axes. With `mesh`, `rules`
        or `fsdp` a step is one `jax.jit` over the global batch and `ctx.axis_name` is None
        (the scale guide).
      rules: `(logical_name, mesh_axis or None)` pairs for annotated variables
        (`nn.with_logical_partitioning`, `nnx.with_partitioning`, `ctx.variable(axes=)`).
      fsdp: shard each parameter of rank >= 2 that no annotation shards over `"data"`.
      max_executors: how many compiled steps to keep (the least recently used is evicted).
      accumulate_steps: micro-batches per optimizer step (gradient accumulation in one
        `lax.scan`: the precision guide); with K > 1 `train_step` takes arrays with a leading
        axis of k <= K micro-batches.
      compute_dtype: `jnp.bfloat16` or `jnp.float16`, the dtype the model computes in;
        parameters and optimizer state stay float32. None (default): the parameters' dtype.
      loss_scale: with a reduced `compute_dtype`, `"dynamic"` (skip steps whose gradients
        overflow and adapt the scale), a positive static scale, or None (no scaling).
      ema_decay: keep an exponential moving average of the parameters (e.g. 0.999), which
        `ema_params` reads, checkpoints keep and evaluation and prediction use (the evaluation
        guide). None: none.
      log_grad_norm: add train metrics `"grad_norm"` and `"update_norm"` (global L2 norms).
      compiler_options: XLA options every program of this trainer compiles with (train
        steps, fused groups, evaluation, prediction, the state's creation): XLA's
        `DebugOptions` fields by name, the flags `XLA_FLAGS` takes without the leading `--`,
        each a bool, int, float or str, as `jax.stages.Lowered.compile(compiler_options=)`
        takes them. E.g. `{"xla_gpu_autotune_level": 1}` (a small model compiles faster on a
        GPU) or `{"xla_dump_to": directory}` (XLA writes each program there). They are part
        of the persistent compilation cache's key (the dump options excepted). None: none.

    Raises:
      TypeError: the model is none of the above (e.g. `model(inputs)`), loss_fn not callable,
        optimizer not an optax transformation, a metric not following the Metric protocol, or
        `compiler_options` not a mapping of str to bool, int, float or str.
      ValueError: duplicate metric names, an argument out of range (naming it), a mesh context
        other than its mesh; at the first step: no trainable parameters, `init_params` not
        fitting the model (naming the first differing entry and both shapes), an unmatched rule,
        a compiler option XLA does not know or a value of the wrong type (naming it).

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
        mesh: Any = None,
        rules: Sequence[tuple[str, str | None]] | None = None,
        fsdp: bool = False,
        ema_decay: float | None = None,
        log_grad_norm: bool = False,
        compiler_options: Mapping[str, OptionValue] | None = None,
    ):
        strategy = self._strategy = choose_strategy(parallel, devices, mesh, rules, fsdp)
        check_mesh_context(strategy.mesh)
        adapted = self._adapted = adapt(model, strategy.axis_name, strategy.annotates)
        check_callables(loss_fn, optimizer)
        self._compiler_options = check_compiler_options(compiler_options)
        self.accumulate_steps = positive_int("accumulate_steps", accumulate_steps)
        dtype = check_compute_dtype(compute_dtype)
        self.compute_dtype = dtype_name(dtype)
        self.loss_scale = check_loss_scale(loss_scale, dtype)
        self.ema_decay = check_ema_decay(ema_decay)
        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.train_metrics, self.eval_metrics = checked(train_metrics, eval_metrics, log_grad_norm)
        self.seed = seed
        config = step_config(loss_fn, optimizer, self.train_metrics, self.eval_metrics,
                             strategy, self.accumulate_steps, dtype, self.loss_scale,
                             self.ema_decay, log_grad_norm,
                             tuple(self._compiler_options.items()))  # fmt: skip
        cache = ExecutorCache(max_executors, strategy.local_devices, self.accumulate_steps)
        self._placed = PlacedState(strategy, optimizer, on_new_key=cache.clear)
        start = None if init_params is None else jax.tree.map(np.asarray, init_params)
        recipe = StateRecipe(model, adapted, optimizer, seed, start)
        self._programs = Programs(recipe, config, self._placed, cache)
        names = self.eval_metric_names = self._programs.steps.eval_keys
        self._evaluator = Evaluator(self._programs, strategy, names, config.host_eval)
        self._predictor = Predictor(self._programs, self._placed, strategy)

    @property
    def compiler_options(self) -> Mapping[str, OptionValue]:
        """The XLA options every program of this trainer compiles with (read-only; see `Trainer`).

        Example:
          >>> import optax, flax.linen as nn
          >>> trainer = Trainer(lambda ctx, spec, x: nn.Dense(1)(x[0]), None, optax.sgd(0.1),
          ...     devices=jax.devices()[:1], compiler_options={"xla_gpu_autotune_level": 1})
          >>> dict(trainer.compiler_options)
          {'xla_gpu_autotune_level': 1}
        """
        return self._compiler_options

    @property
    def global_step(self) -> int:
        """Optimizer steps taken (a Python int; reading it never syncs with the device)."""
        return self._placed.global_step

    @property
    def params(self) -> Any:
        """The trainable parameters, or None before the first step."""
        return getattr(self.state, "params", None)

    @property
    def ema_params(self) -> Any:
        """The parameters' moving average (`ema_decay`); None without one or before a state."""
        return getattr(self.state, "ema_params", None)

    @property
    def train_metric_names(self) -> tuple[str, ...]:
        """The keys of `train_step`'s metrics, in order (a loss's aux outputs' once compiled)."""
        return self._programs.metric_names

    @property
    def loss_aux_names(self) -> tuple[str, ...] | None:
        """The names of the loss function's auxiliary outputs (`(loss, {name: value})`), in order.

        Each is the train metric `name` (`"train/<name>"` in logs). A trace of the loss function
        shows them: None until the first train step is compiled (`train_metric_names` lacks them
        until then); () when it returns none, and at once for a `loss_fn` of `loopax.losses` or
        a trainer without one (neither returns any).

        Example:
          >>> import jax.numpy as jnp, numpy as np, optax, flax.linen as nn
          >>> def loss_fn(labels, predictions):
          ...     error = jnp.mean((labels[0] - predictions[0]) ** 2)
          ...     return error, {"rmse": jnp.sqrt(error)}
          >>> trainer = Trainer(lambda ctx, spec, x: nn.Dense(1)(x[0]), loss_fn, optax.sgd(0.1),
          ...     devices=jax.devices()[:1])
          >>> print(trainer.loss_aux_names)
          None
          >>> x = np.ones((4, 3), np.float32)
          >>> _ = trainer.train_step(None, [x], [x[:, :1]])
          >>> trainer.loss_aux_names, trainer.train_metric_names
          (('rmse',), ('loss', 'moving_average_loss', 'rmse'))
        """
        return self._programs.aux_names

    @property
    def train_metric_state_names(self) -> tuple[str, ...]:
        """The keys of `state.train_metrics`: the loss average's, then the compiled metrics'.

        Checkpoints of format version 1 kept the states in this order, without names.
        """
        return self._programs.steps.train_state_keys

    @property
    def parallel(self) -> str:
        """The parallel strategy's name: `"shard_map"`, `"pmap"`, or `"mesh"` (see `mesh`)."""
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
        """The `jax.sharding.Mesh`: by default 1-D over `devices` (axis `"devices"`)."""
        return self._strategy.mesh

    @property
    def skipping_non_finite_steps(self) -> bool:
        """Whether `skip_non_finite_steps` is on."""
        return self._programs.steps.config.skip_non_finite

    def skip_non_finite_steps(self, enabled: bool = True) -> None:
        """Compiles train steps that skip an update whose loss or gradient is not finite.

        A skipped step changes no parameter, optimizer, model, EMA or metric state (the
        global step still advances); `train_step` then also returns `"skipped_steps"` (since
        the train metrics' last reset). `hooks.nan_guard` turns it on; compiled steps drop.
        """
        self._programs.skip_non_finite(bool(enabled))

    def add_per_step_update(self, fn: Callable[[Any], Any]) -> None:
        """Adds `fn(params) -> params`, compiled into the train step after the update.

        For constraints and projections; compiled steps are dropped.

        Raises:
          TypeError: `fn` is not callable.
        """
        self._programs.add_per_step_update(fn)

    def on_exec_creation(self, handler: Callable[[ExecInfo], None]) -> None:
        """Calls `handler(info)` with an `ExecInfo` per compiled step, when it is first used."""
        self._programs.add_exec_handler(handler)

    def add_state_initializer(self, fn: Callable[[TrainState], TrainState]) -> None:
        """Calls `fn(state) -> state` when the state is created (now, if it exists)."""
        self._placed.add_initializer(fn)

    def executors(self) -> list[Executor]:
        """The cached compiled steps (least recently used first), with their hit counts."""
        return self._programs.executors()

    # -- state ----------------------------------------------------------------------------

    @property
    def state(self) -> TrainState | None:
        """The whole train state without a device axis, or None before the first step."""
        return self._placed.state

    @state.setter
    def state(self, state: TrainState) -> None:
        self._placed.state = state

    def state_dict(self) -> dict | None:
        """The train state as nested dicts of host arrays keyed by field names, or None.

        `params` and `model_state` as the model names them, `opt_state` with optax's field
        names, `step`, `rng`, `train_metrics`. State sharded across processes raises
        ValueError (`hooks.checkpoint` saves every process's shards).
        """
        return self._placed.state_dict()

    def state_shardings(self) -> dict | None:
        """Every state leaf's `NamedSharding`, nested as `state_dict()` (None without state)."""
        return self._placed.state_shardings()

    def check_replicas(self) -> int:
        """Counts the arrays copied on devices; raises `ReplicaMismatchError` if copies differ."""
        return self._placed.check_replicas()

    def sharding_report(self) -> str:
        """A text table of the state: path, shape, partition spec, bytes per device, totals."""
        return "no train state yet" if self.state is None else sharding_report(self.state)

    def summary(self) -> str:
        """Every parameter's path, shape, dtype, count and bytes, then totals (Keras's summary).

        On a mesh also each one's partition spec and bytes per device.
        """
        state = self.state
        if state is None:
            return "no parameters yet"
        return parameter_summary(state.params, state.model_state)

    def load_state_dict(self, tree: dict, *, where: str = "the given state") -> None:
        """Replaces the train state with `tree`, as `state_dict` returns it.

        Works before the first batch too: the state is built from `tree` at once, and the
        model's variables are checked against it when the first batch shows their shapes.

        Args:
          tree: nested dicts of arrays, as `state_dict()` returns.
          where: what `tree` is, for error messages (e.g. the checkpoint's path).

        Raises:
          ValueError: `tree` does not fit the model's state (naming the first differing
            entry and both shapes).
        """
        self._placed.load_state_dict(tree, where, self._programs.steps)

    @property
    def host_metric_states(self) -> HostMetrics:
        """The train host metrics' states, which checkpoints keep (`loop.add_state`).

        `get_state()`: JSON by metric name, every step so far folded in (a wait for the
        steps in flight); `set_state(saved)`: the states to go on from (a metric missing
        from `saved` starts afresh). See `loopax.metrics.HostMetric.host_state_dict`.
        """
        return self._programs.steps.config.host_train

    def reset_train_metrics(self) -> None:
        """Resets every train metric, the loss's moving average included."""
        self._programs.reset_train_metrics()

    @property
    def learning_rate(self) -> float | None:
        """The live learning rate, or None before the first step or without one to read.

        To have one, build the optimizer with `loopax.optimizers` or `optax.inject_hyperparams`.
        """
        rate = self._placed.learning_rate_array()
        return None if rate is None else float(np.asarray(jax.device_get(rate)))

    def learning_rate_array(self) -> Any:
        """The live learning rate, without waiting for the device; None as `learning_rate`.

        The host value when no schedule drives it, else a device copy (the state's own
        buffers are reused by the next step).
        """
        return self._placed.learning_rate_array()

    def set_learning_rate(self, value: float) -> None:
        """Sets the optimizer's learning rate for the next steps, without recompiling.

        Raises:
          TypeError: `value` is a schedule (build the optimizer with it instead).
          RuntimeError: before the first step (the optimizer state does not exist yet).
          ValueError: the optimizer has no injectable learning rate, or a schedule drives
            it (see `loopax.optimizers.set_learning_rate`).
        """
        self._placed.set_learning_rate(value)

    def nnx_module(self) -> Any:
        """The `flax.nnx.Module` this trainer trains, holding the trained values.

        Ready to call (`module.eval()` for inference).

        Raises:
          TypeError: the trainer's model is not an NNX module.
        """
        return self._placed.nnx_module(self._adapted, self.model)

    # -- steps ----------------------------------------------------------------------------

    def train_step(self, spec: Any, inputs: Any, labels: Any) -> dict[str, jax.Array]:
        """Runs one optimizer step on a global batch; returns the train metrics.

        With `accumulate_steps` > 1, each input and label has a leading axis of
        micro-batches. The values stay on the device: reading one waits for the step.

        Returns:
          `{"loss": ..., "moving_average_loss": ..., <train metric name>: ...}`, then those
          turned on (`"skipped_steps"`, `"loss_scale"`, `"grad_norm"`, ...), a loss's aux.

        Raises:
          TypeError: an input or label is not an array.
          ValueError: no inputs, mismatched batch sizes, a batch not divisible by the
            device count, the spec used before with another number of inputs/labels, or
            (accumulating) arrays without a common leading axis of micro-batches.
        """
        return self.run(OneStep(spec, inputs, labels)).last

    def train_steps(
        self, spec: Any, inputs: Any, labels: Any
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Runs n optimizer steps in one compiled program (`lax.scan`); n is the inputs' first axis.

        Each input and label is n batches stacked, shape `(n, batch, ...)` (with
        `accumulate_steps` > 1, `(n, micro-batches, batch, ...)`); the result equals n calls
        of `train_step`. The Loop's fused groups (`steps_per_execution=K`) go through `run`,
        which also runs on-device batches where they lie. Compiled once per n, spec and shape.

        Returns:
          `(stacked, last)`: every train metric with a leading axis of the n steps, and the
          last step's metrics as `train_step` returns them (`run`'s `StepResult`, in this
          method's documented order). A host metric's entry is the same in both: its value
          after the n steps.

        Raises:
          ValueError: arrays without a common leading steps axis; otherwise as `train_step`.
        """
        inputs, labels = as_list(inputs), as_list(labels)
        result = self.run(Stacked(_leading_length(inputs), spec, inputs, labels))
        return cast("dict[str, Any]", result.stacked), result.last  # n steps: never None

    def compile_ahead(self, dispatch: Dispatch, counts: Iterable[int]) -> None:
        """Compiles `dispatch`'s programs for groups of `counts` steps, in the background.

        The Loop asks, from its second group on, for the group sizes of its next steps, so
        no group after the first compiles on the training thread; `on_exec_creation`
        reports each when it is first used.
        """
        self._programs.compile_ahead(dispatch, counts)

    def gathers_on(self, devices: list[Device]) -> bool:
        """Whether fused steps can take batches from arrays on `devices` (this process's own)."""
        strategy = self._strategy
        return not strategy.multi_process and list(devices) == list(strategy.devices)

    def run(self, dispatch: Dispatch) -> StepResult:
        """Runs one dispatch of the loop as one compiled call: every train step's one entry.

        `OneStep` runs one optimizer step, `Stacked` fused steps on stacked batches, and
        `OnDevice` fused steps that take each step's batch from the devices' arrays
        themselves. `train_step` and `train_steps` run through here too, so a subclass or
        wrapper of `run` sees every step, the Loop's and those called by hand.

        Returns:
          The `StepResult` of the dispatch's `dispatch.count` optimizer steps.

        Raises:
          TypeError: `dispatch` is none of the three records, or as `train_step`.
          ValueError: as `train_step` and `train_steps`.
        """
        return self._programs.dispatch(dispatch)

    def reset_eval_metrics(self) -> None:
        """Resets the running eval metrics (evaluate() does this at its start)."""
        self._evaluator.reset()

    def eval_step(self, spec: Any, inputs: Any, labels: Any) -> dict[str, jax.Array]:
        """Updates the running eval metrics with one batch; parameters do not change.

        A batch of any size counts every example once, on any number of devices: on N
        devices, a batch that N does not divide runs as its largest part that N divides
        plus its remainder padded to one example per device, in one compiled step (once
        per shape, like any batch) that leaves the padding out of the loss and of every
        metric and updates the metrics once, as with one batch.

        Returns:
          The running values `{"mean_loss": ..., <eval metric name>: ...}` over every
          batch since the last `reset_eval_metrics()` (or `evaluate`).

        Raises:
          TypeError: an input or label is not an array.
          ValueError: no inputs, mismatched batch sizes, the spec used before with another
            number of inputs/labels, or (multi-process) a batch that the local devices do
            not divide and whose size differs between processes.
        """
        return self._evaluator.eval_step(spec, inputs, labels)

    def evaluate(self, dataset: Dataset | Iterable[Any]) -> dict[str, float]:
        """Evaluates on every batch of `dataset`; returns example-weighted means.

        Resets the dataset and the eval metrics first (not after). Every example counts once,
        on any devices (`eval_step`) and processes, even with uneven shares. A dataset
        that says it skips examples (`ArrayDataset` with `drop_remainder=True` and a
        size its batch size does not divide) draws a `RuntimeWarning` with the counts.
        An iterable of batches (a list, a grain `MapDataset`, `IterDataset` or
        `DataLoader`) or an `IterableDataset` is read from its start with an iterator of
        its own, so evaluating the data a run trains on leaves the run's position as it is.

        Returns:
          `{"mean_loss": ..., <eval metric name>: ...}` as Python floats.

        Raises:
          TypeError: `dataset` is neither a `Dataset` nor an iterable, or is an iterator
            (a generator), which cannot be read again.
          ValueError: the dataset yields no batch, has `loop_forever=True` or repeats
            forever (grain's `.repeat()`).
          RuntimeError: the dataset raised (the message names it).
        """
        return self._evaluator.evaluate(dataset)

    def predict(self, x: Any, *, batch_size: int | None = None, spec: Any = None) -> Any:
        """The model's predictions (eval mode) as numpy, for every example exactly once.

        Args:
          x: the model's inputs: an array, a list of arrays (one per model input, the same
            first dimension), or a `Dataset` (its batches' inputs; labels are ignored; it is
            reset first). On several processes, each its own share (shares may differ).
          batch_size: examples per compiled call (default 256, or the whole input when
            smaller), rounded up to a multiple of the device count; the last batch is padded
            and the padding's predictions dropped, so each batch size compiles once. Ignored
            for a `Dataset`, whose batches are predicted as they come (each padded to the
            device count).
          spec: the spec passed to the model (ignored for a `Dataset`, whose batches carry
            theirs).

        Returns:
          A numpy array of predictions, or a list of arrays when the model returns several.

        Raises:
          RuntimeError: the trainer has no state yet (no step, restore or init_params).
          ValueError: inputs with different first dimensions, or a bad batch_size.
        """
        return self._predictor.predict(x, batch_size=batch_size, spec=spec)

    def __repr__(self) -> str:
        options = self._compiler_options
        return (
            f"Trainer(global_step={self.global_step}, devices={self.num_devices}, "
            f"parallel={self.parallel!r}, executors={len(self.executors())}"
            + (f", compiler_options={dict(options)!r})" if options else ")")
        )


def _leading_length(arrays: list[Any]) -> int:
    """The length of the first array's leading axis (`train_steps`' n), or 0 for no array.

    No more than that: the batch check, before anything runs, names what is wrong.
    """
    shape = getattr(arrays[0], "shape", ()) if arrays else ()
    return int(shape[0]) if shape else 0
