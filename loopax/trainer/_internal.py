"""The private helpers of `loopax.trainer` that the floors above it use, in one place.

Not public API: it names, visibly, every helper the loop, the hooks and `loopax.load_into`
share with the trainer, so that no other package imports a private module of `loopax.trainer`
and a change to one of these helpers shows whom it touches. Public names (`Trainer`,
`TrainState`, ...) come from `loopax.trainer` itself.
"""

from ._inflight import InFlight as InFlight
from ._inflight import limit_for as limit_for
from ._models import load_nnx_variables as load_nnx_variables
from ._state import first_non_finite as first_non_finite
from ._state import from_plain as from_plain
from ._state import nest_paths as nest_paths
from ._state import overflow_steps as overflow_steps
from ._state import skipped_steps as skipped_steps
from ._state import tree_paths as tree_paths
from ._steps import MOVING_AVERAGE_LOSS as MOVING_AVERAGE_LOSS
from ._steps import OVERFLOW_STEPS as OVERFLOW_STEPS
from ._steps import SKIPPED_STEPS as SKIPPED_STEPS

__all__ = [
    "MOVING_AVERAGE_LOSS",
    "OVERFLOW_STEPS",
    "SKIPPED_STEPS",
    "InFlight",
    "first_non_finite",
    "from_plain",
    "limit_for",
    "load_nnx_variables",
    "nest_paths",
    "overflow_steps",
    "skipped_steps",
    "tree_paths",
]
