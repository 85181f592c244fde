"""The Trainer's argument checks, and the metric names it reserves."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from .._devices import AXIS
from ._host_metrics import is_host_metric, split_host_metrics
from ._step_config import StepConfig
from ._steps import (
    GRAD_NORM,
    LOSS,
    LOSS_SCALE,
    MEAN_LOSS,
    MOVING_AVERAGE_LOSS,
    OVERFLOW_STEPS,
    SKIPPED_STEPS,
    UPDATE_NORM,
)

if TYPE_CHECKING:
    import optax

    from ._parallel import Strategy

_METRIC_METHODS = ("init", "update", "merge", "compute")
# The names the step bodies give their own values; no user metric may take one.
RESERVED_TRAIN_NAMES = (LOSS, MOVING_AVERAGE_LOSS, SKIPPED_STEPS, OVERFLOW_STEPS, LOSS_SCALE)
RESERVED_EVAL_NAMES = (MEAN_LOSS,)


def checked(train: Sequence[Any], evals: Sequence[Any], log_grad_norm: Any) -> tuple:
    """The train and eval metrics, each checked by `check_metrics`, as a pair of tuples.

    No metric may take a name the step bodies give their own values (with `log_grad_norm`,
    `"grad_norm"` and `"update_norm"` too).
    """
    reserved = RESERVED_TRAIN_NAMES + ((GRAD_NORM, UPDATE_NORM) if log_grad_norm else ())
    return check_metrics(train, "train", reserved), check_metrics(
        evals, "eval", RESERVED_EVAL_NAMES
    )


def check_flag(name: str, value: Any) -> bool:
    """`value` as a bool; raises TypeError naming `name` unless it is one."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__}")
    return bool(value)


def check_metrics(metrics: Sequence[Any], kind: str, reserved: tuple[str, ...]) -> tuple:
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


def check_callables(loss_fn: Any, optimizer: Any) -> None:
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(
            f"loss_fn must be callable or None, got {type(loss_fn).__name__}; "
            "loopax.losses.from_name('mse') builds one from a name"
        )
    if not (
        callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))
    ):
        raise TypeError(
            f"optimizer must be an optax.GradientTransformation, got {type(optimizer).__name__}; "
            "e.g. optax.adam(1e-3) or loopax.optimizers.from_name('adam')"
        )


def step_config(
    loss_fn: Any,
    optimizer: optax.GradientTransformation,
    train_metrics: tuple,
    eval_metrics: tuple,
    strategy: Strategy,
    accumulate_steps: int,
    compute_dtype: Any,
    loss_scale: Any,
    ema_decay: float | None,
    log_grad_norm: bool = False,
    compiler_options: tuple[tuple[str, Any], ...] = (),
) -> StepConfig:
    """The step bodies' first config; host metrics (`HostMetric`) split from compiled ones.

    A host metric only returns step values; see `_host_metrics`.
    """
    body_devices = strategy.body_devices
    compiled_train, host_train = split_host_metrics(train_metrics, AXIS, body_devices)
    compiled_eval, host_eval = split_host_metrics(eval_metrics, AXIS, body_devices)
    return StepConfig(
        loss_fn=loss_fn,
        optimizer=optimizer,
        train_metrics=compiled_train,
        eval_metrics=compiled_eval,
        strategy=strategy,
        host_train=host_train,
        host_eval=host_eval,
        train_order=tuple(m.name for m in train_metrics),
        eval_order=tuple(m.name for m in eval_metrics),
        accumulate=accumulate_steps > 1,
        compute_dtype=compute_dtype,
        loss_scale=loss_scale,
        ema_decay=ema_decay,
        log_grad_norm=check_flag("log_grad_norm", log_grad_norm),
        compiler_options=compiler_options,
    )


def check_ema_decay(ema_decay: Any) -> float | None:
    """`ema_decay` as a float in [0, 1), or None.

    Raises:
      TypeError: not a number.
      ValueError: outside [0, 1).
    """
    if ema_decay is None:
        return None
    if isinstance(ema_decay, bool) or not isinstance(ema_decay, (int, float, np.floating)):
        raise TypeError(
            f"ema_decay must be a number in [0, 1) such as 0.999, or None; got "
            f"{type(ema_decay).__name__}"
        )
    if not 0.0 <= float(ema_decay) < 1.0:
        raise ValueError(
            f"ema_decay must be in [0, 1) (the weight of the average at each step, e.g. 0.999 "
            f"to average over ~1000 steps); got {ema_decay}"
        )
    return float(ema_decay)


def check_mesh_context(mesh: Any) -> None:
    """Refuses a mesh context (`jax.set_mesh`) around the Trainer other than its own mesh.

    Its programs run on `mesh`; under another context mesh JAX refuses them at the first
    step, with a message that names neither. Building an NNX module under the mesh, as
    Flax's guides do, is fine: the Trainer is then made after the `with` block.

    Raises:
      ValueError: the context mesh is not the Trainer's.
    """
    context = jax.sharding.get_abstract_mesh()
    if context.empty or context == mesh.abstract_mesh:
        return
    raise ValueError(
        f"the Trainer is made inside a mesh context (jax.set_mesh or "
        f"jax.sharding.use_mesh) of {context}, under which its programs cannot run: they "
        f"run on the Trainer's own mesh {dict(mesh.shape)}. Make and run the Trainer after "
        "the `with` block (build only the model inside it), passing mesh= (a dict of axis "
        "sizes, or a Mesh with Auto axes) for a sharded Trainer"
    )
