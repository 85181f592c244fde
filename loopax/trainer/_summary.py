"""`Trainer.summary()`: a table of every parameter, like Keras's `model.summary()`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from ._state import tree_paths


def _bytes(count: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


def _table(header: Sequence[str], rows: list[Sequence[str]], numeric: int) -> list[str]:
    """Rows as aligned text; the last `numeric` columns right-aligned."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    text_columns = len(header) - numeric

    def line(row: Sequence[str]) -> str:
        cells = [
            cell.ljust(width) if i < text_columns else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    return [line(header), "-" * len(line(header)), *(line(row) for row in rows)]


def parameter_summary(params: Any, model_state: Any = None) -> str:
    """The text of `Trainer.summary()` for `params` (and the model state's leaves).

    Every parameter's path, shape, dtype, count and bytes; with arrays laid out over
    several devices (a mesh), also its partition spec and bytes per device. Then the
    totals: trainable parameters, the model state (e.g. BatchNorm statistics), and all.
    """
    groups = [("params", params)]
    if model_state is not None and jax.tree.leaves(model_state):
        groups.append(("state", model_state))
    leaves = [(group, path, leaf) for group, tree in groups for path, leaf in tree_paths(tree)]
    sharded = any(
        not getattr(getattr(leaf, "sharding", None), "is_fully_replicated", True)
        for _, _, leaf in leaves
    )
    header = ["parameter", "shape", "dtype", "count", "bytes"]
    if sharded:
        header += ["partition spec", "bytes per device"]
    rows, totals = [], {"params": [0, 0], "state": [0, 0]}
    per_device_total = 0
    for group, path, leaf in leaves:
        shape = tuple(np.shape(leaf))
        count = math.prod(shape)
        nbytes = count * np.dtype(leaf.dtype).itemsize
        totals[group][0] += count
        totals[group][1] += nbytes
        name = "/".join(path) if group == "params" else f"({group}) " + "/".join(path)
        row = [name, str(shape), np.dtype(leaf.dtype).name, f"{count:,}", _bytes(nbytes)]
        if sharded:
            sharding = leaf.sharding
            shard = math.prod(sharding.shard_shape(shape)) * np.dtype(leaf.dtype).itemsize
            per_device_total += shard
            row += [str(getattr(sharding, "spec", "")), _bytes(shard)]
        rows.append(row)
    lines = _table(header, rows, numeric=2 + (2 if sharded else 0))
    lines.append("-" * len(lines[0]))
    count, nbytes = totals["params"]
    lines.append(f"trainable parameters: {count:,} ({_bytes(nbytes)})")
    if totals["state"][0]:
        state_count, state_bytes = totals["state"]
        lines.append(f"model state: {state_count:,} ({_bytes(state_bytes)})")
        lines.append(f"total: {count + state_count:,} ({_bytes(nbytes + state_bytes)})")
    if sharded:
        lines.append(f"per device: {_bytes(per_device_total)} of the parameters and state")
    return "\n".join(lines)
