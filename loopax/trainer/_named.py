"""A compiled program's values as the Trainer's metrics dict: where names meet values."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._host_metrics import HostMetrics


def named_metrics(
    names: Sequence[str], values: Sequence[Any], host: HostMetrics | None
) -> dict[str, Any]:
    """`{name: value}` of one step's (or the running eval) values, in the order of `names`.

    With host metrics (`host`, None when there are none) their step values wait, unread,
    behind values that read them when asked (see `_host_metrics`).
    """
    if host is not None:
        return host.results(names, values)
    return dict(zip(names, values, strict=True))


def fused_metrics(
    names: Sequence[str], values: Any, host: HostMetrics | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """`(stacked, last)` of a fused program's `(stacked, last, host values)`.

    A host metric's entry is the same in both: its value after the steps.
    """
    stacked, last, host_values = values
    if host is None:
        return dict(zip(names, stacked, strict=True)), dict(zip(names, last, strict=True))
    last_metrics = named_metrics(names, (*last, *host_values), host)
    compiled = iter(stacked)
    stacked_metrics = {
        name: last_metrics[name] if name in host.names else next(compiled) for name in names
    }
    return stacked_metrics, last_metrics
