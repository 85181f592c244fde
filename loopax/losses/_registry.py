"""Selecting a loss by name, as in configuration files and command-line flags."""

from __future__ import annotations

import inspect
from typing import Any

from ._adaptive_power import adaptive_power_loss
from ._crossentropy import (
    binary_crossentropy,
    binary_crossentropy_logits,
    categorical_crossentropy,
    categorical_crossentropy_logits,
    sparse_categorical_crossentropy_logits,
)
from ._regression import huber, mean_absolute_error, mean_squared_error
from ._triplet import triplet
from ._weights import LossFn

# Losses that take no parameters, by short name (GoMLX's) and full function name.
_LOSSES: dict[str, LossFn] = {
    "mse": mean_squared_error,
    "mae": mean_absolute_error,
    "bin_cross": binary_crossentropy,
    "bin_cross_logits": binary_crossentropy_logits,
    "categorical_cross": categorical_crossentropy,
    "categorical_cross_logits": categorical_crossentropy_logits,
    "sparse_cross_logits": sparse_categorical_crossentropy_logits,
}
_LOSSES.update({loss_fn.__name__: loss_fn for loss_fn in list(_LOSSES.values())})

# Factories that build a loss from keyword parameters, by GoMLX's name and function name.
_FACTORIES = {
    "huber": huber,
    "apl": adaptive_power_loss,
    "adaptive_power_loss": adaptive_power_loss,
    "triplet": triplet,
}


def from_name(name: str, **kwargs: Any) -> LossFn:
    """Returns the loss called `name`, built with `kwargs` if it takes parameters.

    Valid names: "mse", "mae", "huber", "apl", "triplet", "bin_cross", "bin_cross_logits",
    "categorical_cross", "categorical_cross_logits", "sparse_cross_logits", and the full
    function names ("mean_squared_error", "adaptive_power_loss",
    "sparse_categorical_crossentropy_logits", ...).

    Args:
        name: the loss name (see above).
        **kwargs: parameters of a parameterized loss: `delta` for "huber"; `power_near`,
            `power_far`, `middle_delta`, `sharpness` for "apl"; `margin`, `distance`,
            `mining` for "triplet". Other losses take none.

    Returns:
        A LossFn `loss_fn(labels, predictions) -> scalar`.

    Raises:
        ValueError: if `name` is unknown (the message lists the valid names), or if
            `kwargs` are given to a loss that takes no parameters or are invalid for it.

    Example:
        >>> import jax.numpy as jnp
        >>> from loopax.losses import from_name, mean_squared_error
        >>> from_name("mse") is mean_squared_error
        True
        >>> loss_fn = from_name("huber", delta=2.0)
        >>> float(loss_fn([jnp.array([0.0])], [jnp.array([1.0])]))
        0.5
        >>> from_name("apl", power_near=3.0).__name__
        'adaptive_power_loss'
        >>> from_name("triplet", nargin=1.0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: loss 'triplet': invalid parameters {'nargin': 1.0}: ...; valid ones are: ...
    """
    if name in _FACTORIES:
        try:
            return _FACTORIES[name](**kwargs)
        except TypeError as err:
            valid = ", ".join(inspect.signature(_FACTORIES[name]).parameters)
            raise ValueError(
                f"loss {name!r}: invalid parameters {kwargs}: {err}; valid ones are: {valid}"
            ) from err
    if name in _LOSSES:
        if kwargs:
            raise ValueError(
                f"loss {name!r} takes no parameters, got {sorted(kwargs)}; "
                f"the parameterized ones are: {', '.join(sorted(_FACTORIES))}"
            )
        return _LOSSES[name]
    valid = ", ".join(repr(valid_name) for valid_name in sorted({*_LOSSES, *_FACTORIES}))
    raise ValueError(f"unknown loss name {name!r}; valid names are: {valid}")
