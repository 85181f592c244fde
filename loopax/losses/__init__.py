"""Loss functions: `loss_fn(labels, predictions) -> scalar`, on lists of arrays.

Each loss uses `labels[0]` and `predictions[0]`. Extra labels may be a boolean mask and/or
float weights (any order): the per-element loss is multiplied by the weights, and with a mask
the mean is over the masked-in entries only (0 when none is). Losses compute in float32 and
return the predictions' dtype.

Every loss returns that scalar (the mean over elements, or over examples for the categorical
losses) and raises `ValueError`, naming itself, when the labels' and predictions' shapes do not
fit or an extra label has an unexpected shape or dtype.
"""

from ._adaptive_power import adaptive_power_loss as adaptive_power_loss
from ._crossentropy import binary_crossentropy as binary_crossentropy
from ._crossentropy import binary_crossentropy_logits as binary_crossentropy_logits
from ._crossentropy import categorical_crossentropy as categorical_crossentropy
from ._crossentropy import categorical_crossentropy_logits as categorical_crossentropy_logits
from ._crossentropy import (
    sparse_categorical_crossentropy_logits as sparse_categorical_crossentropy_logits,
)
from ._registry import from_name as from_name
from ._regression import huber as huber
from ._regression import mean_absolute_error as mean_absolute_error
from ._regression import mean_squared_error as mean_squared_error
from ._triplet import triplet as triplet

__all__ = [
    "adaptive_power_loss",
    "binary_crossentropy",
    "binary_crossentropy_logits",
    "categorical_crossentropy",
    "categorical_crossentropy_logits",
    "from_name",
    "huber",
    "mean_absolute_error",
    "mean_squared_error",
    "sparse_categorical_crossentropy_logits",
    "triplet",
]
