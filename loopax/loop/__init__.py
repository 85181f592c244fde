"""The `Loop`: runs a `Trainer` over steps or epochs and fires prioritized hooks."""

from ._finite import NonFiniteLossError as NonFiniteLossError
from ._history import Evaluation as Evaluation
from ._history import History as History
from ._hook import Hook as Hook
from ._hook import HookError as HookError
from ._hook import Priority as Priority
from ._hook import RunInfo as RunInfo
from ._hook import Schedule as Schedule
from ._loop import Loop as Loop
from ._lost_report import LOST_PROCESS_EXIT as LOST_PROCESS_EXIT

__all__ = [
    "Evaluation",
    "History",
    "Hook",
    "HookError",
    "LOST_PROCESS_EXIT",
    "Loop",
    "NonFiniteLossError",
    "Priority",
    "RunInfo",
    "Schedule",
]
