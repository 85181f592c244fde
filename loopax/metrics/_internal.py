"""The private helpers of `loopax.metrics` that the floors above it use, in one place.

Not public API: it names, visibly, every helper the trainer shares with the metrics, so that
no other package imports a private module of `loopax.metrics` and a change to one of these
helpers shows whom it touches. Public names (`Mean`, `MeanState`, ...) come from
`loopax.metrics` itself.
"""

from ._host import is_host_metric as is_host_metric
from ._loss_average import LossMovingAverage as LossMovingAverage
from ._mean import add_mean_states as add_mean_states
from ._mean import batch_size_of as batch_size_of
from ._mean import mean_of as mean_of
from ._mean import zero_mean_state as zero_mean_state

__all__ = [
    "LossMovingAverage",
    "add_mean_states",
    "batch_size_of",
    "is_host_metric",
    "mean_of",
    "zero_mean_state",
]
