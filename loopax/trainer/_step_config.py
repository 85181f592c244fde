"""`StepConfig`: everything the step bodies are compiled from, besides the model.

Its own module because the train-step builder (`_steps`), the eval bodies (`_eval_steps`) and
the programs (`_programs`, `_trainer_args`) all read it, and none of them should import another
only for its type.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import optax

from ._host_metrics import HostMetrics
from ._parallel import Strategy

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
      train_order, eval_order: the names of all the user's train (eval) metrics,
        compiled and host, in the user's order: the order of the metrics dicts.
      strategy: the parallel strategy (how gradients become the mean over devices).
      per_step_updates: `fn(params) -> params`, applied after each update.
      skip_non_finite: a step whose loss or gradient is not finite changes nothing.
      accumulate: the train step's inputs carry a leading axis of micro-batches.
      compute_dtype: the dtype the model computes in (None: the parameters' float32).
      loss_scale: None, a static scale, or `"dynamic"`.
      ema_decay: keep `TrainState.ema_params`, the parameters' exponential moving average
        with this decay; None: none.
      log_grad_norm: the train step also returns `"grad_norm"` and `"update_norm"`.
      compiler_options: the XLA options every program compiles with (`Trainer`'s
        `compiler_options`, checked), as `(name, value)` pairs; () for none.
    """

    loss_fn: LossFn | None
    optimizer: optax.GradientTransformation
    train_metrics: tuple
    eval_metrics: tuple
    strategy: Strategy
    host_train: HostMetrics
    host_eval: HostMetrics
    train_order: tuple[str, ...]
    eval_order: tuple[str, ...]
    per_step_updates: tuple = ()
    skip_non_finite: bool = False
    accumulate: bool = False
    compute_dtype: Any = None
    loss_scale: float | str | None = None
    ema_decay: float | None = None
    log_grad_norm: bool = False
    compiler_options: tuple[tuple[str, bool | int | float | str], ...] = ()

    @property
    def options(self) -> dict[str, bool | int | float | str]:
        """`compiler_options` as the dict `jax.stages.Lowered.compile` takes."""
        return dict(self.compiler_options)

    @property
    def dynamic_scale(self) -> bool:
        return self.loss_scale == "dynamic"

    @property
    def reports_skips(self) -> bool:
        """Whether the train step returns `skipped_steps`."""
        return self.skip_non_finite or self.dynamic_scale
