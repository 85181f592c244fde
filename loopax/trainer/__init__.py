"""Trainer, Loop, Context, datasets, the executor cache and the data-parallel step."""

from ._context import Context as Context
from ._datasets import ArrayDataset as ArrayDataset
from ._datasets import Dataset as Dataset
from ._executors import ExecInfo as ExecInfo
from ._executors import Executor as Executor
from ._finite import NonFiniteLossError as NonFiniteLossError
from ._history import Evaluation as Evaluation
from ._history import History as History
from ._hooks import Hook as Hook
from ._hooks import HookError as HookError
from ._hooks import Priority as Priority
from ._hooks import Schedule as Schedule
from ._iterables import IterableDataset as IterableDataset
from ._loop import Loop as Loop
from ._state import TrainState as TrainState
from ._trainer import Trainer as Trainer

__all__ = [
    "ArrayDataset",
    "Context",
    "Dataset",
    "Evaluation",
    "ExecInfo",
    "Executor",
    "History",
    "Hook",
    "HookError",
    "IterableDataset",
    "Loop",
    "NonFiniteLossError",
    "Priority",
    "Schedule",
    "TrainState",
    "Trainer",
]
