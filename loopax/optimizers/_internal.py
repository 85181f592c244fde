"""The private helpers of `loopax.optimizers` that the floors above it use, in one place.

Not public API: it names, visibly, every helper the trainer, the loop and the hooks share with
the optimizers, so that no other package imports a private module of `loopax.optimizers` and a
change to one of these helpers shows whom it touches. Public names (`adam`,
`get_learning_rate`, ...) come from `loopax.optimizers` itself.
"""

from ._learning_rate import check_not_schedule as check_not_schedule
from ._learning_rate import constant_learning_rate as constant_learning_rate
from ._learning_rate import injected_hyperparameters as injected_hyperparameters
from ._learning_rate import injected_learning_rates as injected_learning_rates
from ._learning_rate import with_learning_rates as with_learning_rates
from ._schedule_values import schedule_name as schedule_name
from ._schedule_values import scheduled_learning_rates as scheduled_learning_rates
from ._schedule_values import update_count as update_count

__all__ = [
    "check_not_schedule",
    "constant_learning_rate",
    "injected_hyperparameters",
    "injected_learning_rates",
    "schedule_name",
    "scheduled_learning_rates",
    "update_count",
    "with_learning_rates",
]
