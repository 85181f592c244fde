"""The train step's optional values: a loss's auxiliary outputs and the gradient norms.

A loss function may return `(loss, {name: value, ...})` (as a function for
`jax.value_and_grad(..., has_aux=True)` does); each value becomes the train metric `name`.
With `Trainer(log_grad_norm=True)` the step also returns the global L2 norms of the
gradients and of the update. Both are computed inside the compiled step, and neither adds
an output when unused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp


def aux_outputs(loss_name: str, aux: Mapping[Any, Any], taken: tuple[str, ...]) -> dict:
    """A loss function's auxiliary outputs as `{name: float32 scalar}`, checked.

    Each value is mean-reduced, as the loss is. Called while tracing.

    Args:
      loss_name: the loss function's name, for messages.
      aux: what the loss function returned beside the loss.
      taken: the train step's other metric names.

    Raises:
      TypeError: a name is not a string, or a value not an array or number.
      ValueError: a name is empty, holds "/" or is another train metric's.
    """
    result = {}
    for name, value in aux.items():
        if not isinstance(name, str) or not name or "/" in name:
            raise (ValueError if isinstance(name, str) else TypeError)(
                f"loss function {loss_name!r} returned an auxiliary output named {name!r}; "
                "names must be non-empty strings without '/' (each becomes the train "
                "metric train/<name>)"
            )
        if name in taken:
            raise ValueError(
                f"loss function {loss_name!r} returned an auxiliary output named {name!r}, "
                f"which is already a train metric of this trainer ({list(taken)}); rename it"
            )
        try:
            array = jnp.asarray(value)
        except TypeError:
            array = None
        if array is None or not (
            jnp.issubdtype(array.dtype, jnp.number) or array.dtype == jnp.bool_
        ):
            raise TypeError(
                f"loss function {loss_name!r} returned the auxiliary output {name!r} as a "
                f"{type(value).__name__}; each must be a number or an array (a scalar, or "
                "per-example values, which are averaged)"
            )
        result[name] = jnp.mean(array.astype(jnp.float32))
    return result


def may_return_aux(loss_fn: Any) -> bool:
    """Whether `loss_fn` may return auxiliary outputs, which only a trace of it shows.

    No loss function (the model adds its losses) returns none, nor does any of
    `loopax.losses`: each returns one array, as that package documents.
    """
    if loss_fn is None:
        return False
    module = getattr(loss_fn, "__module__", None) or ""
    return not (module == "loopax.losses" or module.startswith("loopax.losses."))


def aux_names(previous: tuple[str, ...], aux: Mapping[str, Any]) -> tuple[str, ...]:
    """The names of the auxiliary outputs a train step returns, checked against `previous`.

    Raises:
      ValueError: an earlier trace (another batch shape or spec) returned other names.
    """
    names = tuple(aux)
    if previous and names != previous:
        raise ValueError(
            f"the loss function's auxiliary outputs changed from {list(previous)} "
            f"to {list(names)} for another batch shape or spec; return the same names "
            "for every batch (they are the train metrics train/<name>)"
        )
    return names


def global_norm(tree: Any) -> jax.Array:
    """The L2 norm of all of `tree`'s leaves together, in float32 (`optax.tree.norm`)."""
    leaves = jax.tree.leaves(tree)
    total = sum((jnp.sum(jnp.square(leaf.astype(jnp.float32))) for leaf in leaves), jnp.float32(0))
    return jnp.sqrt(total)
