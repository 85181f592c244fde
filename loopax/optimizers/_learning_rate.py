"""Reading and replacing the injected learning rate inside an optimizer state.

Optimizers built with ``optax.inject_hyperparams`` (every loopax optimizer) keep their
learning rate as an array in ``opt_state.hyperparams["learning_rate"]``. Replacing that
array with another of the same shape and dtype changes the learning rate of the next
update without recompiling a step that takes the optimizer state as input.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

_LEARNING_RATE = "learning_rate"


def _has_hyperparams(node: Any) -> bool:
    return (
        isinstance(getattr(node, "hyperparams", None), dict)
        and hasattr(node, "inner_state")
        and hasattr(node, "_replace")
    )


def _injected_states(opt_state: Any) -> list[Any]:
    """Returns every inject_hyperparams state in ``opt_state`` holding a learning rate."""
    found = []
    for node in jax.tree_util.tree_leaves(opt_state, is_leaf=_has_hyperparams):
        if _has_hyperparams(node):
            if _LEARNING_RATE in node.hyperparams:
                found.append(node)
            # A learning rate may also be injected deeper, e.g. in a wrapped optimizer.
            found.extend(_injected_states(node.inner_state))
    return found


def _is_scheduled(node: Any) -> bool:
    # inject_hyperparams keeps a state per scheduled hyperparameter (optax >= 0.1.9).
    return _LEARNING_RATE in getattr(node, "hyperparams_states", {})


def get_learning_rate(opt_state: Any) -> jax.Array | None:
    """Returns the injected learning rate found in ``opt_state``, or None if there is none.

    The learning rate is searched anywhere in the (possibly nested) optimizer state, e.g.
    inside the tuple of an ``optax.chain``. When a schedule drives it, the value is the
    one the last update used (``schedule(count - 1)``; ``schedule(0)`` before any update).
    If several injected learning rates exist, the first in pytree order is returned.

    Args:
        opt_state: an optimizer state, e.g. from ``loopax.optimizers.adam().init(params)``.

    Returns:
        The learning rate as a scalar ``jax.Array`` (a tracer inside ``jax.jit``), or None
        when the optimizer was built without an injectable learning rate.

    Example:
        >>> import optax
        >>> from loopax.optimizers import get_learning_rate, sgd
        >>> float(get_learning_rate(sgd(0.25, clip_global_norm=1.0).init({"w": 0.0})))
        0.25
        >>> print(get_learning_rate(optax.sgd(0.25).init({"w": 0.0})))
        None
    """
    states = _injected_states(opt_state)
    if not states:
        return None
    return states[0].hyperparams[_LEARNING_RATE]


def check_not_schedule(value: Any) -> None:
    """Refuses a schedule where a learning rate *value* is set at run time.

    Raises:
      TypeError: `value` is callable (a schedule or a schedule factory).
    """
    if callable(value):
        raise TypeError(
            f"set_learning_rate takes a number (the new rate), got the schedule {value!r}. "
            "A schedule is fixed when the optimizer is built: build it with the schedule, "
            "e.g. loopax.optimizers.adam(learning_rate=loopax.optimizers.cosine_decay(1e-3, "
            "1000)), or set a number here."
        )


def set_learning_rate(opt_state: Any, value: Any) -> Any:
    """Returns a copy of ``opt_state`` with its injected learning rate replaced by ``value``.

    The new learning rate keeps the old one's shape, dtype and placement, so a compiled
    step taking the optimizer state as input runs it without recompiling. Every injected
    learning rate in the state is replaced. Works on concrete states and inside
    ``jax.jit``.

    Args:
        opt_state: an optimizer state built with a float learning rate.
        value: the new learning rate, a scalar (Python number or 0-d array).

    Returns:
        A new optimizer state of the same pytree structure; ``opt_state`` is unchanged.

    Raises:
        TypeError: ``value`` is a schedule (a function), not a number.
        ValueError: if ``value`` is not a scalar, if the optimizer has no injectable
            learning rate (build it with ``loopax.optimizers`` or
            ``optax.inject_hyperparams``), or if a schedule drives the learning rate (the
            schedule overwrites the value at every update).

    Example:
        >>> from loopax.optimizers import get_learning_rate, set_learning_rate, sgd
        >>> opt_state = sgd(0.1).init({"w": 0.0})
        >>> opt_state = set_learning_rate(opt_state, 0.125)
        >>> float(get_learning_rate(opt_state))
        0.125
    """
    check_not_schedule(value)
    if np.ndim(value) != 0:
        raise ValueError(
            f"set_learning_rate: the learning rate must be a scalar, got shape {np.shape(value)}."
        )
    if not isinstance(value, Tracer) and np.any(np.asarray(value) < 0):
        raise ValueError(f"set_learning_rate: learning rate {value!r} must be non-negative.")
    return _replace_rates(opt_state, "set_learning_rate", lambda old: jax.lax.full_like(old, value))


def scale_learning_rate(opt_state: Any, factor: float, *, minimum: float = 0.0) -> Any:
    """Returns a copy of ``opt_state`` with each injected learning rate times ``factor``.

    Unlike ``set_learning_rate``, which gives every injected rate one value, each rate keeps
    its own proportion: the groups of an ``optax.multi_transform`` with rates 1e-3 and 1e-4
    become 5e-4 and 5e-5 at ``factor=0.5``. No rate goes below ``minimum``, and one already
    below it is left as it is. Shapes, dtypes and placement are kept, as by
    ``set_learning_rate``.

    Args:
        opt_state: an optimizer state built with float learning rates.
        factor: the multiplier (> 0).
        minimum: the floor each scaled rate stops at.

    Returns:
        A new optimizer state of the same pytree structure.

    Raises:
        ValueError: as ``set_learning_rate``, or ``factor`` is not positive.

    Example:
        >>> import optax
        >>> from loopax.optimizers import get_learning_rate, scale_learning_rate, sgd
        >>> both = optax.multi_transform({"a": sgd(0.1), "b": sgd(0.01)}, {"w": "a", "v": "b"})
        >>> state = scale_learning_rate(both.init({"w": 0.0, "v": 0.0}), 0.5)
        >>> [round(float(get_learning_rate(s)), 6) for s in state.inner_states.values()]
        [0.05, 0.005]
    """
    if isinstance(factor, bool) or not factor > 0:
        raise ValueError(f"scale_learning_rate: factor must be > 0, got {factor!r}")

    def scaled(old: Any) -> Any:
        if isinstance(old, Tracer):
            return jnp.where(old < minimum, old, jnp.maximum(old * factor, minimum)).astype(
                old.dtype
            )
        current = np.asarray(old)
        new = np.where(current < minimum, current, np.maximum(current * factor, minimum))
        return jax.lax.full_like(old, new.reshape(-1)[0] if new.ndim else new)

    return _replace_rates(opt_state, "scale_learning_rate", scaled)


def injected_learning_rates(opt_state: Any) -> list[float]:
    """Every injected learning rate of `opt_state`, as host floats, in a fixed order."""
    return [
        float(np.asarray(jax.device_get(node.hyperparams[_LEARNING_RATE])).reshape(-1)[0])
        for node in _injected_states(opt_state)
    ]


def injected_hyperparameters(opt_state: Any) -> dict[str, float]:
    """The scalar hyperparameters injected in `opt_state`, the first of each name, as floats."""
    found: dict[str, float] = {}
    for node in _injected_states(opt_state):
        for name, value in node.hyperparams.items():
            if np.ndim(value) == 0 and name not in found:
                found[name] = float(np.asarray(jax.device_get(value)))
    return found


def with_learning_rates(opt_state: Any, rates: list[float]) -> Any:
    """`opt_state` with its injected learning rates set to `rates`, in the order above."""
    if len(rates) != len(_injected_states(opt_state)):
        raise ValueError(
            f"with_learning_rates: {len(rates)} rates for "
            f"{len(_injected_states(opt_state))} injected learning rates"
        )
    remaining = iter(rates)
    return _replace_rates(
        opt_state, "set_learning_rate", lambda old: jax.lax.full_like(old, next(remaining))
    )


def _replace_rates(opt_state: Any, what: str, new_rate: Callable[[Any], Any]) -> Any:
    """`opt_state` with each injected learning rate `old` replaced by `new_rate(old)`."""
    if not _injected_states(opt_state):
        raise ValueError(
            f"{what}: this optimizer state has no injectable learning rate. "
            "Build the optimizer with loopax.optimizers (sgd, adam, adamw, rmsprop, "
            "from_name) or wrap an optax optimizer with optax.inject_hyperparams so that "
            "opt_state.hyperparams holds 'learning_rate'."
        )

    def replace(node: Any) -> Any:
        if not _has_hyperparams(node):
            return node
        hyperparams = node.hyperparams
        if _LEARNING_RATE in hyperparams:
            if _is_scheduled(node):
                raise ValueError(
                    f"{what}: the learning rate of this optimizer is driven by a "
                    "schedule, which overwrites opt_state.hyperparams['learning_rate'] at "
                    "every update, so a value set here would be discarded. Build the "
                    "optimizer with a float learning_rate to change it at run time, or "
                    "build it with the schedule you want."
                )
            old = hyperparams[_LEARNING_RATE]
            new = new_rate(old)
            # Committed-ness is part of jit's cache key: match it, and the placement.
            if isinstance(old, jax.Array) and not isinstance(old, Tracer) and old.committed:
                new = jax.device_put(new, old.sharding)
            hyperparams = {**hyperparams, _LEARNING_RATE: new}
        return node._replace(
            hyperparams=hyperparams,
            inner_state=jax.tree_util.tree_map(replace, node.inner_state, is_leaf=_has_hyperparams),
        )

    return jax.tree_util.tree_map(replace, opt_state, is_leaf=_has_hyperparams)


def constant_learning_rate(opt_state: Any) -> float | None:
    """The unscheduled learning rate `get_learning_rate` finds, as a float, or None.

    None when a schedule drives it or the state has none; otherwise it changes only through
    `set_learning_rate`. Reads the (host) value: call it on a host copy of the state.
    """
    states = _injected_states(opt_state)
    if not states or _is_scheduled(states[0]):
        return None
    return float(np.asarray(states[0].hyperparams[_LEARNING_RATE]).reshape(-1)[0])
