"""What a learning-rate schedule gave at past updates, read back after the fact.

When a loss turns NaN, the learning rate of the update before it may be the cause (a
schedule dividing by zero at its first count). The optimizer state holds only the rate of
the latest update, so the schedule is evaluated again at the counts asked for: an update of
zeros on a stand-in parameter, from a state whose counts are set to them, through the
optimizer's own code (`optax.inject_hyperparams` evaluates the schedule there). Nothing here
runs unless a loss went bad.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._learning_rate import _LEARNING_RATE, _has_hyperparams, _injected_states, _is_scheduled

# How deep `schedule_name` looks into the optimizer's functions for the schedule.
_CLOSURE_DEPTH = 6


def update_count(opt_state: Any) -> int | None:
    """The number of updates made, from the first scheduled learning rate's state, or None."""
    for node in _injected_states(opt_state):
        if _is_scheduled(node):
            return int(np.asarray(jax.device_get(node.count)))
    return None


def scheduled_learning_rates(optimizer: Any, counts: list[int]) -> list[float] | None:
    """The learning rate the optimizer's schedule gives at each update count of `counts`.

    Returns:
      One float per count (the first scheduled rate, in pytree order), or None when no
      schedule drives the learning rate or the optimizer cannot be evaluated on a stand-in
      parameter (e.g. `optax.multi_transform` labelled by the parameter tree).
    """
    params = {"w": jnp.zeros((), jnp.float32)}
    try:
        state = optimizer.init(params)
        if not any(_is_scheduled(node) for node in _injected_states(state)):
            return None
        rates = []
        for count in counts:
            at_count = _with_count(state, count)
            _, updated = optimizer.update({"w": jnp.zeros((), jnp.float32)}, at_count, params)
            node = next(node for node in _injected_states(updated) if _is_scheduled(node))
            rates.append(float(np.asarray(jax.device_get(node.hyperparams[_LEARNING_RATE]))))
        return rates
    except Exception:  # noqa: BLE001 - a diagnosis never hides the error it explains
        return None


def _with_count(opt_state: Any, count: int) -> Any:
    """`opt_state` with every injected state's counts (its own, its schedules') at `count`."""

    def at_count(node: Any) -> Any:
        if not _has_hyperparams(node):
            return node
        schedules = {
            name: state._replace(count=jnp.asarray(count, jnp.asarray(state.count).dtype))
            for name, state in node.hyperparams_states.items()
        }
        return node._replace(
            count=jnp.asarray(count, jnp.asarray(node.count).dtype),
            hyperparams_states=schedules,
            inner_state=_with_count(node.inner_state, count),
        )

    return jax.tree_util.tree_map(at_count, opt_state, is_leaf=_has_hyperparams)


def schedule_name(optimizer: Any) -> str | None:
    """`name (file:line)` of the learning-rate schedule the optimizer was built with, or None.

    Found among the values the optimizer's functions close over (`optax.inject_hyperparams`
    keeps the schedule there); None when it cannot be found.
    """
    found = _find_schedule(getattr(optimizer, "update", None), _CLOSURE_DEPTH, set())
    if found is None:
        return None
    code = getattr(found, "__code__", None)
    name = getattr(found, "__qualname__", None) or type(found).__name__
    return f"{name} ({code.co_filename}:{code.co_firstlineno})" if code is not None else name


def _find_schedule(value: Any, depth: int, seen: set[int]) -> Any:
    if depth < 0 or id(value) in seen:
        return None
    seen.add(id(value))
    if isinstance(value, dict):
        schedule = value.get(_LEARNING_RATE)
        wrapped = getattr(schedule, "schedule_fn", None)  # optax's WrappedSchedule
        if wrapped is not None:
            return wrapped
        children = list(value.values())
    elif isinstance(value, tuple | list):
        children = list(value)
    else:
        children = [
            getattr(value, attribute, None) for attribute in ("init", "update", "__wrapped__")
        ]
        cells = getattr(value, "__closure__", None) or ()
        for cell in cells:
            try:
                children.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
    for child in children:
        if child is None or isinstance(child, str | int | float | bool | jax.Array | np.ndarray):
            continue
        found = _find_schedule(child, depth - 1, seen)
        if found is not None:
            return found
    return None
