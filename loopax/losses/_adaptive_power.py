"""GoMLX's adaptive power loss: `|error| ** power`, the power depending on the error.

The power moves smoothly from `power_near` for small errors to `power_far` for large ones.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from ._regression import _elementwise_loss
from ._weights import LossFn

# GoMLX clips the normalized error to these before taking its log (its Epsilon32/64).
_LOG_EPSILON = {jnp.dtype(jnp.float32): 1e-7, jnp.dtype(jnp.float64): 1e-8}


def _check_positive(argument: str, value: float) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or not value > 0
    ):
        raise ValueError(
            f"adaptive_power_loss: {argument}={value!r} must be a positive finite number; "
            "GoMLX's defaults are power_near=2.0, power_far=1.0, middle_delta=1.0, "
            "sharpness=1.0"
        )
    return float(value)


def adaptive_power_loss(
    *,
    power_near: float = 2.0,
    power_far: float = 1.0,
    middle_delta: float = 1.0,
    sharpness: float = 1.0,
) -> LossFn:
    """Returns GoMLX's adaptive power loss ("apl"): `|error| ** power(|error|)`.

    Per element, with `d = abs(labels[0] - predictions[0])`:

    - `s = log(max(d / middle_delta, eps)) * abs(power_near - power_far) / sharpness`
      (`eps` is 1e-7 in float32, 1e-8 in float64),
    - `power = power_near + (power_far - power_near) * sigmoid(s)`,
    - `loss = d ** stop_gradient(power)`.

    So the loss tends to `d ** power_near` for errors much smaller than `middle_delta`, to
    `d ** power_far` for errors much larger, and is `d ** ((power_near + power_far) / 2)`
    at `d == middle_delta`; `sharpness` sets how sudden the change is. The power is a
    constant for the gradient, as in GoMLX. With `power_near=2, power_far=1` it behaves
    like a Huber loss. When both powers are equal the loss is `d ** power_near`.

    GoMLX scales `s` by `(power_near - power_far)`, not its absolute value, which swaps
    the near and far regimes when `power_near < power_far`; loopax follows GoMLX's
    documented behaviour in that case too (it is identical when `power_near > power_far`).

    Args:
        power_near: the power for errors much smaller than `middle_delta`; positive (below
            1 the gradient at a zero error is infinite).
        power_far: the power for errors much larger than `middle_delta`; positive.
        middle_delta: the error at which the power is half-way between the two; positive.
        sharpness: how slowly the power changes with `log(d)`; positive (smaller is
            sharper).

    Returns:
        A LossFn `loss_fn(labels, predictions) -> scalar`: the mean over elements. Extra
        labels may be a bool mask and/or float weights of the labels' shape or `[batch]`.

    Raises:
        ValueError: if a parameter is not a positive finite number (raised here, not when
            the loss runs).

    Example:
        >>> import jax.numpy as jnp
        >>> from loopax.losses import adaptive_power_loss
        >>> loss_fn = adaptive_power_loss(power_near=3.0, power_far=1.0, middle_delta=10.0)
        >>> float(loss_fn([jnp.array([0.0])], [jnp.array([10.0])]))  # 10 ** ((3 + 1) / 2)
        100.0
        >>> round(float(loss_fn([jnp.array([0.0])], [jnp.array([0.1])])), 6)  # ~0.1 ** 3
        0.001
    """
    power_near = _check_positive("power_near", power_near)
    power_far = _check_positive("power_far", power_far)
    middle_delta = _check_positive("middle_delta", middle_delta)
    sharpness = _check_positive("sharpness", sharpness)
    slope = abs(power_near - power_far) / sharpness

    def per_element(error: jax.Array) -> jax.Array:
        delta = jnp.abs(error)
        if power_near == power_far:
            return delta**power_near
        epsilon = _LOG_EPSILON.get(jnp.dtype(delta.dtype), 1e-7)
        scaled_log = jnp.log(jnp.maximum(delta / middle_delta, epsilon)) * slope
        # jax.nn.sigmoid is stable for large |scaled_log| in both directions.
        power = power_near + (power_far - power_near) * jax.nn.sigmoid(scaled_log)
        return delta ** jax.lax.stop_gradient(power)

    def apl(labels: Sequence[jax.Array], predictions: Sequence[jax.Array]) -> jax.Array:
        return _elementwise_loss("adaptive_power_loss", labels, predictions, per_element)

    apl.__name__ = apl.__qualname__ = "adaptive_power_loss"
    apl.__doc__ = (
        f"Adaptive power loss with power_near={power_near:g}, power_far={power_far:g}, "
        f"middle_delta={middle_delta:g}, sharpness={sharpness:g} "
        "(see `loopax.losses.adaptive_power_loss`)."
    )
    return apl
