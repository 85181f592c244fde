"""The per-device train, eval and predict step bodies.

See `_parallel` for how they are made data-parallel.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import jax
import jax.numpy as jnp
import optax

from ..metrics._internal import LossMovingAverage, zero_mean_state
from ._aux import aux_names, aux_outputs, global_norm
from ._collectives import Collectives
from ._compiler_options import jit
from ._eval_steps import MEAN_LOSS, EvalBodies
from ._models import explained_model_errors
from ._named import StepResult
from ._packed import averaged
from ._precision import (
    OVERFLOW_COUNT,
    SCALE,
    all_finite,
    cast_floating,
    fresh_dynamic_scale,
    next_dynamic_scale,
    to_float32,
)
from ._state import TrainState
from ._step_config import StepConfig

_INIT_STREAM = 2**31 - 1  # folded into the seed for initialization; steps use 0, 1, ...

# The names of the values the step bodies make besides the user's metrics.
LOSS = "loss"
MOVING_AVERAGE_LOSS = LossMovingAverage.name
SKIPPED_STEPS = "skipped_steps"  # with `skip_non_finite_steps` or dynamic loss scaling
OVERFLOW_STEPS = "overflow_steps"  # with dynamic loss scaling: its skips of them
LOSS_SCALE = "loss_scale"  # with `loss_scale`
GRAD_NORM = "grad_norm"  # with `log_grad_norm`: the global L2 norm of the gradients
UPDATE_NORM = "update_norm"  # with `log_grad_norm`: the global L2 norm of the update


class StepBuilder:
    """Builds the per-device step bodies for one trainer's model and `StepConfig`.

    The step bodies return their metric values in dicts keyed by metric name, and keep
    the metric states in dicts keyed the same way. A compiled program returns a dict with
    its keys sorted; `train_keys` and `eval_keys` give the order of the metrics dicts.

    Attributes:
      train_keys: the train step's metric names, in the order of its metrics dict:
        `"loss"`, `"moving_average_loss"`, the user's, then `"skipped_steps"`,
        `"overflow_steps"`, `"loss_scale"`, `"grad_norm"` and `"update_norm"` when on.
        The names of the loss function's auxiliary outputs follow (`aux_names`), once
        the train step has been traced.
      aux_names: the names of the loss function's auxiliary outputs (`(loss, {name:
        value})`), in its order; known once a train step is traced, () before.
      aux_traced: whether a train step was traced, so that `aux_names` is known.
      eval_keys: the eval step's: `"mean_loss"`, then the user's.
      train_state_keys: the keys of `TrainState.train_metrics`, in the order of its
        metrics: `"moving_average_loss"`, then the user's compiled ones (a host metric's
        state is on the host).
    """

    def __init__(self, module: Any, config: StepConfig):
        # `module`: a model adapter (see `_models`): init/apply like a Linen module.
        self.module = module
        self.config = config
        self.collectives = Collectives(config.strategy.body_devices)
        self.loss_average = LossMovingAverage()
        train_keys = (LOSS, MOVING_AVERAGE_LOSS, *config.train_order)
        if config.reports_skips:
            train_keys = (*train_keys, SKIPPED_STEPS)
        if config.dynamic_scale:
            train_keys = (*train_keys, OVERFLOW_STEPS)
        if config.loss_scale is not None:
            train_keys = (*train_keys, LOSS_SCALE)
        if config.log_grad_norm:
            train_keys = (*train_keys, GRAD_NORM, UPDATE_NORM)
        self.train_keys: tuple[str, ...] = train_keys
        self.aux_names: tuple[str, ...] = ()
        self.aux_traced = False
        self.eval_keys: tuple[str, ...] = (MEAN_LOSS, *config.eval_order)
        self.train_state_keys: tuple[str, ...] = (
            MOVING_AVERAGE_LOSS,
            *(m.name for m in config.train_metrics),
        )
        # Compiled, each into one small program: run op by op, every metric's `init` would
        # compile a program per operation at a process's first run and evaluation. Called
        # outside a trace only (JAX refuses compiler options on a nested jit): a program
        # builds the states with `initial_train_metrics`.
        options = config.options
        self.fresh_train_metrics: Callable[[], dict[str, Any]] = jit(
            self.initial_train_metrics, options
        )
        self.fresh_eval_metrics: Callable[[], dict[str, Any]] = jit(self._eval_metrics, options)
        self.evaluation = EvalBodies(self)  # the eval and predict bodies
        # The predictions' shapes the loss got when a body was last traced (a side effect of
        # tracing, free at run time): what `ExecInfo.prediction_shapes` reports.
        self.traced_prediction_shapes: tuple[tuple[int, ...], ...] | None = None

    def carry_aux_names(self, previous: StepBuilder) -> None:
        """Takes `previous`'s loss aux names as traced: the loss function is the same."""
        self.aux_names, self.aux_traced = previous.aux_names, previous.aux_traced

    def lower(self, run: Any, *arguments: Any) -> tuple[Any, tuple[tuple[int, ...], ...]]:
        """`run` (a jitted body of these steps) lowered for `arguments`; its predictions' shapes.

        The shapes are those the trace gave the loss; () when JAX took the trace from its cache.
        """
        self.traced_prediction_shapes = None  # a trace JAX took from its cache sets none
        lowered = run.lower(*arguments)
        return lowered, self.traced_prediction_shapes or ()

    def initial_train_metrics(self) -> dict[str, Any]:
        """The train metric states before any step, by name: the loss average, the user's."""
        return {
            MOVING_AVERAGE_LOSS: self.loss_average.init(),
            **{m.name: m.init() for m in self.config.train_metrics},
        }

    def _eval_metrics(self) -> dict[str, Any]:
        """The eval metric states before any batch, by name: the mean loss, the user's."""
        return {
            MEAN_LOSS: zero_mean_state(),
            **{m.name: m.init() for m in self.config.eval_metrics},
        }

    def fresh_loss_scale(self) -> jax.Array | None:
        """The dynamic loss scale's state before any step, or None without one."""
        return fresh_dynamic_scale() if self.config.dynamic_scale else None

    # -- pieces shared by train and eval ------------------------------------------------

    def _rngs(self, base_rng: jax.Array, step: jax.Array, micro: Any = None) -> dict:
        key = jax.random.fold_in(base_rng, step)
        if micro is not None:  # each micro-batch of an accumulated step draws its own
            key = jax.random.fold_in(key, micro)
        key = jax.random.fold_in(key, self.config.strategy.device_index())
        params_key, dropout_key = jax.random.split(key)
        return {"params": params_key, "dropout": dropout_key}

    def loss_of(self, labels, predictions, added_loss) -> jax.Array:
        """The loss to minimize (the loss function's auxiliary outputs dropped)."""
        return self.loss_and_aux(labels, predictions, added_loss)[0]

    def loss_and_aux(self, labels, predictions, added_loss) -> tuple[jax.Array, dict]:
        """`(loss, aux)`: the loss to minimize and the loss function's auxiliary outputs.

        `aux` is `{name: float32 scalar}` (each value mean-reduced like the loss), empty
        unless the loss function returns `(loss, {name: value, ...})`.
        """
        loss_fn = self.config.loss_fn
        aux: dict[str, jax.Array] = {}
        if loss_fn is None and added_loss is None:
            raise ValueError(
                "no loss to minimize: pass a loss_fn to the Trainer, or call ctx.add_loss(...) "
                "in the model function"
            )
        total = jnp.zeros((), jnp.float32)
        self.traced_prediction_shapes = tuple(tuple(p.shape) for p in predictions)
        if loss_fn is not None:
            loss: Any = loss_fn(labels, predictions)
            name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
            if isinstance(loss, (tuple, list)) and len(loss) == 2 and isinstance(loss[1], Mapping):
                loss, aux = loss[0], aux_outputs(name, loss[1], self.train_keys)
            if not (hasattr(loss, "shape") and hasattr(loss, "dtype")):
                raise TypeError(
                    f"loss function {name!r} returned a {type(loss).__name__}; it must return one "
                    "array: the loss, or per-example losses (they are averaged), or a pair "
                    "(loss, {name: value, ...}) whose values become train metrics. Report other "
                    "values with train_metrics, or add extra terms with ctx.add_loss"
                )
            total = total + jnp.mean(cast(jax.Array, loss).astype(jnp.float32))
        if added_loss is not None:
            total = total + added_loss.astype(jnp.float32)
        return total, aux

    def apply_model(self, step, model_state, params, spec, rng, inputs, training: bool, micro=None):
        """The model on one shard: `(predictions, added loss, new model state)`.

        The predictions are in float32 whatever the compute dtype.
        """
        dtype = self.config.compute_dtype
        variables = {"params": cast_floating(params, dtype), **model_state}
        with explained_model_errors(self.module, spec, inputs, "running a step"):
            (predictions, added_loss), new_model_state = self.module.apply(
                variables,
                spec,
                cast_floating(list(inputs), dtype),
                training,
                rngs=self._rngs(rng, step, micro),
                mutable=list(model_state.keys()),
                global_step=step,
            )
        if dtype is not None:  # batch statistics computed in the compute dtype keep theirs
            new_model_state = jax.tree.map(
                lambda new, old: new.astype(old.dtype), dict(new_model_state), dict(model_state)
            )
        return to_float32(predictions, dtype), added_loss, new_model_state

    def _update_metrics(self, states: dict, labels, predictions) -> dict:
        """The user's train metric states, by name, after a batch."""
        new_states = {}
        for metric in self.config.train_metrics:
            partial = metric.update(labels, predictions)
            partial = self.collectives.merge(metric.merge, partial)
            new_states[metric.name] = metric.accumulate(states[metric.name], partial)
        return new_states

    def _user_states(self, state: TrainState) -> dict:
        """The user's train metric states of `state`, by name."""
        return {m.name: state.train_metrics[m.name] for m in self.config.train_metrics}

    # -- the step bodies ------------------------------------------------------------------

    def init_variables(self, spec, rng, inputs) -> dict:
        """Per-device: creates the model's variables from one device's shard."""
        key = jax.random.fold_in(rng, _INIT_STREAM)
        params_key, dropout_key = jax.random.split(key)
        with explained_model_errors(self.module, spec, inputs, "creating its variables"):
            variables = self.module.init(
                {"params": params_key, "dropout": dropout_key}, spec, inputs, True
            )
        return dict(variables)

    def _gradients(self, state, model_state, spec, rng, inputs, labels, scale, micro=None):
        """One shard's `(grads, (local loss, predictions, new model state, local aux))`.

        The gradients are the mean over devices, times `scale` when given.
        """
        strategy = self.config.strategy
        pmean = self.collectives.pmean

        def objective(params):
            predictions, added_loss, new_model_state = self.apply_model(
                state.step, model_state, params, spec, rng, inputs, True, micro
            )
            local_loss, local_aux = self.loss_and_aux(labels, predictions, added_loss)
            value = strategy.gradient_objective(local_loss, pmean)
            if scale is not None:
                value = value * scale
            return value, (local_loss, predictions, new_model_state, local_aux)

        (_, aux), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
        return strategy.gradient_mean(grads, pmean), aux

    def _accumulated(self, state, spec, rng, inputs, labels, scale):
        """Gradients, loss, model state, user metric states, host and aux values of a step.

        The loss function's auxiliary outputs are the mean of the micro-batches'. The
        micro-batches are the leading axis of `inputs`/`labels`, run in one `lax.scan`:
        the activations of one micro-batch live at a time. The gradient is the mean of the
        micro-batches'.
        """
        count = inputs[0].shape[0]

        def micro_step(carry, batch):
            grad_sum, loss_sum, model_state, user_states = carry
            index, micro_inputs, micro_labels = batch
            grads, (local_loss, predictions, new_model_state, local_aux) = self._gradients(
                state, model_state, spec, rng, micro_inputs, micro_labels, scale, index
            )
            user_states = self._update_metrics(user_states, micro_labels, predictions)
            host_values = self.config.host_train.step_values(micro_labels, predictions)
            carry = (
                jax.tree.map(jnp.add, grad_sum, grads),
                loss_sum + self.collectives.pmean(local_loss),
                self.collectives.reduce(new_model_state),
                user_states,
            )
            # The auxiliary outputs of each micro-batch (scalars), averaged after the scan.
            return carry, (host_values, self.collectives.pmean(local_aux))

        start = (
            jax.tree.map(jnp.zeros_like, state.params),
            jnp.zeros((), jnp.float32),
            state.model_state,
            self._user_states(state),
        )
        indices = jnp.arange(count, dtype=jnp.int32)
        (grad_sum, loss_sum, model_state, user_states), (host_values, aux) = jax.lax.scan(
            micro_step, start, (indices, list(inputs), list(labels))
        )
        grads = jax.tree.map(lambda g: g / count, grad_sum)
        aux = {name: jnp.mean(values) for name, values in aux.items()}
        return grads, loss_sum / count, model_state, user_states, host_values, aux

    def train(self, spec, rng, state: TrainState, inputs, labels):
        """Per-device: one optimizer step on this device's shard of the global batch.

        With accumulation, on its shard of each micro-batch.

        `rng` is the trainer's base key, compiled in as a constant; `state.rng` is None
        here (see `PlacedState`).
        """
        config = self.config
        scale = None
        if config.dynamic_scale:
            scale = state.loss_scale[SCALE]
        elif config.loss_scale is not None:
            scale = jnp.float32(config.loss_scale)
        if config.accumulate:
            grads, loss, new_model_state, user_states, host_values, aux = self._accumulated(
                state, spec, rng, inputs, labels, scale
            )
            predictions = None  # the host metrics' step values come from each micro-batch
        else:
            grads, (local_loss, predictions, new_model_state, local_aux) = self._gradients(
                state, state.model_state, spec, rng, inputs, labels, scale
            )
            loss = self.collectives.pmean(local_loss)
            aux = self.collectives.pmean(local_aux)
            new_model_state = self.collectives.reduce(new_model_state)
            user_states = self._update_metrics(self._user_states(state), labels, predictions)
            host_values = None
        self.aux_names = aux_names(self.aux_names, aux)
        self.aux_traced = True
        if scale is not None:
            grads = jax.tree.map(lambda g: g / scale, grads)
        updates, opt_state = config.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        norms = {}
        if config.log_grad_norm:  # of the mean gradient over devices and micro-batches
            norms = {GRAD_NORM: global_norm(grads), UPDATE_NORM: global_norm(updates)}
        for update_fn in config.per_step_updates:
            params = update_fn(params)
        ok = average_ok = None
        loss_scale = state.loss_scale
        if config.reports_skips:
            # Identical on every device: the loss and gradients are already averaged.
            grads_finite = all_finite(grads)
            loss_finite = jnp.isfinite(loss)
            ok = loss_finite & grads_finite
            # Without skip_non_finite, a non-finite loss still reaches the moving average,
            # so the loop reports it; only an overflow of the scaled gradient is routine.
            average_ok = ok if config.skip_non_finite else None

            def keep(new, old):
                return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)

            params = keep(params, state.params)
            opt_state = keep(opt_state, state.opt_state)
            new_model_state = keep(new_model_state, state.model_state)
            if config.skip_non_finite:
                user_states = keep(user_states, self._user_states(state))
            if config.dynamic_scale:
                loss_scale = next_dynamic_scale(state.loss_scale, grads_finite, loss_finite)
        ema = state.ema_params
        if config.ema_decay is not None:  # after each optimizer step; a skipped one keeps it
            ema = averaged(ema, params, config.ema_decay)
            if ok is not None:
                ema = jax.tree.map(lambda n, o: jnp.where(ok, n, o), ema, state.ema_params)
        loss_average = self.loss_average.add_loss(
            state.train_metrics[MOVING_AVERAGE_LOSS], loss, average_ok, None if ok is None else ~ok
        )
        values = {
            LOSS: loss,
            MOVING_AVERAGE_LOSS: self.loss_average.compute(loss_average),
            **{m.name: m.compute(user_states[m.name]) for m in config.train_metrics},
        }
        if config.reports_skips:
            values[SKIPPED_STEPS] = self.loss_average.skipped(loss_average)
        if config.dynamic_scale:  # of the skips, the overflows, since training began
            values[OVERFLOW_STEPS] = loss_scale[OVERFLOW_COUNT]
        if config.loss_scale is not None:  # the scale the next step uses
            values[LOSS_SCALE] = loss_scale[SCALE] if config.dynamic_scale else scale
        values.update(norms)
        values.update(aux)
        # Host metrics' step values, returned unread (a skipped step's are left out).
        if config.host_train:
            if host_values is None:
                host_values = config.host_train.step_values(labels, predictions, ok)
            else:
                host_values = {name: v.of_micro_batches(ok) for name, v in host_values.items()}
            values.update(host_values)
        new_state = state.replace(
            step=state.step + 1,
            params=params,
            opt_state=opt_state,
            model_state=new_model_state,
            train_metrics={MOVING_AVERAGE_LOSS: loss_average, **user_states},
            loss_scale=loss_scale,
            ema_params=ema,
        )
        return new_state, values

    def train_steps(
        self, spec, rng, state: TrainState, inputs, labels
    ) -> tuple[TrainState, StepResult]:
        """Per-device: `train` over the leading steps axis of `inputs`/`labels`, in one scan.

        Returns the new state and a `StepResult` by metric name: `last`, the last step's
        values, in which a host metric's step values are those of all the steps folded into
        one, and `stacked`, the compiled metrics' values of every step (a leading steps axis).
        """
        return self.scan_steps(spec, rng, state, (list(inputs), list(labels)), lambda xs: xs)

    def scan_steps(
        self, spec, rng, state: TrainState, xs: Any, batch_of: Callable
    ) -> tuple[TrainState, StepResult]:
        """Per-device: `train` on `batch_of(x) -> (inputs, labels)` for each step's `x` of `xs`.

        One `lax.scan` over the leading axis of `xs`; returns as `train_steps`.
        """
        host_names = self.config.host_train.names

        def one_step(state, x):
            return self.train(spec, rng, state, *batch_of(x))

        state, values = jax.lax.scan(one_step, state, xs)
        stacked = {name: v for name, v in values.items() if name not in host_names}
        last = {name: v[-1] for name, v in stacked.items()}
        for metric in self.config.host_train.metrics:
            # A host metric's StepValues of every step, folded into one step's.
            last[metric.name] = values[metric.name].of_micro_batches()
        return state, StepResult(last, stacked)
