"""Metrics computed inside the compiled train and eval steps.

A metric is a `Metric` object with pure functions over a pytree state (see `Metric`).
Built-ins: `Mean` and `MovingAverage` over any `fn(labels, predictions)`, and the
accuracies `SparseCategoricalAccuracy`, `BinaryAccuracy`, `BinaryLogitsAccuracy` with
their `MovingAverage...` variants.
"""

from ._accuracy import BinaryAccuracy as BinaryAccuracy
from ._accuracy import BinaryLogitsAccuracy as BinaryLogitsAccuracy
from ._accuracy import MovingAverageBinaryAccuracy as MovingAverageBinaryAccuracy
from ._accuracy import MovingAverageBinaryLogitsAccuracy as MovingAverageBinaryLogitsAccuracy
from ._accuracy import (
    MovingAverageSparseCategoricalAccuracy as MovingAverageSparseCategoricalAccuracy,
)
from ._accuracy import SparseCategoricalAccuracy as SparseCategoricalAccuracy
from ._base import Metric as Metric
from ._base import format_number as format_number
from ._base import format_percent as format_percent
from ._mean import Mean as Mean
from ._mean import MeanState as MeanState
from ._mean import MovingAverage as MovingAverage
from ._mean import MovingAverageState as MovingAverageState

__all__ = [
    "BinaryAccuracy",
    "BinaryLogitsAccuracy",
    "Mean",
    "MeanState",
    "Metric",
    "MovingAverage",
    "MovingAverageBinaryAccuracy",
    "MovingAverageBinaryLogitsAccuracy",
    "MovingAverageSparseCategoricalAccuracy",
    "MovingAverageState",
    "SparseCategoricalAccuracy",
    "format_number",
    "format_percent",
]
