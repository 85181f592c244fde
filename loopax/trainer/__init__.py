"""The `Trainer`: compiles and caches one data-parallel step per spec and input shape."""

import importlib
import warnings
from typing import Any

from ._context import Context as Context
from ._executors import ExecInfo as ExecInfo
from ._executors import Executor as Executor
from ._replicas import ReplicaMismatchError as ReplicaMismatchError
from ._state import TrainState as TrainState
from ._trainer import Trainer as Trainer

__all__ = [
    "Context",
    "ExecInfo",
    "Executor",
    "ReplicaMismatchError",
    "TrainState",
    "Trainer",
]

# Names that lived here before the Loop and the datasets got packages of their own:
# `loopax.trainer.Loop` keeps working, with a DeprecationWarning naming the new home.
_MOVED = {
    "ArrayDataset": "loopax.data",
    "Dataset": "loopax.data",
    "IterableDataset": "loopax.data",
    "Evaluation": "loopax.loop",
    "History": "loopax.loop",
    "Hook": "loopax.loop",
    "HookError": "loopax.loop",
    "Loop": "loopax.loop",
    "NonFiniteLossError": "loopax.loop",
    "Priority": "loopax.loop",
    "Schedule": "loopax.loop",
}


def __getattr__(name: str) -> Any:
    home = _MOVED.get(name)
    if home is None:
        raise AttributeError(f"module 'loopax.trainer' has no attribute {name!r}")
    warnings.warn(
        f"loopax.trainer.{name} moved to {home}.{name} (also loopax.{name}); import it from there",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(home), name)
