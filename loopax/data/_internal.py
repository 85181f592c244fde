"""The private helpers of `loopax.data` that the floors above it use, in one place.

Not public API: it names, visibly, every helper the trainer, the loop and the hooks share with
the data, so that no other package imports a private module of `loopax.data` and a change to
one of these helpers shows whom it touches. Public names (`Dataset`, `ArrayDataset`, ...) come
from `loopax.data` itself.
"""

from ._datasets import BadBatchError as BadBatchError
from ._datasets import as_list as as_list
from ._datasets import dataset_name as dataset_name
from ._datasets import read_batches as read_batches
from ._datasets import shown_name as shown_name
from ._device_data import DeviceChunk as DeviceChunk
from ._epoch_rows import Reading as Reading
from ._epoch_rows import rows_at as rows_at
from ._epoch_rows import rows_of as rows_of
from ._iterables import RunIterable as RunIterable
from ._iterables import check_restartable as check_restartable
from ._iterables import evaluation_dataset as evaluation_dataset
from ._iterables import is_dataset as is_dataset
from ._iterables import reads_a_copy as reads_a_copy
from ._reader import Dispatch as Dispatch
from ._reader import OnDevice as OnDevice
from ._reader import OneStep as OneStep
from ._reader import Stacked as Stacked
from ._reader import StepReader as StepReader
from ._reader import group_sizes as group_sizes
from ._reader import power_of_two_at_most as power_of_two_at_most
from ._reader import with_count as with_count

__all__ = [
    "BadBatchError",
    "DeviceChunk",
    "Dispatch",
    "OnDevice",
    "OneStep",
    "Reading",
    "RunIterable",
    "StepReader",
    "Stacked",
    "as_list",
    "check_restartable",
    "dataset_name",
    "evaluation_dataset",
    "group_sizes",
    "is_dataset",
    "power_of_two_at_most",
    "read_batches",
    "reads_a_copy",
    "rows_at",
    "rows_of",
    "shown_name",
    "with_count",
]
