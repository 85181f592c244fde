"""The train state: one pytree holding everything a step reads and writes.

Also its plain form: nested dicts of arrays keyed by the state's field names (`params`,
`opt_state` with optax's field names, ...), which checkpoints store. The plain form reads
back into host arrays without knowing the model, onto any device count, and is matched
name by name against the model's state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from ..metrics._internal import LossMovingAverage
from ._packed import PackedAverage, unpack
from ._precision import OVERFLOW_COUNT


@flax.struct.dataclass
class TrainState:
    """Everything the compiled train step reads and writes; checkpointed as a whole.

    Attributes:
      step: the global step (optimizer steps taken), an int32 scalar (a host array in a
        state built from its plain form).
      params: the trainable variables (the Flax `params` collection).
      opt_state: the optax optimizer state.
      model_state: the other Flax collections, e.g. `{"batch_stats": ...}`.
      rng: the base PRNG key data (uint32[2]); each step folds in the step and device.
      train_metrics: the running states of the train metrics by name: the loss's moving
        average and skipped-step count under `"moving_average_loss"` (one float32[3]:
        mean, count, skipped: a `LossMovingAverage` state), and the user's
        compiled train metrics under theirs.
      loss_scale: the dynamic loss scale's state (float32[3]: scale, finite steps in a
        row, overflows skipped) with `Trainer(loss_scale="dynamic")`, else None (no leaf).
      ema_params: the exponential moving average of `params` with
        `Trainer(ema_decay=...)`, else None (no leaf).
    """

    step: jax.Array | np.ndarray
    params: Any
    opt_state: Any
    model_state: Any
    rng: jax.Array | np.ndarray
    train_metrics: dict[str, Any]
    loss_scale: Any = None
    ema_params: Any = None

    if TYPE_CHECKING:
        # Added at runtime by `flax.struct.dataclass`; declared for type checkers only.
        def replace(self, **changes: Any) -> TrainState: ...


def eval_params(state: TrainState) -> Any:
    """The parameters evaluation and prediction use: the EMA weights when kept, else `params`."""
    if state.ema_params is None:
        return state.params
    if isinstance(state.ema_params, PackedAverage):  # a step's placed state
        return unpack(state.ema_params, state.params)
    return state.ema_params


def _key_name(key: Any) -> str:
    for attribute in ("key", "name", "idx"):
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


def tree_paths(tree: Any) -> list[tuple[tuple[str, ...], Any]]:
    """`(path of names, leaf)` for every leaf of `tree`, in pytree order."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(tuple(_key_name(k) for k in path), leaf) for path, leaf in leaves]


def to_plain(tree: Any) -> dict:
    """`tree` as nested dicts of its leaves keyed by field names (optax namedtuples included)."""
    return nest_paths(tree_paths(tree))


def nest_paths(flat: list[tuple[tuple[str, ...], Any]]) -> dict:
    """Nested dicts holding each `(path of names, leaf)` of `flat` at its path."""
    plain: dict = {}
    for path, leaf in flat:
        node = plain
        for name in path[:-1]:
            node = node.setdefault(name, {})
        node[path[-1]] = leaf
    return plain


def skipped_steps(state: TrainState) -> Any:
    """The count of skipped steps kept in `state`'s loss average (a float32 scalar)."""
    return LossMovingAverage().skipped(state.train_metrics[LossMovingAverage.name])


def overflow_steps(state: TrainState) -> Any:
    """The dynamic loss scale's count of overflow skips (a float32 scalar), or None."""
    return None if state.loss_scale is None else state.loss_scale[OVERFLOW_COUNT]


_LOSS_AVERAGE_PATH = ("train_metrics", LossMovingAverage.name)
_LOSS_SCALE_PATH = ("loss_scale",)


def _upgrade(path: tuple[str, ...], value: Any, leaf: Any) -> Any:
    """Reads the states of older checkpoints, one count shorter.

    loopax 0.1's loss average was float32[2] (no skip count); the dynamic loss scale was
    float32[2] (no overflow count) until overflows were counted apart. The missing count
    starts at 0.
    """
    if (path, np.shape(value), np.shape(leaf)) in (
        (_LOSS_AVERAGE_PATH, (2,), (3,)),
        (_LOSS_SCALE_PATH, (2,), (3,)),
    ):
        return np.concatenate([np.asarray(value), np.zeros((1,), np.asarray(value).dtype)])
    return value


