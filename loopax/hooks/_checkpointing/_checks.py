"""The checkpoint hook's best metric: checked at attach time, read for each save."""

from __future__ import annotations

import functools
import math

from ...loop import Loop
from ...trainer import Trainer
from .._aux_keys import awaits_aux_names, check_at_first_step
from .._metric_info import split_eval_key


def check_best_metric(best_metric: str | None, best_mode: str, loop: Loop) -> None:
    """Raises ValueError unless best_mode is min/max and best_metric names a known form.

    A `"train/<name>"` that may be a loss's auxiliary output (its names are known only once
    a train step is compiled) is checked after the first step instead (`_aux_keys`).
    """
    if best_mode not in ("min", "max"):
        raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
    if best_metric is None:
        return
    parts = best_metric.split("/") if isinstance(best_metric, str) else []
    if parts[:1] == ["train"] and len(parts) == 2:
        if awaits_aux_names(loop.trainer, best_metric):
            check = functools.partial(_check_train_metric, best_metric, loop.trainer)
            check_at_first_step(loop, "checkpoint", check)
        else:
            _check_train_metric(best_metric, loop.trainer)
        return
    if parts[:1] == ["eval"] and len(parts) == 3 and all(parts):
        return
    raise ValueError(
        f"best_metric must be 'train/<metric>' (e.g. 'train/loss') or "
        f"'eval/<dataset>/<metric>' (e.g. 'eval/test/mean_loss'), got {best_metric!r}"
    )


def _check_train_metric(best_metric: str, trainer: Trainer) -> None:
    if best_metric.split("/", 1)[1] not in trainer.train_metric_names:
        raise ValueError(
            f"best_metric {best_metric!r} names no train metric; the trainer's are "
            f"{list(trainer.train_metric_names)}"
        )


def best_metric_value(loop: Loop, best_metric: str | None, step: int) -> float | None:
    """The value of `best_metric` that ranks the save of global step `step`, or None.

    An evaluation's, or a train metric's, from `loop.history` at that step; a train metric
    no writer logged there is read from the step's metrics. None when there is none, or it
    is not finite (such a save counts only for `keep` and `keep_period`).
    """
    if best_metric is None:
        return None
    value = loop.history.value_at(best_metric, step)
    if value is None and split_eval_key(loop.trainer, best_metric) is None:
        metric = best_metric.split("/", 1)[1]
        if loop.metrics and loop.trainer.global_step == step:
            value = loop.host_metrics().get(metric)
    if value is None or not math.isfinite(value):
        return None
    return float(value)
