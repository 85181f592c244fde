"""The Trainer's argument checks, and the metric names it reserves."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._host_metrics import is_host_metric
from ._steps import LOSS, LOSS_SCALE, MEAN_LOSS, MOVING_AVERAGE_LOSS, SKIPPED_STEPS

_METRIC_METHODS = ("init", "update", "merge", "compute")
# The names the step bodies give their own values; no user metric may take one.
RESERVED_TRAIN_NAMES = (LOSS, MOVING_AVERAGE_LOSS, SKIPPED_STEPS, LOSS_SCALE)
RESERVED_EVAL_NAMES = (MEAN_LOSS,)


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
