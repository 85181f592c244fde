"""The per-device train and eval step bodies, and how they are made data-parallel."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..metrics._mean import (
    MeanState,
    add_mean_states,
    batch_size_of,
    mean_of,
    zero_mean_state,
)
from ._host_metrics import split_host_metrics
from ._state import TrainState

AXIS = "devices"
_INIT_STREAM = 2**31 - 1  # folded into the seed for initialization; steps use 0, 1, ...

LossFn = Callable[[list[jax.Array], list[jax.Array]], jax.Array]


class LossMovingAverage:
    """The built-in `moving_average_loss` (weight `max(0.01, 1/count)` per step) and the
    count of skipped steps.

    Its state is one float32[3] array `(mean, count, skipped)`: every state leaf costs the
    CPU runtime a few microseconds per step, which shows on small models. A skipped step
    (non-finite loss or gradient under `Trainer.skip_non_finite_steps`) leaves the mean
    and count alone and counts itself in `skipped`, so the average is never poisoned.
    """

    new_example_weight = 0.01

    def init(self):
        return jnp.zeros((3,), jnp.float32)

    def accumulate(self, state, loss, ok=None):
        count = state[1] + 1.0
        weight = jnp.maximum(self.new_example_weight, 1.0 / count)
        updated = jnp.stack([state[0] * (1.0 - weight) + loss * weight, count, state[2]])
        if ok is None:
            return updated
        return jnp.where(ok, updated, state.at[2].add(1.0))

    def compute(self, state):
        return state[0]

    def skipped(self, state):
        return state[2]


class Collectives:
    """Cross-device reductions over `AXIS`; plain identities on a single device.

    On one device every collective is a no-op, but XLA's CPU runtime still runs each one
    through a rendezvous: skipping them (and shard_map's replication check, which needs
    them) keeps the 1-device step as lean as a hand-written one.
    """

    def __init__(self, num_devices: int):
        self.num_devices = num_devices
        self.single = num_devices == 1

    def pmean(self, tree: Any) -> Any:
        return tree if self.single else jax.lax.pmean(tree, AXIS)

    def reduce(self, tree: Any) -> Any:
        """Averages float leaves across devices and takes the max of the others."""
        if self.single:
            return tree

        def reduce(leaf):
            if jnp.issubdtype(leaf.dtype, jnp.inexact):
                return jax.lax.pmean(leaf, AXIS)
            return jax.lax.pmax(leaf, AXIS)

        return jax.tree.map(reduce, tree)

    def merge(
        self, merge: Callable[[Any, Any], Any], partial: Any, valid: jax.Array | None = None
    ) -> Any:
        """Combines per-device partial metric states with `merge`, in device order.

        With `valid` (this device's bool scalar), the partials of devices whose `valid` is
        False are left out of the fold; device 0's must be valid. Metrics need not know
        about padding: a padding example's partial is computed, then never merged.
        """
        if self.single:
            return partial
        gathered = jax.lax.all_gather(partial, AXIS)
        valid_devices = None if valid is None else jax.lax.all_gather(valid, AXIS)
        result = jax.tree.map(lambda leaf: leaf[0], gathered)
        for index in range(1, self.num_devices):
            merged = merge(result, jax.tree.map(lambda leaf, i=index: leaf[i], gathered))
            if valid_devices is not None:
                # `where`, not arithmetic: a padding example's partial may be NaN or inf.
                keep = valid_devices[index]
                merged = jax.tree.map(
                    lambda new, old: jnp.where(keep, new, old).astype(new.dtype), merged, result
                )
            result = merged
        # The fold is identical on every device; pmax marks it replicated for shard_map.
        return jax.tree.map(lambda leaf: jax.lax.pmax(leaf, AXIS), result)


class StepBuilder:
    """Builds the per-device step bodies for one trainer's model, loss and metrics."""

    def __init__(
        self,
        module: Any,  # a model adapter (see `_models`): init/apply like a Linen module
        loss_fn: LossFn | None,
        optimizer: optax.GradientTransformation,
        train_metrics: Sequence[Any],
        eval_metrics: Sequence[Any],
        per_step_updates: list[Callable[[Any], Any]],
        num_devices: int,
        parallel: str,
    ):
        self.module = module
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.train_metrics = tuple(train_metrics)
        self.eval_metrics = tuple(eval_metrics)
        # Host metrics (loopax.metrics.HostMetric) only return step values; see _host_metrics.
        self.train_metrics, self.host_train = split_host_metrics(train_metrics, AXIS, num_devices)
        self.eval_metrics, self.host_eval = split_host_metrics(eval_metrics, AXIS, num_devices)
        self.per_step_updates = per_step_updates
        self.num_devices = num_devices
        self.collectives = Collectives(num_devices)
        self.parallel = parallel
        self.loss_average = LossMovingAverage()
        # Set by `Trainer.skip_non_finite_steps`: a step whose loss or gradient is not
        # finite leaves parameters, optimizer, model and metric states unchanged.
        self.skip_non_finite = False

    def fresh_train_metrics(self) -> tuple:
        """The train metric states before any step: the loss average, then the user's."""
        return (self.loss_average.init(), *(m.init() for m in self.train_metrics))

    def fresh_eval_metrics(self) -> tuple:
        """The eval metric states before any batch: the mean loss, then the user's."""
        return (zero_mean_state(), *(m.init() for m in self.eval_metrics))

    # -- pieces shared by train and eval ------------------------------------------------

    def _rngs(self, base_rng: jax.Array, step: jax.Array) -> dict[str, jax.Array]:
        key = jax.random.fold_in(base_rng, step)
        key = jax.random.fold_in(key, jax.lax.axis_index(AXIS))
        params_key, dropout_key = jax.random.split(key)
        return {"params": params_key, "dropout": dropout_key}

    def _loss(self, labels, predictions, added_loss) -> jax.Array:
        if self.loss_fn is None and added_loss is None:
            raise ValueError(
                "no loss to minimize: pass a loss_fn to the Trainer, or call ctx.add_loss(...) "
                "in the model function"
            )
        total = jnp.zeros((), jnp.float32)
        if self.loss_fn is not None:
            loss = self.loss_fn(labels, predictions)
            if not (hasattr(loss, "shape") and hasattr(loss, "dtype")):
                name = getattr(self.loss_fn, "__name__", type(self.loss_fn).__name__)
                raise TypeError(
                    f"loss function {name!r} returned a {type(loss).__name__}; it must return one "
                    "array: the loss, or per-example losses (they are averaged). Report other "
                    "values with train_metrics, or add extra terms with ctx.add_loss"
                )
            total = total + jnp.mean(loss).astype(jnp.float32)
        if added_loss is not None:
            total = total + added_loss
        return total

    def _apply(self, state: TrainState, params, spec, rng, inputs, training: bool):
        variables = {"params": params, **state.model_state}
        mutable = list(state.model_state.keys())
        (predictions, added_loss), new_model_state = self.module.apply(
            variables,
            spec,
            inputs,
            training,
            rngs=self._rngs(rng, state.step),
            mutable=mutable,
        )
        return predictions, added_loss, new_model_state

    def _update_metrics(self, metrics, states, labels, predictions):
        new_states = []
        for metric, metric_state in zip(metrics, states):
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

    def train(self, spec, rng, state: TrainState, inputs, labels):
        """Per-device: one optimizer step on this device's shard of the global batch.

        `rng` is the trainer's base key, compiled in as a constant; `state.rng` is None
        here (see `Trainer._state`).
        """

        def loss_of(params):
            predictions, added_loss, new_model_state = self._apply(
                state, params, spec, rng, inputs, training=True
            )
            local_loss = self._loss(labels, predictions, added_loss)
            if self.parallel == "shard_map":
                # Under shard_map, the gradient of replicated params w.r.t. a per-device
                # loss is summed over devices; averaging the loss first makes it the mean.
                objective = self.collectives.pmean(local_loss)
            else:
                objective = local_loss
            return objective, (local_loss, predictions, new_model_state)

        (_, (local_loss, predictions, new_model_state)), grads = jax.value_and_grad(
            loss_of, has_aux=True
        )(state.params)
        if self.parallel == "pmap":
            grads = self.collectives.pmean(grads)
        loss = self.collectives.pmean(local_loss)
        new_model_state = self.collectives.reduce(new_model_state)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        for update_fn in self.per_step_updates:
            params = update_fn(params)
        user_states = self._update_metrics(
            self.train_metrics, state.train_metrics[1:], labels, predictions
        )
        ok = None
        if self.skip_non_finite:
            # Identical on every device: the loss and gradients are already averaged.
            ok = jnp.isfinite(loss) & _all_finite(grads)
            keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)  # noqa: E731
            params = keep(params, state.params)
            opt_state = keep(opt_state, state.opt_state)
            new_model_state = keep(new_model_state, state.model_state)
            user_states = keep(user_states, tuple(state.train_metrics[1:]))
        loss_average = self.loss_average.accumulate(state.train_metrics[0], loss, ok)
        values = (
            loss,
            self.loss_average.compute(loss_average),
            *(m.compute(s) for m, s in zip(self.train_metrics, user_states)),
        )
        if self.skip_non_finite:
            values = (*values, self.loss_average.skipped(loss_average))
        # Host metrics' step values, returned unread (a skipped step's are left out).
        values = (*values, *self.host_train.step_values(labels, predictions, ok))
        new_state = state.replace(
            step=state.step + 1,
            params=params,
            opt_state=opt_state,
            model_state=new_model_state,
            train_metrics=(loss_average, *user_states),
        )
        return new_state, values

    def predict(self, spec, rng, state: TrainState, inputs):
        """Per-device: the model's predictions (eval mode) for this device's shard."""
        predictions, _, _ = self._apply(state, state.params, spec, rng, inputs, False)
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
            merges = (add_mean_states, *(m.merge for m in self.eval_metrics))
            merges = (*merges, *self.host_eval.merges)  # host metrics' step values concatenate
            partials = tuple(merge(a, b) for merge, a, b in zip(merges, divisible, partials))
        return self._accumulate_eval(metric_states, partials)

    def _eval_partials(self, spec, rng, state, inputs, labels, valid=None) -> tuple:
        """The merged partials of the mean loss and the eval metrics over all devices'
        shards (those whose `valid` is True, given `valid`).
        """
        predictions, added_loss, _ = self._apply(state, state.params, spec, rng, inputs, False)
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
                for metric in self.eval_metrics
            ),
            *self.host_eval.step_values(labels, predictions, valid),  # host metrics' step values
        )

    def _accumulate_eval(self, metric_states, partials):
        loss_state = add_mean_states(metric_states[0], partials[0])
        user_states = tuple(
            metric.accumulate(metric_state, partial)
            for metric, metric_state, partial in zip(
                self.eval_metrics, metric_states[1:], partials[1:]
            )
        )
        values = (
            mean_of(loss_state),
            *(m.compute(s) for m, s in zip(self.eval_metrics, user_states)),
        )
        values = (*values, *partials[1 + len(self.eval_metrics) :])  # host metrics' step values
        return (loss_state, *user_states), values


