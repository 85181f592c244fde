"""A compiled program's values as the Trainer's metrics dict, in the documented order.

The step bodies return their values by name; a compiled program hands a dict back with its
keys sorted, so the order users see (`"loss"`, `"moving_average_loss"`, then their metrics)
is rebuilt here, once per call, from the names the `StepBuilder` keeps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ._host_metrics import HostMetrics


def named_metrics(
    names: Sequence[str], values: Mapping[str, Any], host: HostMetrics | None
) -> dict[str, Any]:
    """`{name: value}` of one step's (or the running eval) values, in the order of `names`.

    With host metrics (`host`, None when there are none) their step values wait, unread,
    behind values that read them when asked (see `_host_metrics`).
    """
    if host is not None:
        return host.results(names, values)
    return {name: values[name] for name in names}


def fused_metrics(
    names: Sequence[str], values: Any, host: HostMetrics | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """`(stacked, last)` of a fused program's `(stacked, last)` values.

    A host metric's entry is the same in both: its value after the steps (its step values
    of all the steps come folded into one in `last`).
    """
    stacked, last = values
    last_metrics = named_metrics(names, last, host)
    stacked_metrics = {
        name: stacked[name] if name in stacked else last_metrics[name] for name in names
    }
    return stacked_metrics, last_metrics