_DIFFERENT_MODEL = (
    "was it saved by another model or optimizer? Use a new directory for a different model"
)


def from_plain(template: Any, plain: dict, where: str, hint: str = _DIFFERENT_MODEL) -> Any:
    """Fills `template`'s structure with the arrays of `plain`, checking names, shapes, dtypes.

    Raises:
      ValueError: naming the first missing, extra or mismatched entry and both shapes,
        then `hint`.
    """
    saved = dict(tree_paths(plain))
    leaves = []
    for path, leaf in tree_paths(template):
        name = "/".join(path)
        if path not in saved:
            raise ValueError(f"{where} has no {name!r}, which the model needs; {hint}")
        value = _upgrade(path, saved.pop(path), leaf)
        if tuple(np.shape(value)) != tuple(np.shape(leaf)) or np.dtype(value.dtype) != np.dtype(
            leaf.dtype
        ):
            raise ValueError(
                f"{where} holds {name!r} with shape {np.shape(value)} and dtype {value.dtype}, "
                f"but the model has shape {np.shape(leaf)} and dtype {leaf.dtype}; {hint}"
            )
        leaves.append(value)
    if saved:
        extra = sorted("/".join(path) for path in saved)
        raise ValueError(f"{where} holds {extra[:5]} that the model lacks; {hint}")
    return jax.tree.unflatten(jax.tree.structure(template), leaves)


def first_non_finite(tree: Any) -> str | None:
    """The path of the first leaf of `tree` holding a NaN or an infinity, or None.

    Reads host (numpy) leaves; integer and boolean leaves are always finite.
    """
    for path, leaf in tree_paths(tree):
        array = np.asarray(leaf)
        if np.issubdtype(array.dtype, np.inexact) and not np.isfinite(array).all():
            return "/".join(path)
    return None


def state_from_tree(
    tree: dict,
    optimizer: Any,
    fresh_train_metrics: dict[str, Any],
    where: str,
    loss_scale: Any = None,
) -> TrainState:
    """A `TrainState` built from its plain form alone, with no model needed.

    The optimizer state's structure comes from `optimizer.init` of the tree's parameters
    (abstractly: `jax.Array` leaves stay where they are, never gathered to a host).
    `fresh_train_metrics` and `loss_scale` give only the shapes and dtypes the tree's train
    metric states and loss scale must have (arrays or `jax.ShapeDtypeStruct`s).

    Raises:
      ValueError: `tree` does not fit (naming the first differing entry).
    """

    def array(leaf: Any) -> Any:
        return leaf if isinstance(leaf, jax.Array) else np.asarray(leaf)

    params = jax.tree.map(array, tree["params"])
    template = TrainState(
        step=np.zeros((), np.int32),
        params=params,
        opt_state=jax.eval_shape(optimizer.init, params),
        model_state=jax.tree.map(array, tree.get("model_state", {})),
        rng=np.zeros((2,), np.uint32),
        train_metrics=fresh_train_metrics,
        loss_scale=loss_scale,
        ema_params=params if "ema_params" in tree else None,
    )
    return from_plain(template, tree, where)


def with_ema(tree: dict, keeps_ema: bool) -> dict:
    """A plain state `tree` for a trainer that keeps EMA weights (`keeps_ema`) or not.

    A state saved without them starts the average at its parameters; one saved with them
    loses them in a trainer that keeps none.
    """
    if keeps_ema and "ema_params" not in tree:
        # Copies: the steps donate the state's buffers, so no two leaves may share one.
        def copy(leaf: Any) -> Any:
            return jnp.copy(leaf) if isinstance(leaf, jax.Array) else np.array(leaf)

        return {**tree, "ema_params": jax.tree.map(copy, tree["params"])}
    if not keeps_ema and "ema_params" in tree:
        return {name: value for name, value in tree.items() if name != "ema_params"}
    return tree
