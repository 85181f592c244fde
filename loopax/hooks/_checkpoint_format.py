"""The on-disk format of loopax checkpoints: the train state as a plain tree, and the layout.

The state is saved as nested dicts keyed by the names in the `TrainState` (`params`,
`opt_state` with optax's field names, ...) rather than as the `TrainState` itself, so that it
reads back into host arrays without knowing the model, onto any device count, and is then
matched name by name against the model's fresh state.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ..trainer._state import TrainState

FORMAT = "loopax.checkpoint"
VERSION = 1
STATE_ITEM = "state"
BUNDLE_ITEM = "loopax"
DAMAGED_DIR = "damaged"
TMP_MARK = ".orbax-checkpoint-tmp"


# -- the state as a plain tree --------------------------------------------------------------


def _key_name(key: Any) -> str:
    for attribute in ("key", "name", "idx"):
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


def _plain_paths(tree: Any) -> list[tuple[tuple[str, ...], Any]]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(tuple(_key_name(k) for k in path), leaf) for path, leaf in leaves]


def to_plain(state: TrainState) -> dict:
    """The state as nested dicts of arrays keyed by field names (optax namedtuples included)."""
    plain: dict = {}
    for path, leaf in _plain_paths(state):
        node = plain
        for name in path[:-1]:
            node = node.setdefault(name, {})
        node[path[-1]] = leaf
    return plain


def from_plain(template: TrainState, plain: dict, where: str) -> TrainState:
    """Fills `template`'s structure with the arrays of `plain`, checking names, shapes, dtypes."""
    template_paths = _plain_paths(template)
    saved = {path: leaf for path, leaf in _plain_paths(plain)}
    leaves = []
    for path, leaf in template_paths:
        name = "/".join(path)
        if path not in saved:
            raise ValueError(
                f"{where} has no {name!r}, which the model needs; was it saved by another model "
                "or optimizer? Use a new directory for a different model"
            )
        value = saved.pop(path)
        if tuple(np.shape(value)) != tuple(np.shape(leaf)) or np.dtype(value.dtype) != np.dtype(leaf.dtype):
            raise ValueError(
                f"{where} holds {name!r} with shape {np.shape(value)} and dtype {value.dtype}, "
                f"but the model has shape {np.shape(leaf)} and dtype {leaf.dtype}; use a new "
                "directory for a different model"
            )
        leaves.append(value)
    if saved:
        extra = sorted("/".join(path) for path in saved)
        raise ValueError(
            f"{where} holds {extra[:5]} that the model lacks; was it saved by another model "
            "or optimizer? Use a new directory for a different model"
        )
    return jax.tree.unflatten(jax.tree.structure(template), leaves)


def _step_of(entry: str) -> int | None:
    return int(entry) if entry.isdigit() else None


def check_directory(directory: Path) -> None:
    """Raises a clear error if `directory` holds anything but loopax checkpoints."""
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"checkpoint directory {str(directory)!r} is a file; pass a directory")
    if not directory.exists():
        return
    step_dirs, foreign = [], []
    for entry in sorted(os.listdir(directory)):
        if entry.startswith(".") or TMP_MARK in entry or entry == DAMAGED_DIR:
            continue
        if _step_of(entry) is not None and (directory / entry).is_dir():
            step_dirs.append(entry)
        else:
            foreign.append(entry)
    marked = [entry for entry in step_dirs if (directory / entry / BUNDLE_ITEM).is_dir()]
    if foreign or (step_dirs and not marked):
        culprit = foreign[0] if foreign else step_dirs[0]
        raise ValueError(
            f"checkpoint directory {str(directory)!r} holds {culprit!r}, which is not part of a "
            "loopax checkpoint (loopax writes only <step>/state and <step>/loopax); pass a new "
            "or empty directory, or one written by loopax.hooks.checkpoint"
        )
