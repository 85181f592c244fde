"""Metrics for the train and eval steps.

A metric is a `Metric` object with pure functions over a pytree state, computed inside
the compiled step (see `Metric`), or a `HostMetric`, whose values leave the compiled step
unread and are folded into a host-side state only when something reads the metric.
Built-ins: `Mean` and `MovingAverage` over any `fn(labels, predictions)`, the accuracies
`SparseCategoricalAccuracy`, `BinaryAccuracy`, `BinaryLogitsAccuracy` with their
`MovingAverage...` variants, and the host metrics `StreamingMedian` (with `median_loss`) and
`SampledSet` (a uniform sample of examples' values, e.g. predictions beside their labels).
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
from ._host import HostMetric as HostMetric
from ._mean import Mean as Mean
from ._mean import MeanState as MeanState
from ._mean import MovingAverage as MovingAverage
from ._mean import MovingAverageState as MovingAverageState
from ._median import StreamingMedian as StreamingMedian
from ._median import StreamingMedianState as StreamingMedianState
from ._median import median_loss as median_loss
from ._sampled import Sample as Sample
from ._sampled import SampledSet as SampledSet
from ._sampled import SampledSetState as SampledSetState

__all__ = [
    "BinaryAccuracy",
    "BinaryLogitsAccuracy",
    "HostMetric",
    "Mean",
    "MeanState",
    "Metric",
    "MovingAverage",
    "MovingAverageBinaryAccuracy",
    "MovingAverageBinaryLogitsAccuracy",
    "MovingAverageSparseCategoricalAccuracy",
    "MovingAverageState",
    "Sample",
    "SampledSet",
    "SampledSetState",
    "SparseCategoricalAccuracy",
    "StreamingMedian",
    "StreamingMedianState",
    "format_number",
    "format_percent",
    "median_loss",
]
