"""How the observability hooks name, group and print each train and eval metric.

Every point is keyed `"train/<metric>"` or `"eval/<dataset>/<metric>"` (see
`loopax.History`); `describe_key` tells how to show one. The trainer's built-in metrics
(`loss`, `moving_average_loss`, `skipped_steps`, `mean_loss`) are not `Metric` objects, so
their display names, short names and types (GoMLX's) are given here; user metrics describe
themselves. Also the one rule every writing hook shares: only process 0 writes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from ..metrics import format_number
from ..trainer import Trainer

LOSS_METRIC_TYPE = "loss"

# key -> (display name, short name); GoMLX's names for its built-in loss metrics.
_BUILTINS = {
    "loss": ("Batch Loss", "batch"),
    "moving_average_loss": ("Moving Average Loss", "~loss"),
    "mean_loss": ("Mean Loss", "#loss"),
    "skipped_steps": ("Skipped Steps", "skipped"),
    "overflow_steps": ("Overflow Steps", "overflows"),
    "learning_rate": ("Learning Rate", "lr"),
    "loss_scale": ("Loss Scale", "scale"),
    "steps_per_second": ("Steps per Second", "steps/s"),
    "examples_per_second": ("Examples per Second", "ex/s"),
    "flops_per_step": ("FLOPs per Step", "flops"),
    "mfu": ("Model FLOPs Utilization", "mfu"),
}
_BUILTIN_TYPES = {
    "skipped_steps": "count",
    "overflow_steps": "count",
    "learning_rate": "learning_rate",
    "loss_scale": "loss_scale",
    "steps_per_second": "throughput",
    "examples_per_second": "throughput",
    "flops_per_step": "flops",
    "mfu": "utilization",
}


@dataclasses.dataclass(frozen=True)
class MetricInfo:
    """What hooks need to show one metric.

    Attributes:
      key: the key in the trainer's metrics dict (`"loss"`, `"Accuracy"`, ...).
      name: the display name (`"Batch Loss"`; the key for user metrics).
      short_name: for compact displays (`"~loss"`, `"acc"`).
      metric_type: metrics of the same type share a plot (`"loss"`, `"accuracy"`).
      pretty_print: formats a value for people (`0.123`, `93.41%`).
    """

    key: str
    name: str
    short_name: str
    metric_type: str
    pretty_print: Callable[[Any], str]


def _describe(key: str, metric: Any | None) -> MetricInfo:
    if metric is None:
        name, short_name = _BUILTINS.get(key, (key, key))
        metric_type = _BUILTIN_TYPES.get(key, LOSS_METRIC_TYPE)
        return MetricInfo(key, name, short_name, metric_type, format_number)
    short_name = getattr(metric, "short_name", None) or key
    metric_type = getattr(metric, "metric_type", "") or key
    pretty_print = getattr(metric, "pretty_print", None) or format_number
    return MetricInfo(key, key, short_name, metric_type, pretty_print)


def train_metric_infos(trainer: Trainer) -> tuple[MetricInfo, ...]:
    """Describes the trainer's train metrics, in the order `train_step` returns them."""
    by_name = {metric.name: metric for metric in trainer.train_metrics}
    return tuple(_describe(key, by_name.get(key)) for key in trainer.train_metric_names)


def eval_metric_infos(trainer: Trainer) -> tuple[MetricInfo, ...]:
    """Describes the trainer's eval metrics, in the order `evaluate` returns them."""
    by_name = {metric.name: metric for metric in trainer.eval_metrics}
    return tuple(_describe(key, by_name.get(key)) for key in trainer.eval_metric_names)


def describe_key(trainer: Trainer, key: str) -> MetricInfo:
    """Describes the metric behind a key `"train/<metric>"` or `"eval/<dataset>/<metric>"`.

    Example:
      >>> import loopax, optax, jax
      >>> trainer = loopax.Trainer(lambda ctx, spec, x: x[0], None, optax.sgd(0.1),
      ...     eval_metrics=[loopax.metrics.SparseCategoricalAccuracy()], devices=jax.devices()[:1])
      >>> describe_key(trainer, "eval/test/Accuracy").metric_type
      'accuracy'
      >>> describe_key(trainer, "train/moving_average_loss").short_name
      '~loss'
    """
    kind, _, rest = key.partition("/")
    if kind == "eval":
        by_name = {metric.name: metric for metric in trainer.eval_metrics}
        for name in (*trainer.eval_metric_names, *_BUILTINS):
            if rest.endswith("/" + name):
                return _describe(name, by_name.get(name))
    elif kind == "train":
        by_name = {metric.name: metric for metric in trainer.train_metrics}
        return _describe(rest, by_name.get(rest))
    return MetricInfo(key, key, key.rsplit("/", 1)[-1], key.rsplit("/", 1)[-1], format_number)


def split_eval_key(trainer: Trainer, key: str) -> tuple[str, str] | None:
    """`(dataset, metric)` of an `"eval/<dataset>/<metric>"` key, else None.

    The key must name one of the trainer's eval metrics (dataset names may hold `/`).
    """
    if not key.startswith("eval/"):
        return None
    rest = key[len("eval/") :]
    for name in trainer.eval_metric_names:
        if rest.endswith("/" + name) and len(rest) > len(name) + 1:
            return rest[: -len(name) - 1], name
    return None


def is_writer_process() -> bool:
    """Whether this process writes logs, plots and progress: only process 0 does."""
    return jax.process_index() == 0
