"""Helpers for testing code built on loopax and JAX.

`count_compilations()` counts the XLA compilations a block of code causes, e.g. to check
that a second training step compiles nothing. `multiprocess(n, devices_per_process, fn)`
runs a function in n JAX processes on this machine, joined as on a cluster, each with its
own simulated CPU devices; `Processes` is the same group for tests that act on the
processes while they run (e.g. signal one).
"""

from ._compilations import Compilations as Compilations
from ._compilations import count_compilations as count_compilations
from ._multiprocess import MultiprocessError as MultiprocessError
from ._multiprocess import Processes as Processes
from ._multiprocess import ProcessResult as ProcessResult
from ._multiprocess import free_port as free_port
from ._multiprocess import multiprocess as multiprocess

__all__ = [
    "Compilations",
    "MultiprocessError",
    "ProcessResult",
    "Processes",
    "count_compilations",
    "free_port",
    "multiprocess",
]

MultiprocessError.__module__ = __name__  # shown as loopax.testing.MultiprocessError
