"""The few private helpers that `loopax.hooks` borrows from the floors below it, in one place.

Not public API: it names, visibly, every helper the ready hooks share with the loop, the
trainer and the data, so that hooks import nothing else private from another package and a
change to one of these helpers shows whom it touches. Public names (`Loop`, `Priority`,
`Trainer`, ...) come from the packages themselves.
"""

from ..data._internal import dataset_name as dataset_name
from ..data._internal import reads_a_copy as reads_a_copy
from ..trainer._internal import first_non_finite as first_non_finite
from ..trainer._internal import from_plain as from_plain
from ..trainer._internal import nest_paths as nest_paths
from ..trainer._internal import tree_paths as tree_paths
from ._history import train_key as train_key
from ._hook import FINISHED as FINISHED
from ._hook import NEVER as NEVER
from ._hook import AnyOf as AnyOf
from ._lost_report import note_checkpoint_directory as note_checkpoint_directory
from ._rate_check import SET_RATE_FIX as SET_RATE_FIX
from ._rate_check import rate_is as rate_is
from ._signals import SIGNALS as SIGNALS
from ._signals import exit_interrupted as exit_interrupted
from ._signals import signal_name as signal_name

__all__ = [
    "FINISHED",
    "NEVER",
    "SET_RATE_FIX",
    "SIGNALS",
    "AnyOf",
    "dataset_name",
    "exit_interrupted",
    "first_non_finite",
    "from_plain",
    "nest_paths",
    "note_checkpoint_directory",
    "rate_is",
    "reads_a_copy",
    "signal_name",
    "train_key",
    "tree_paths",
]
