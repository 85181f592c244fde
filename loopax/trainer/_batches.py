"""Batches as the Trainer takes them: cache keys, checks, and evaluation's uneven batches."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, TypeGuard

import jax
import numpy as np

from ..data._internal import shown_name


def spec_key(spec: Any) -> Hashable:
    try:
        hash(spec)
    except TypeError:
        return ("loopax:repr", repr(spec))
    return spec


def signature(arrays: list[Any], what: str, spec: Any) -> tuple:
    try:
        return tuple((array.shape, array.dtype) for array in arrays)
    except AttributeError:
        for position, array in enumerate(arrays):
            if not hasattr(array, "shape") or not hasattr(array, "dtype"):
                raise TypeError(
                    f"{what}[{position}] for spec {spec!r} is a {type(array).__name__}, not an "
                    "array; datasets must yield numpy or jax arrays (np.asarray converts lists)"
                ) from None
        raise


def _is_count(value: Any) -> TypeGuard[int | np.integer]:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def dropped_examples_warning(dataset: Any) -> str | None:
    """Says how many examples one pass over `dataset` skips, or None.

    Read from its attributes (`num_examples`, `batch_size`, `drop_remainder`, as `ArrayDataset`
    has).
    """
    num_examples = getattr(dataset, "num_examples", None)
    batch_size = getattr(dataset, "batch_size", None)
    drop_remainder = getattr(dataset, "drop_remainder", False)
    if not (isinstance(drop_remainder, (bool, np.bool_)) and drop_remainder):
        return None
    if not (_is_count(num_examples) and _is_count(batch_size)) or batch_size < 1:
        return None
    dropped = int(num_examples) % int(batch_size)
    if not dropped:
        return None
    return (
        f"dataset {shown_name(dataset)!r} drops its last {dropped} of "
        f"{num_examples} examples (drop_remainder=True with batch_size {batch_size}): this "
        f"evaluation covers {num_examples - dropped}; build it with drop_remainder=False to "
        "evaluate every example"
    )


def _check_dtypes(graph: str, spec: Any, inputs: list, labels: list) -> None:
    """Refuses strings and Python objects, which JAX cannot put on a device."""
    for what, arrays in (("inputs", inputs), ("labels", labels)):
        for position, array in enumerate(arrays):
            kind = np.dtype(array.dtype).kind
            if kind in "USO":
                fix = (
                    "map them to integer class ids first, e.g. "
                    "`classes, ids = np.unique(labels, return_inverse=True)`"
                    if what == "labels"
                    else "convert them to numbers first (e.g. a vocabulary lookup)"
                )
                raise TypeError(
                    f"{what}[{position}] of the {graph} batch for spec {spec!r} has dtype "
                    f"{array.dtype} ({'strings' if kind in 'US' else 'Python objects'}), which "
                    f"JAX cannot put on a device; {fix}"
                )


def validate_batch(
    graph: str,
    spec: Any,
    key_spec: Hashable,
    inputs: list,
    labels: list,
    input_counts: dict,
    local_devices: int,
    leading_axes: tuple[str, ...] = (),
    axis_limits: dict[str, int] | None = None,
) -> int:
    """Checks a batch's arrays; returns its (local) batch size.

    A train batch must divide by the local devices; an eval batch need not
    (`eval_step` splits off and pads its remainder). With `leading_axes` (e.g.
    `("micro-batches",)` under gradient accumulation, `("steps",)` for fused steps) every
    array has those axes in front of its batch axis, the same for all, and the batch
    size is that of one step's (micro-)batch; `axis_limits` caps a leading axis's size
    (e.g. micro-batches at `accumulate_steps`).
    """
    if not inputs:
        raise ValueError(
            f"at least one input is required: the {graph} batch for spec {spec!r} has none"
        )
    counts = (len(inputs), len(labels))
    known = input_counts.get(key_spec, counts)
    if graph == "predict" and known[0] != counts[0]:  # predictions take no labels
        raise ValueError(
            f"spec {spec!r} was first used with {known[0]} inputs, now predicting from "
            f"{counts[0]}; give each arrangement its own spec"
        )
    if graph != "predict" and known != counts:
        raise ValueError(
            f"spec {spec!r} was first used with {known[0]} inputs and {known[1]} labels, now "
            f"with {counts[0]} inputs and {counts[1]} labels; give each arrangement its own spec"
        )
    _check_dtypes(graph, spec, inputs, labels)
    if leading_axes:
        check_leading_axes(spec, inputs, labels, leading_axes, axis_limits or {})
    axis = len(leading_axes)
    if any(a.ndim == 0 for a in [*inputs, *labels]):
        raise ValueError(
            f"the {graph} batch for spec {spec!r} has a scalar input or label; every array "
            "needs a leading batch dimension"
        )
    sizes = {int(a.shape[axis]) for a in [*inputs, *labels]}
    if len(sizes) != 1:
        raise ValueError(
            f"the {graph} batch for spec {spec!r} mixes batch sizes {sorted(sizes)} "
            f"(input shapes {[a.shape for a in inputs]}, label shapes "
            f"{[a.shape for a in labels]}); inputs and labels need the same first dimension"
        )
    batch = sizes.pop()
    if batch == 0:
        raise ValueError(
            f"the {graph} batch for spec {spec!r} is empty (input shapes "
            f"{[a.shape for a in inputs]}): a dataset must not yield a batch of 0 examples; "
            "check how the batches are sliced (e.g. a last batch past the end of the data)"
        )
    if batch % local_devices and graph != "eval":
        raise ValueError(
            f"batch size {batch} is not divisible by the {local_devices} devices; use a "
            f"batch size that is a multiple of {local_devices} or pass devices=..."
        )
    # Recorded only for a valid batch, so a rejected first batch does not pin the spec.
    # Predictions take no labels, so they do not pin the spec's label count.
    if graph != "predict":
        input_counts[key_spec] = counts
    return batch


def check_leading_axes(
    spec: Any, inputs: list, labels: list, names: tuple[str, ...], limits: dict[str, int]
) -> None:
    """Checks that a train batch's arrays share the leading axes `names`.

    Under gradient accumulation a micro-batch axis comes in front of the batch axis, and
    with fused steps a steps axis in front of that.

    Raises:
      ValueError: an array without those axes and a batch axis, leading axes that differ,
        or one longer than its limit.
    """
    arrays = [*inputs, *labels]
    layout = f"({', '.join(names)}, batch, ...)"
    if any(a.ndim <= len(names) for a in arrays):
        raise ValueError(
            f"with {' and '.join(_WHY[name] for name in names)}, each train input and label has "
            f"the shape {layout}; the batch for spec {spec!r} has input shapes "
            f"{[a.shape for a in inputs]} and label shapes {[a.shape for a in labels]}. The "
            "Loop stacks the batches itself; by hand, use np.stack([batch_1, ..., batch_k])"
        )
    for position, name in enumerate(names):
        limit = limits.get(name)
        longest = max(int(a.shape[position]) for a in arrays)
        if limit is not None and longest > limit:
            raise ValueError(
                f"the train batch for spec {spec!r} has {longest} {name} (input shapes "
                f"{[a.shape for a in inputs]}, label shapes {[a.shape for a in labels]}), more "
                f"than {_WHY[name]}={limit}; each input and label needs the shape {layout}: "
                "is the leading axis of the micro-batches missing?"
            )
    counts = sorted({tuple(a.shape[: len(names)]) for a in arrays})
    if len(counts) != 1:
        raise ValueError(
            f"the train batch for spec {spec!r} mixes leading {', '.join(names)} sizes {counts} "
            f"(input shapes {[a.shape for a in inputs]}, label shapes "
            f"{[a.shape for a in labels]}); every input and label needs the same shape {layout}"
        )


_WHY = {"micro-batches": "accumulate_steps", "steps": "fused steps (steps_per_execution)"}


def split_uneven_batch(inputs: list, labels: list, num_devices: int) -> tuple[list, ...]:
    """Splits a (local) batch that the N local devices do not divide into pieces.

    The pieces are those `_steps.StepBuilder.eval_uneven` takes, each a list of arrays.

    Returns `(padded_inputs, padded_labels, [valid])`, then `(inputs, labels)` of its
    largest part that N divides, unless that part is empty. The last r < N examples
    are padded to N: devices 0..r-1 get them and the others copies of the last one
    (real inputs, so padding cannot make the model raise or overflow), and
    `valid[i]` says whether device i's example is real; device 0's always is, so the
    merge over devices starts from a real one.
    """
    batch = int(inputs[0].shape[0])
    remainder = batch % num_devices
    divisible = batch - remainder
    rows = divisible + np.minimum(np.arange(num_devices), remainder - 1)
    pieces = (
        [a[rows] for a in inputs],
        [a[rows] for a in labels],
        [np.arange(num_devices) < remainder],
    )
    if divisible:
        pieces += ([a[:divisible] for a in inputs], [a[:divisible] for a in labels])
    return pieces


def check_same_batch_size_everywhere(spec: Any, batch: int) -> None:
    """Multi-process: every process must split its batch the same way.

    When not, all raise together (not one raising while the others wait in a collective).
    """
    from jax.experimental import multihost_utils

    sizes = np.asarray(multihost_utils.process_allgather(np.asarray(batch, np.int32))).ravel()
    if np.any(sizes != batch):
        raise ValueError(
            f"the eval batches for spec {spec!r} have different sizes on the "
            f"{jax.process_count()} processes ({sizes.tolist()}, by process); every "
            "process must yield the same number of examples in each batch, the last one "
            "included: give each process an equal share of the eval set"
        )
