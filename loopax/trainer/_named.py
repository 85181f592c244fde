"""A compiled program's values as the Trainer's metrics dict, in the documented order.

The step bodies return their values by name; a compiled program hands a dict back with its
keys sorted, so the order users see (`"loss"`, `"moving_average_loss"`, then their metrics)
is rebuilt here, once per call, from the names the `StepBuilder` keeps. Fused steps return
a `StepResult`, inside the program and out of it: one record, one order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, cast

from ._host_metrics import HostMetrics


class StepResult(NamedTuple):
    """What `Trainer.run` returns: the metrics of a dispatch's steps.

    Fused steps' body (`StepBuilder.scan_steps`) returns its values as one too, by metric
    name, before they are named and ordered here.

    Attributes:
      last: the last step's metrics, as `train_step` returns them (on the device).
      stacked: every step's metrics with a leading axis of the steps, or None for a
        dispatch of one step (its `last` are its own).
    """

    last: dict[str, Any]
    stacked: dict[str, Any] | None = None


def named_metrics(
    names: Sequence[str], values: Mapping[str, Any], host: HostMetrics | None
) -> dict[str, Any]:
    """`{name: value}` of one step's (or the running eval) values, in the order of `names`.

    With host metrics (`host`, None when there are none) their step values wait, unread,
    behind values that read them when asked (see `_host_metrics`).
    """
    if host is not None:
        return host.results(names, values)
    # `{name: values[name] for name in names}` without the comprehension's Python call: a
    # per-step run builds one of these every step.
    return dict(zip(names, map(values.__getitem__, names), strict=True))


def fused_metrics(names: Sequence[str], values: StepResult, host: HostMetrics | None) -> StepResult:
    """A fused program's `values` (`scan_steps`'), named and ordered as `names`.

    A host metric's entry is the same in `last` and `stacked`: its value after the steps
    (its step values of all the steps come folded into one in `values.last`).
    """
    last = named_metrics(names, values.last, host)
    stacked = cast("dict[str, Any]", values.stacked)  # a fused program's: never None
    return StepResult(
        last, {name: stacked[name] if name in stacked else last[name] for name in names}
    )
