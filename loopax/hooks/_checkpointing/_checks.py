"""Argument checks of the checkpoint hook: invalid configuration raises at attach time."""

from __future__ import annotations

from ...trainer import Trainer


def check_best_metric(best_metric: str | None, best_mode: str, trainer: Trainer) -> None:
    """Raises ValueError unless best_mode is min/max and best_metric names a known form."""
    if best_mode not in ("min", "max"):
        raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
    if best_metric is None:
        return
    parts = best_metric.split("/") if isinstance(best_metric, str) else []
    if parts[:1] == ["train"] and len(parts) == 2:
        if parts[1] not in trainer.train_metric_names:
            raise ValueError(
                f"best_metric {best_metric!r} names no train metric; the trainer's are "
                f"{list(trainer.train_metric_names)}"
            )
        return
    if parts[:1] == ["eval"] and len(parts) == 3 and all(parts):
        return
    raise ValueError(
        f"best_metric must be 'train/<metric>' (e.g. 'train/loss') or "
        f"'eval/<dataset>/<metric>' (e.g. 'eval/test/mean_loss'), got {best_metric!r}"
    )
