"""The per-device eval and predict step bodies: the model in eval mode, metrics by name.

With EMA weights (`Trainer(ema_decay=...)`) they run the model on the average, not on the
raw parameters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import jax
import jax.numpy as jnp

from ..metrics import MeanState
from ..metrics._internal import add_mean_states, batch_size_of, mean_of
from ._host_metrics import merge_step_values
from ._state import TrainState, eval_params

if TYPE_CHECKING:
    from ._collectives import Collectives
    from ._step_config import StepConfig

MEAN_LOSS = "mean_loss"


class StepPieces(Protocol):
    """What the eval and predict bodies read of the `StepBuilder` that builds them."""

    config: StepConfig
    collectives: Collectives

    def apply_model(
        self, step, model_state, params, spec, rng, inputs, training: bool, micro=None
    ) -> Any:
        """The model on one shard: `(predictions, added loss, new model state)`."""
        ...

    def loss_of(self, labels, predictions, added_loss) -> jax.Array:
        """The loss to minimize."""
        ...


class EvalBodies:
    """The eval and predict bodies of one `StepBuilder` (its model, config and collectives).

    Args:
      steps: the builder whose pieces (`apply_model`, `loss_of`) the bodies share.
    """

    def __init__(self, steps: StepPieces):
        self._steps = steps

    def predict(self, spec, rng, state: TrainState, inputs):
        """Per-device: the model's predictions (eval mode) for this device's shard."""
        predictions, _, _ = self._steps.apply_model(
            state.step, state.model_state, eval_params(state), spec, rng, inputs, False
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
            merges = {
                MEAN_LOSS: add_mean_states,
                **{m.name: m.merge for m in self._steps.config.eval_metrics},
                # host metrics' step values concatenate
                **{m.name: merge_step_values for m in self._steps.config.host_eval.metrics},
            }
            partials = {
                name: merge(divisible[name], partials[name]) for name, merge in merges.items()
            }
        return self._accumulate_eval(metric_states, partials)

    def _eval_partials(self, spec, rng, state, inputs, labels, valid=None) -> dict:
        """The merged partials of the mean loss and the eval metrics over all devices' shards.

        By metric name, the host metrics' step values included. Given `valid`, over those
        shards whose `valid` is True.
        """
        predictions, added_loss, _ = self._steps.apply_model(
            state.step, state.model_state, eval_params(state), spec, rng, inputs, False
        )
        local_loss = self._steps.loss_of(labels, predictions, added_loss)
        # The example-weighted mean of the batch losses, as `metrics.Mean` keeps it.
        weight = jnp.asarray(batch_size_of(predictions), jnp.float32)
        loss_partial = self._steps.collectives.merge(
            add_mean_states, MeanState(local_loss * weight, weight), valid
        )
        return {
            MEAN_LOSS: loss_partial,
            **{
                metric.name: self._steps.collectives.merge(
                    metric.merge, metric.update(labels, predictions), valid
                )
                for metric in self._steps.config.eval_metrics
            },
            **self._steps.config.host_eval.step_values(labels, predictions, valid),  # host metrics'
        }

    def _accumulate_eval(self, metric_states: dict, partials: dict) -> tuple[dict, dict]:
        """The eval metric states after a batch's `partials`, and their values, by name."""
        metrics = self._steps.config.eval_metrics
        states = {
            MEAN_LOSS: add_mean_states(metric_states[MEAN_LOSS], partials[MEAN_LOSS]),
            **{m.name: m.accumulate(metric_states[m.name], partials[m.name]) for m in metrics},
        }
        values = {
            MEAN_LOSS: mean_of(states[MEAN_LOSS]),
            **{m.name: m.compute(states[m.name]) for m in metrics},
            # host metrics' step values
            **{m.name: partials[m.name] for m in self._steps.config.host_eval.metrics},
        }
        return states, values
