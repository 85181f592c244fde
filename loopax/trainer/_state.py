"""The train state: one pytree holding everything a step reads and writes."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax


@flax.struct.dataclass
class TrainState:
    """Everything the compiled train step reads and writes; checkpointed as a whole.

    Attributes:
      step: the global step (optimizer steps taken), an int32 scalar.
      params: the trainable variables (the Flax `params` collection).
      opt_state: the optax optimizer state.
      model_state: the other Flax collections, e.g. `{"batch_stats": ...}`.
      rng: the base PRNG key data (uint32[2]); each step folds in the step and device.
      train_metrics: the running states of the train metrics, in order: the moving
        average of the loss, then the user's train metrics.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any
    rng: jax.Array
    train_metrics: tuple
