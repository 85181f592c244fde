"""loopax: a hook-driven training loop for JAX/Flax, modeled on GoMLX's `train`.

A `Trainer` compiles and caches one data-parallel step per dataset spec and input
shape; a `Loop` runs steps or epochs and fires prioritized hooks. The subpackages
`hooks`, `losses`, `metrics` and `optimizers` hold the ready-made parts; `testing`
helps test code built on them.
"""

import importlib
import types
from typing import TYPE_CHECKING

from ._compilation_cache import set_compilation_cache as set_compilation_cache
from ._params import load_into as load_into
from ._params import load_params as load_params
from ._params import load_variables as load_variables
from ._public import show_errors_under
from .data import ArrayDataset as ArrayDataset
from .data import Dataset as Dataset
from .data import IterableDataset as IterableDataset
from .loop import LOST_PROCESS_EXIT as LOST_PROCESS_EXIT
from .loop import Evaluation as Evaluation
from .loop import History as History
from .loop import Hook as Hook
from .loop import HookError as HookError
from .loop import Loop as Loop
from .loop import NonFiniteLossError as NonFiniteLossError
from .loop import Priority as Priority
from .loop import Schedule as Schedule
from .trainer import Context as Context
from .trainer import ExecInfo as ExecInfo
from .trainer import Executor as Executor
from .trainer import ReplicaMismatchError as ReplicaMismatchError
from .trainer import Trainer as Trainer
from .trainer import TrainState as TrainState

if TYPE_CHECKING:  # at run time they load on first use, in __getattr__ below
    from . import hooks, losses, metrics, optimizers, testing

__version__ = "0.1.0"

_SUBPACKAGES = ("hooks", "losses", "metrics", "optimizers", "testing")


def __getattr__(name: str) -> types.ModuleType:
    # Subpackages load on first use, so `import loopax` stays light (no Orbax or
    # TensorBoard import until a hook needs them).
    if name in _SUBPACKAGES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'loopax' has no attribute {name!r}")


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
    "LOST_PROCESS_EXIT",
    "Loop",
    "NonFiniteLossError",
    "Priority",
    "ReplicaMismatchError",
    "Schedule",
    "TrainState",
    "Trainer",
    "hooks",
    "load_into",
    "load_params",
    "load_variables",
    "losses",
    "metrics",
    "optimizers",
    "set_compilation_cache",
    "testing",
]

show_errors_under(__name__, globals())  # `loopax.HookError: ...` in a traceback
