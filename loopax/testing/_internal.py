"""The private helpers of `loopax.testing` that loopax's own test suite uses, in one place.

Not public API: the suite starts `multiprocess`'s processes from a pre-imported fork server
rather than fresh interpreters, and counts device reads as an accelerator pays them, through
this seam alone. Public names (`multiprocess`, `Processes`, ...) come from `loopax.testing`
itself.
"""

from .._devices import host_copies_started_on_cpu as host_copies_started_on_cpu
from ._multiprocess import BOOTSTRAP as BOOTSTRAP
from ._multiprocess import starting_processes_with as starting_processes_with

__all__ = [
    "BOOTSTRAP",
    "host_copies_started_on_cpu",
    "starting_processes_with",
]
