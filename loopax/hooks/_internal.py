"""The private helpers of `loopax.hooks` that `loopax.load_params` and its kin use, in one place.

Not public API: it names, visibly, every checkpoint helper the top-level parameter loaders
share with the hooks, so that no other module imports a private module of `loopax.hooks` and a
change to one of these helpers shows whom it touches. Public names (`Checkpointer`,
`DamagedCheckpointError`, ...) come from `loopax.hooks` itself.
"""

from ._checkpointing._active import wait_for_saves as wait_for_saves
from ._checkpointing._format import check_directory as check_directory
from ._checkpointing._io import open_manager as open_manager
from ._checkpointing._io import read as read
from ._checkpointing._io import read_newest_good as read_newest_good

__all__ = [
    "check_directory",
    "open_manager",
    "read",
    "read_newest_good",
    "wait_for_saves",
]
