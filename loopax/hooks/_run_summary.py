"""The run summary (`run/summary`): command line, devices, XLA options, the model's variables."""

from __future__ import annotations

import shlex
import sys
from typing import Any

import jax
import numpy as np

from ..trainer import Trainer

RUN_SUMMARY_TAG = "run/summary"


def _format_bytes(count: int) -> str:
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def path_name(path: tuple) -> str:
    """A pytree path as `a/b/c` (dict keys, indices, attribute names)."""
    return "/".join(
        str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key)))) for key in path
    )


def _variables_table(tree: Any, title: str, column: str) -> list[str]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    count = sum(int(np.prod(leaf.shape)) for _, leaf in leaves)
    size = sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize for _, leaf in leaves)
    lines = [
        "",
        f"**{title}:** {count:,} ({_format_bytes(size)})",
        "",
        f"| {column} | shape | dtype | count |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {path_name(path)} | {tuple(leaf.shape)} | {np.dtype(leaf.dtype).name} | "
        f"{int(np.prod(leaf.shape)):,} |"
        for path, leaf in leaves
    ]
    return lines


def run_summary(trainer: Trainer, argv: list[str] | None = None) -> str:
    """A Markdown summary of the run: command line, devices, and the model's variables.

    The trainer's `compiler_options`, when it has any, follow the devices.

    The parameters' count, bytes and shapes, then, when the model has any, its other
    variables' (the mutable collections, e.g. BatchNorm's `batch_stats/...`), each path
    starting with its collection, as bobbin's environment info lists them. Reads only
    shapes and dtypes: no device value.
    """
    argv = sys.argv if argv is None else argv
    devices = trainer.devices
    kinds = sorted({device.device_kind for device in devices})
    lines = [
        f"**command line:** `{shlex.join(argv)}`",
        "",
        f"**devices:** {len(devices)} ({', '.join(kinds)}; {trainer.parallel}, "
        f"{jax.process_count()} process(es))",
    ]
    options = trainer.compiler_options
    if options:
        given = ", ".join(f"`{key}={value!r}`" for key, value in options.items())
        lines += ["", f"**compiler options:** {given}"]
    state = trainer.state
    if state is not None and state.params is not None:
        lines += _variables_table(state.params, "parameters", "parameter")
        if jax.tree_util.tree_leaves(state.model_state):
            lines += _variables_table(state.model_state, "other variables", "variable")
    return "\n".join(lines)
