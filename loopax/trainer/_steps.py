"""The per-device train, eval and predict step bodies.

See `_parallel` for how they are made data-parallel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from ..metrics._mean import (
    MeanState,
    add_mean_states,
    batch_size_of,
    mean_of,
    zero_mean_state,
)
from ._collectives import Collectives, LossMovingAverage
from ._host_metrics import HostMetrics, StepValues
from ._parallel import AXIS, Strategy
from ._precision import cast_floating, fresh_dynamic_scale, next_dynamic_scale, to_float32
from ._state import TrainState

_INIT_STREAM = 2**31 - 1  # folded into the seed for initialization; steps use 0, 1, ...

LossFn = Callable[[list[jax.Array], list[jax.Array]], jax.Array]


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Everything the step bodies are compiled from, besides the model; frozen.

    So a change (e.g. `Trainer.add_per_step_update`) makes a new config and new compiled
    steps.

    Attributes:
      loss_fn: `loss_fn(labels, predictions)`, or None when the model adds its losses.
      optimizer: the optax transformation.
      train_metrics, eval_metrics: the user's compiled metric objects.
      host_train, host_eval: the user's host metrics (`loopax.metrics.HostMetric`): the
        steps return their step values, unread (see `_host_metrics`). The same objects
        across configs: they hold the host states.
      strategy: the parallel strategy (how gradients become the mean over devices).
      per_step_updates: `fn(params) -> params`, applied after each update.
      skip_non_finite: a step whose loss or gradient is not finite changes nothing.
      accumulate: the train step's inputs carry a leading axis of micro-batches.
      compute_dtype: the dtype the model computes in (None: the parameters' float32).
      loss_scale: None, a static scale, or `"dynamic"`.
    """

    loss_fn: LossFn | None
    optimizer: optax.GradientTransformation
    train_metrics: tuple
    eval_metrics: tuple
    strategy: Strategy
    host_train: HostMetrics
    host_eval: HostMetrics
    per_step_updates: tuple = ()
    skip_non_finite: bool = False
    accumulate: bool = False
    compute_dtype: Any = None
    loss_scale: float | str | None = None

    @property
    def dynamic_scale(self) -> bool:
        return self.loss_scale == "dynamic"

    @property
    def reports_skips(self) -> bool:
        """Whether the train step returns `skipped_steps`."""
        return self.skip_non_finite or self.dynamic_scale


