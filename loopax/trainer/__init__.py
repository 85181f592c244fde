"""Trainer, Loop, Context, datasets, the executor cache and the data-parallel step."""

from ._context import Context as Context
from ._datasets import ArrayDataset as ArrayDataset
from ._datasets import Dataset as Dataset
from ._datasets import IterableDataset as IterableDataset
from ._executors import ExecInfo as ExecInfo
from ._executors import Executor as Executor
from ._hooks import HookError as HookError
from ._hooks import Priority as Priority
from ._loop import Loop as Loop
from ._loop import NonFiniteLossError as NonFiniteLossError
from ._state import TrainState as TrainState
from ._trainer import Trainer as Trainer

__all__ = sorted([
    "ArrayDataset",
    "Context",
    "Dataset",
    "ExecInfo",
    "Executor",
    "HookError",
    "IterableDataset",
    "Loop",
    "NonFiniteLossError",
    "Priority",
    "TrainState",
    "Trainer",
])
