"""Mixed precision: the compute dtype, and static or dynamic loss scaling.

Parameters and optimizer state stay float32. A step casts the floating parameters and
floating inputs to the compute dtype, runs the model, and casts the predictions back to
float32, so the loss and metrics reduce in float32; the gradient flows through the casts
back to the float32 parameters.

Dynamic loss scaling (for float16, whose range ends at 65504): the loss is multiplied by
the scale before differentiation and the gradients divided by it. A step whose gradients
are not finite is skipped: parameters and optimizer state stay, and the scale halves.
After `GROWTH_INTERVAL` finite steps in a row the scale doubles. A skip with a finite loss
above the smallest scale is an overflow, routine for the scaling: it is counted apart, so
that a non-finite loss (or gradient at the smallest scale) is told from it. The scale, that
run of finite steps and the overflow count are one float32[3] in the train state, so
checkpoints keep them (a float32[2] of an older checkpoint reads with no overflow counted).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

INITIAL_SCALE = 2.0**15
GROWTH_INTERVAL = 2000
MIN_SCALE = 1.0
MAX_SCALE = 2.0**24
# The entries of the dynamic loss scale's float32[3] state (one array: one state leaf, where
# each leaf costs the runtime microseconds per step). Indexing by a Python int constant
# traces to the same slice as a literal: the compiled step is the same.
SCALE = 0  # the scale the next step multiplies its loss by
FINITE_STREAK = 1  # finite steps in a row since the scale last changed
OVERFLOW_COUNT = 2  # overflow skips since training began
_DTYPES = {np.dtype(jnp.bfloat16): "bfloat16", np.dtype(jnp.float16): "float16"}


def check_compute_dtype(compute_dtype: Any) -> np.dtype | None:
    """The compute dtype as a numpy dtype (None or float32: no casting).

    Raises:
      ValueError: not bfloat16, float16 or float32.
    """
    if compute_dtype is None:
        return None
    try:
        dtype = np.dtype(compute_dtype)
    except TypeError:
        dtype = None
    if dtype == np.dtype(np.float32):
        return None
    if dtype not in _DTYPES:
        raise ValueError(
            f"compute_dtype must be jnp.bfloat16, jnp.float16 (or None / float32 for full "
            f"precision), got {compute_dtype!r}"
        )
    return dtype


def check_loss_scale(loss_scale: Any, compute_dtype: np.dtype | None) -> float | str | None:
    """`loss_scale` validated: None, "dynamic" or a positive float (a static scale).

    Raises:
      ValueError: another value, or a scale without a reduced-precision `compute_dtype`.
    """
    if loss_scale is None:
        return None
    if loss_scale != "dynamic":
        if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)):
            raise ValueError(
                f"loss_scale must be None, 'dynamic' or a positive number, got {loss_scale!r}"
            )
        if not (np.isfinite(loss_scale) and loss_scale > 0):
            raise ValueError(f"loss_scale must be a positive finite number, got {loss_scale!r}")
        loss_scale = float(loss_scale)
    if compute_dtype is None:
        raise ValueError(
            f"loss_scale={loss_scale!r} scales a reduced-precision loss; it needs "
            "compute_dtype=jnp.float16 (or jnp.bfloat16); in float32 there is nothing to scale"
        )
    return loss_scale


def dtype_name(dtype: np.dtype | None) -> str:
    """`"bfloat16"`, `"float16"` or `"float32"` (None)."""
    return "float32" if dtype is None else _DTYPES[dtype]


def cast_floating(tree: Any, dtype: np.dtype | None) -> Any:
    """`tree` with its floating leaves cast to `dtype` (unchanged for None)."""
    if dtype is None:
        return tree

    def cast(leaf: Any) -> Any:
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf.astype(dtype)
        return leaf

    return jax.tree.map(cast, tree)


def to_float32(tree: Any, dtype: np.dtype | None) -> Any:
    """`tree`'s reduced-precision floating leaves as float32 (unchanged for None)."""
    if dtype is None:
        return tree
    return jax.tree.map(
        lambda leaf: leaf.astype(jnp.float32) if leaf.dtype == dtype else leaf, tree
    )


def fresh_dynamic_scale() -> jax.Array:
    """The dynamic loss scale state before any step: `[SCALE, FINITE_STREAK, OVERFLOW_COUNT]`."""
    return jnp.asarray([INITIAL_SCALE, 0.0, 0.0], jnp.float32)


def next_dynamic_scale(state: jax.Array, finite: jax.Array, loss_finite: jax.Array) -> jax.Array:
    """The scale state after a step whose gradients were `finite` (a bool scalar).

    `loss_finite` (a bool scalar): whether the step's loss was; a skip with a finite loss
    above the smallest scale counts as an overflow.
    """
    scale, overflows = state[SCALE], state[OVERFLOW_COUNT]
    streak = state[FINITE_STREAK] + 1.0
    grow = streak >= GROWTH_INTERVAL
    grown = jnp.stack(  # in the entries' order: SCALE, FINITE_STREAK, OVERFLOW_COUNT
        [
            jnp.where(grow, jnp.minimum(scale * 2.0, MAX_SCALE), scale),
            jnp.where(grow, 0.0, streak),
            overflows,
        ]
    )
    # At the smallest scale a non-finite gradient is not the scaling's doing.
    overflow = loss_finite & (scale > MIN_SCALE)
    shrunk = jnp.stack(
        [
            jnp.maximum(scale * 0.5, MIN_SCALE),
            jnp.zeros_like(scale),
            overflows + overflow.astype(jnp.float32),
        ]
    )
    return jnp.where(finite, grown, shrunk)


def all_finite(tree: Any) -> jax.Array:
    """Traced: whether every floating leaf of `tree` is finite (a bool scalar)."""
    leaves = [leaf for leaf in jax.tree.leaves(tree) if jnp.issubdtype(leaf.dtype, jnp.inexact)]
    return (
        jnp.all(jnp.stack([jnp.isfinite(leaf).all() for leaf in leaves]))
        if leaves
        else jnp.bool_(True)
    )