class StepBuilder:
    """Builds the per-device step bodies for one trainer's model and `StepConfig`."""

    def __init__(self, module: Any, config: StepConfig):
        # `module`: a model adapter (see `_models`): init/apply like a Linen module.
        self.module = module
        self.config = config
        self.collectives = Collectives(config.strategy.num_devices)
        self.loss_average = LossMovingAverage()

    def fresh_train_metrics(self) -> tuple:
        """The train metric states before any step: the loss average, then the user's."""
        return (self.loss_average.init(), *(m.init() for m in self.config.train_metrics))

    def fresh_eval_metrics(self) -> tuple:
        """The eval metric states before any batch: the mean loss, then the user's."""
        return (zero_mean_state(), *(m.init() for m in self.config.eval_metrics))

    def fresh_loss_scale(self) -> jax.Array | None:
        """The dynamic loss scale's state before any step, or None without one."""
        return fresh_dynamic_scale() if self.config.dynamic_scale else None

    # -- pieces shared by train and eval ------------------------------------------------

    def _rngs(self, base_rng: jax.Array, step: jax.Array, micro: Any = None) -> dict:
        key = jax.random.fold_in(base_rng, step)
        if micro is not None:  # each micro-batch of an accumulated step draws its own
            key = jax.random.fold_in(key, micro)
        key = jax.random.fold_in(key, jax.lax.axis_index(AXIS))
        params_key, dropout_key = jax.random.split(key)
        return {"params": params_key, "dropout": dropout_key}

    def _loss(self, labels, predictions, added_loss) -> jax.Array:
        loss_fn = self.config.loss_fn
        if loss_fn is None and added_loss is None:
            raise ValueError(
                "no loss to minimize: pass a loss_fn to the Trainer, or call ctx.add_loss(...) "
                "in the model function"
            )
        total = jnp.zeros((), jnp.float32)
        if loss_fn is not None:
            loss = loss_fn(labels, predictions)
            if not (hasattr(loss, "shape") and hasattr(loss, "dtype")):
                name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
                raise TypeError(
                    f"loss function {name!r} returned a {type(loss).__name__}; it must return one "
                    "array: the loss, or per-example losses (they are averaged). Report other "
                    "values with train_metrics, or add extra terms with ctx.add_loss"
                )
            total = total + jnp.mean(loss.astype(jnp.float32))
        if added_loss is not None:
            total = total + added_loss.astype(jnp.float32)
        return total

    def _apply(self, step, model_state, params, spec, rng, inputs, training: bool, micro=None):
        """The model on one shard: `(predictions, added loss, new model state)`.

        The predictions are in float32 whatever the compute dtype.
        """
        dtype = self.config.compute_dtype
        variables = {"params": cast_floating(params, dtype), **model_state}
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

    def _update_metrics(self, metrics, states, labels, predictions):
        new_states = []
        for metric, metric_state in zip(metrics, states, strict=True):
            partial = metric.update(labels, predictions)
            partial = self.collectives.merge(metric.merge, partial)
            new_states.append(metric.accumulate(metric_state, partial))
        return tuple(new_states)

    # -- the step bodies ------------------------------------------------------------------

    def init_variables(self, spec, rng, inputs) -> dict:
        """Per-device: creates the model's variables from one device's shard."""
        key = jax.random.fold_in(rng, _INIT_STREAM)
        params_key, dropout_key = jax.random.split(key)
        variables = self.module.init(
            {"params": params_key, "dropout": dropout_key}, spec, inputs, True
        )
        return dict(variables)

    def _gradients(self, state, model_state, spec, rng, inputs, labels, scale, micro=None):
        """One shard's `(grads, (local loss, predictions, new model state))`.

        The gradients are the mean over devices, times `scale` when given.
        """
        strategy = self.config.strategy
        pmean = self.collectives.pmean

        def objective(params):
            predictions, added_loss, new_model_state = self._apply(
                state.step, model_state, params, spec, rng, inputs, True, micro
            )
            local_loss = self._loss(labels, predictions, added_loss)
            value = strategy.gradient_objective(local_loss, pmean)
            if scale is not None:
                value = value * scale
            return value, (local_loss, predictions, new_model_state)

        (_, aux), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
        return strategy.gradient_mean(grads, pmean), aux

    def _accumulated(self, state, spec, rng, inputs, labels, scale):
        """Gradients, loss, model state and user metric states over the micro-batches.

        The micro-batches are the leading axis of `inputs`/`labels`, run in one `lax.scan`:
        the activations of one micro-batch live at a time. The gradient is the mean of the
        micro-batches'.
        """
        count = inputs[0].shape[0]
        metrics = self.config.train_metrics

        def micro_step(carry, batch):
            grad_sum, loss_sum, model_state, user_states = carry
            index, micro_inputs, micro_labels = batch
            grads, (local_loss, predictions, new_model_state) = self._gradients(
                state, model_state, spec, rng, micro_inputs, micro_labels, scale, index
            )
            user_states = self._update_metrics(metrics, user_states, micro_labels, predictions)
            host_values = self.config.host_train.step_values(micro_labels, predictions)
            carry = (
                jax.tree.map(jnp.add, grad_sum, grads),
                loss_sum + self.collectives.pmean(local_loss),
                self.collectives.reduce(new_model_state),
                user_states,
            )
            return carry, host_values

        start = (
            jax.tree.map(jnp.zeros_like, state.params),
            jnp.zeros((), jnp.float32),
            state.model_state,
            tuple(state.train_metrics[1:]),
        )
        indices = jnp.arange(count, dtype=jnp.int32)
        (grad_sum, loss_sum, model_state, user_states), host_values = jax.lax.scan(
            micro_step, start, (indices, list(inputs), list(labels))
        )
        grads = jax.tree.map(lambda g: g / count, grad_sum)
        return grads, loss_sum / count, model_state, user_states, host_values

    def train(self, spec, rng, state: TrainState, inputs, labels):
        """Per-device: one optimizer step on this device's shard of the global batch.

        With accumulation, on its shard of each micro-batch.

        `rng` is the trainer's base key, compiled in as a constant; `state.rng` is None
        here (see `Trainer._state`).
        """
        config = self.config
        scale = None
        if config.dynamic_scale:
            scale = state.loss_scale[0]
        elif config.loss_scale is not None:
            scale = jnp.float32(config.loss_scale)
        if config.accumulate:
            grads, loss, new_model_state, user_states, host_values = self._accumulated(
                state, spec, rng, inputs, labels, scale
            )
            predictions = None  # the host metrics' step values come from each micro-batch
        else:
            grads, (local_loss, predictions, new_model_state) = self._gradients(
                state, state.model_state, spec, rng, inputs, labels, scale
            )
            loss = self.collectives.pmean(local_loss)
            new_model_state = self.collectives.reduce(new_model_state)
            user_states = self._update_metrics(
                config.train_metrics, state.train_metrics[1:], labels, predictions
            )
            host_values = None
        if scale is not None:
            grads = jax.tree.map(lambda g: g / scale, grads)
        updates, opt_state = config.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        for update_fn in config.per_step_updates:
            params = update_fn(params)
        ok = average_ok = None
        loss_scale = state.loss_scale
        if config.reports_skips:
            # Identical on every device: the loss and gradients are already averaged.
            grads_finite = _all_finite(grads)
            ok = jnp.isfinite(loss) & grads_finite
            # Without skip_non_finite, a non-finite loss still reaches the moving average,
            # so the loop reports it; only an overflow of the scaled gradient is routine.
            average_ok = ok if config.skip_non_finite else None

            def keep(new, old):
                return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)

            params = keep(params, state.params)
            opt_state = keep(opt_state, state.opt_state)
            new_model_state = keep(new_model_state, state.model_state)
            if config.skip_non_finite:
                user_states = keep(user_states, tuple(state.train_metrics[1:]))
            if config.dynamic_scale:
                loss_scale = next_dynamic_scale(state.loss_scale, grads_finite)
        loss_average = self.loss_average.accumulate(
            state.train_metrics[0], loss, average_ok, None if ok is None else ~ok
        )
        values = (
            loss,
            self.loss_average.compute(loss_average),
            *(m.compute(s) for m, s in zip(config.train_metrics, user_states, strict=True)),
        )
        if config.reports_skips:
            values = (*values, self.loss_average.skipped(loss_average))
        if config.loss_scale is not None:  # the scale the next step uses
            values = (*values, loss_scale[0] if config.dynamic_scale else scale)
        # Host metrics' step values, returned unread (a skipped step's are left out).
        if config.host_train:
            if host_values is None:
                host_values = config.host_train.step_values(labels, predictions, ok)
            else:
                host_values = tuple(v.of_micro_batches(ok) for v in host_values)
            values = (*values, *host_values)
        new_state = state.replace(
            step=state.step + 1,
            params=params,
            opt_state=opt_state,
            model_state=new_model_state,
            train_metrics=(loss_average, *user_states),
            loss_scale=loss_scale,
        )
        return new_state, values

    def train_steps(self, spec, rng, state: TrainState, inputs, labels):
        """Per-device: `train` over the leading steps axis of `inputs`/`labels`, in one scan.

        Returns the new state and `(stacked, last, host)`: the compiled metrics' values of
        every step (a leading steps axis), those of the last step, and the host metrics'
        step values of all the steps folded into one.
        """
        return self.scan_steps(spec, rng, state, (list(inputs), list(labels)), lambda xs: xs)

    def scan_steps(self, spec, rng, state: TrainState, xs: Any, batch_of: Callable) -> tuple:
        """Per-device: `train` on `batch_of(x) -> (inputs, labels)` for each step's `x` of `xs`.

        One `lax.scan` over the leading axis of `xs`; returns as `train_steps`.
        """
        host_count = len(self.config.host_train.metrics)

        def one_step(state, x):
            return self.train(spec, rng, state, *batch_of(x))

        state, values = jax.lax.scan(one_step, state, xs)
        split = len(values) - host_count
        stacked = tuple(values[:split])
        last = tuple(v[-1] for v in stacked)
        host = tuple(_fold_steps(v) for v in values[split:])
        return state, (stacked, last, host)

    def predict(self, spec, rng, state: TrainState, inputs):
        """Per-device: the model's predictions (eval mode) for this device's shard."""
        predictions, _, _ = self._apply(
            state.step, state.model_state, state.params, spec, rng, inputs, False
        )
        return predictions

    def eval(self, spec, rng, state: TrainState, metric_states, inputs, labels):
        """Per-device: updates the running eval metrics with this device's shard."""
        partials = self._eval_partials(spec, rng, state, inputs, labels)
        return self._accumulate_eval(metric_states, partials)

    def eval_uneven(
        self,
        spec,
        rng,
        state: TrainState,
        metric_states,
        padded_inputs,
        padded_labels,
        valid,
        inputs=None,
        labels=None,
    ):
        """Per-device: `eval` for a batch that the devices do not divide.

        The batch comes in two pieces: `inputs`/`labels`, its largest part the devices
        divide (None when it is smaller than the device count), and its r remaining
        examples padded to one per device, `padded_inputs`/`padded_labels`, with `valid`
        (`[bool[1]]`) saying whether this device's example is real. A padding example's
        loss and metric partials are computed but left out of every merge, so metrics
        need not be mask-aware; the two pieces' partials merge into the batch's, which
        is accumulated once, as one batch.
        """
        partials = self._eval_partials(spec, rng, state, padded_inputs, padded_labels, valid[0][0])
        if inputs is not None:
            divisible = self._eval_partials(spec, rng, state, inputs, labels)
            merges = (add_mean_states, *(m.merge for m in self.config.eval_metrics))
            merges = (*merges, *self.config.host_eval.merges)  # host step values concatenate
            partials = tuple(
                merge(a, b) for merge, a, b in zip(merges, divisible, partials, strict=True)
            )
        return self._accumulate_eval(metric_states, partials)

    def _eval_partials(self, spec, rng, state, inputs, labels, valid=None) -> tuple:
        """The merged partials of the mean loss and the eval metrics over all devices' shards.

        Given `valid`, over those shards whose `valid` is True.
        """
        predictions, added_loss, _ = self._apply(
            state.step, state.model_state, state.params, spec, rng, inputs, False
        )
        local_loss = self._loss(labels, predictions, added_loss)
        # The example-weighted mean of the batch losses, as `metrics.Mean` keeps it.
        weight = jnp.asarray(batch_size_of(predictions), jnp.float32)
        loss_partial = self.collectives.merge(
            add_mean_states, MeanState(local_loss * weight, weight), valid
        )
        return (
            loss_partial,
            *(
                self.collectives.merge(metric.merge, metric.update(labels, predictions), valid)
                for metric in self.config.eval_metrics
            ),
            *self.config.host_eval.step_values(labels, predictions, valid),  # host metrics'
        )

    def _accumulate_eval(self, metric_states, partials):
        metrics = self.config.eval_metrics
        loss_state = add_mean_states(metric_states[0], partials[0])
        user_states = tuple(
            metric.accumulate(metric_state, partial)
            for metric, metric_state, partial in zip(
                metrics, metric_states[1:], partials[1 : 1 + len(metrics)], strict=True
            )
        )
        values = (
            mean_of(loss_state),
            *(m.compute(s) for m, s in zip(metrics, user_states, strict=True)),
            *partials[1 + len(metrics) :],  # host metrics' step values
        )
        return (loss_state, *user_states), values


def _fold_steps(values: Any) -> StepValues:
    """A host metric's step values of every step of a scan, folded into one step's."""
    assert isinstance(values, StepValues), "host metrics return StepValues"
    return values.of_micro_batches()


def _all_finite(tree: Any) -> jax.Array:
    leaves = [leaf for leaf in jax.tree.leaves(tree) if jnp.issubdtype(leaf.dtype, jnp.inexact)]
    return (
        jnp.all(jnp.stack([jnp.isfinite(leaf).all() for leaf in leaves]))
        if leaves
        else jnp.bool_(True)
    )