def _all_finite(tree: Any) -> jax.Array:
    leaves = [leaf for leaf in jax.tree.leaves(tree) if jnp.issubdtype(leaf.dtype, jnp.inexact)]
    return (
        jnp.all(jnp.stack([jnp.isfinite(leaf).all() for leaf in leaves]))
        if leaves
        else jnp.bool_(True)
    )


def make_parallel(
    body: Callable[..., Any],
    mesh: Mesh,
    parallel: str,
    num_replicated: int,
    num_sharded: int,
    donate: tuple[int, ...],
    per_example_output: bool = False,
):
    """Wraps a per-device step body `(*state, *batch) -> (new_state, values)` as one
    data-parallel, jit-compiled step.

    The first `num_replicated` arguments are replicated (state); the next `num_sharded`
    are split on axis 0 across devices (the batch). With `parallel="shard_map"` state is
    a global replicated array; with `"pmap"` state carries a leading device axis, which
    the new state keeps, while the replicated `values` come back without it. With
    `per_example_output` the body returns per-example values instead (predictions), which
    come back as one global batch in order.
    """
    if parallel == "pmap":
        num_devices = device_count_of(mesh)
        pmapped = jax.pmap(
            body,
            axis_name=AXIS,
            devices=list(mesh.devices.flat),
            out_axes=0 if per_example_output else (0, None),
            donate_argnums=donate,
        )

        def split_batch_then_pmap(*args):
            # The batch gets its leading device axis inside the compiled program: an
            # eager reshape per step would cost more than a small step.
            state, batch = args[:num_replicated], args[num_replicated:]
            batch = jax.tree.map(
                lambda a: a.reshape((num_devices, a.shape[0] // num_devices, *a.shape[1:])),
                batch,
            )
            out = pmapped(*state, *batch)
            if per_example_output:  # devices x per-device examples -> one batch
                out = jax.tree.map(lambda a: a.reshape((-1, *a.shape[2:])), out)
            return out

        return jax.jit(split_batch_then_pmap, donate_argnums=donate)
    in_specs = (P(),) * num_replicated + (P(AXIS),) * num_sharded
    # One device skips the collectives that mark values replicated, so skips the check.
    check_vma = device_count_of(mesh) > 1
    out_specs = P(AXIS) if per_example_output else (P(), P())
    stepped = jax.shard_map(
        body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma
    )
    shardings = tuple(NamedSharding(mesh, spec) for spec in in_specs)
    return jax.jit(stepped, in_shardings=shardings, donate_argnums=donate)


def make_initializer(body: Callable[..., Any], mesh: Mesh) -> Callable[..., Any]:
    """Runs `body(rng, inputs)` once per device; every device builds the same variables."""
    # check_vma is off: variables come from the replicated key, but a data-dependent
    # initializer would mark them per-device; device 0's copy is the one kept.
    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P(), check_vma=False)
    )


def device_count_of(mesh: Mesh) -> int:
    return int(mesh.devices.size)
