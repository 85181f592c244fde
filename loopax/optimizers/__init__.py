"""Optimizers, learning-rate schedules and run-time learning-rate control.

Every optimizer is a plain ``optax.GradientTransformation`` whose state carries its
learning rate (``get_learning_rate`` / ``set_learning_rate`` / ``scale_learning_rate``).
"""

from ._learning_rate import get_learning_rate as get_learning_rate
from ._learning_rate import scale_learning_rate as scale_learning_rate
from ._learning_rate import set_learning_rate as set_learning_rate
from ._optimizers import adam as adam
from ._optimizers import adamw as adamw
from ._optimizers import from_name as from_name
from ._optimizers import rmsprop as rmsprop
from ._optimizers import sgd as sgd
from ._schedules import constant_schedule as constant_schedule
from ._schedules import cosine_decay as cosine_decay
from ._schedules import exponential_decay as exponential_decay
from ._schedules import periodic_cosine as periodic_cosine
from ._schedules import schedule_from_name as schedule_from_name
from ._schedules import stepped as stepped
from ._schedules import warmup_cosine as warmup_cosine

__all__ = [
    "adam",
    "adamw",
    "constant_schedule",
    "cosine_decay",
    "exponential_decay",
    "from_name",
    "get_learning_rate",
    "periodic_cosine",
    "rmsprop",
    "schedule_from_name",
    "scale_learning_rate",
    "set_learning_rate",
    "sgd",
    "stepped",
    "warmup_cosine",
]
