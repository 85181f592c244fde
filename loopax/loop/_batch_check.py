"""What is wrong with the batch of a step whose loss is not finite, read on the host.

The loop keeps each dispatch of the steps in flight beside its metrics (references in the
in-flight window's tokens, never copies), so when the finite check finds the first
non-finite loss, that step's batch is still at hand: this module takes it to the host and
names what it sees (NaN or infinite values in an input or label; integer class ids outside
the model's output width) before the learning rate gets the blame. Nothing here runs
unless a loss went bad.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..data._internal import Dispatch, OnDevice, Stacked, as_list

# Host or device bytes of batches the in-flight window may hold for the check, in all: a
# turn whose batches take more than this divided by the window's length is not held (an
# image model's batches of tens of MB, 33 turns in flight, would hold gigabytes), and a
# non-finite loss in it says its batch was not kept.
HELD_BATCH_BYTES = 256 * 2**20


def batches_to_hold(dispatches: list[Dispatch], turn_budget: int) -> list[Dispatch]:
    """`dispatches` to hold until their losses are checked, or [] when over `turn_budget`.

    Per dispatch turn, in the loop's hot path: a few attribute reads. On-device data holds
    nothing of its own (its steps read the dataset's arrays).
    """
    size = 0
    for dispatch in dispatches:
        if isinstance(dispatch, OnDevice):
            continue
        for array in as_list(dispatch.inputs):
            size += getattr(array, "nbytes", 0)
        for array in as_list(dispatch.labels):
            size += getattr(array, "nbytes", 0)
    return dispatches if size <= turn_budget else []


_RATE_ADVICE = (
    "lower the learning rate, clip gradients (loopax.optimizers.adam(..., clip_global_norm=1.0))"
)
_GUARD_ADVICE = "attach hooks.nan_guard to skip such steps"


def batch_advice(trainer: Any, dispatches: Sequence[Dispatch], first_step: int, step: int) -> str:
    """The sentences a `NonFiniteLossError` ends with: what step `step`'s batch holds, then advice.

    Args:
      trainer: the Trainer that ran the step (its compiled programs know the predictions'
        shapes, hence the number of classes).
      dispatches: the dispatches of the in-flight token holding `step`, in order.
      first_step: the loop step of the first step of `dispatches`.
      step: the loop step whose loss is the first non-finite one.

    Returns:
      Bad values named (which input or label, how many, the first's example) with "check
      the data" before the learning-rate advice; a clean batch said to be clean, with the
      learning-rate advice only; or why the batch was not checked, with both.
    """
    try:
        inputs, labels, examples, spec = _step_batch(dispatches, first_step, step)
        lead = 1 if trainer.accumulate_steps > 1 else 0  # a step's micro-batches axis
        findings = [
            finding
            for kind, arrays in (("inputs", inputs), ("labels", labels))
            for position, array in enumerate(arrays)
            if (finding := _non_finite(f"{kind}[{position}]", array, lead, examples))
        ]
        classes = _class_count(trainer, spec, labels, lead)
        if classes is not None:
            finding = _class_ids(labels[0], classes, lead, examples)
            if finding:
                findings.append(finding)
    except Exception as error:  # the diagnosis must never hide the non-finite loss itself
        return (
            f"Its batch was not checked ({type(error).__name__}: {error}). "
            f"{_capitalized(_RATE_ADVICE)}, check the data, or {_GUARD_ADVICE}"
        )
    if findings:
        return (
            f"Its batch holds bad values, check the data: {'; '.join(findings)}. If the data "
            f"is right, {_RATE_ADVICE}, or {_GUARD_ADVICE}"
        )
    clean = "no NaN or infinite value"
    if classes is not None:
        clean += f" and no class id outside [0, {classes})"
    return f"Its batch holds {clean}: {_RATE_ADVICE}, or {_GUARD_ADVICE}"


def _capitalized(text: str) -> str:
    return text[0].upper() + text[1:]


def _step_batch(
    dispatches: Sequence[Dispatch], first_step: int, step: int
) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray | None, Any]:
    """Step `step`'s `(inputs, labels, dataset indices of its examples or None, spec)`.

    On the host. The indices are known for on-device data, whose batches are taken from
    the dataset's arrays again by where they lie.
    """
    if not dispatches:
        raise LookupError(
            "its batches were not kept while in flight: they are larger than "
            f"{HELD_BATCH_BYTES // 2**20} MiB over the window of steps in flight"
        )
    at = first_step
    for dispatch in dispatches:
        index = step - at
        if index < dispatch.count:
            break
        at += dispatch.count
    else:
        raise LookupError(f"step {step} is past the {at - first_step} steps of its dispatches")
    examples = None
    if isinstance(dispatch, OnDevice):
        inputs, labels = dispatch.chunk.part(index, 1).first_batch()
        examples = dispatch.chunk.step_examples(index)
    else:
        inputs, labels = as_list(dispatch.inputs), as_list(dispatch.labels)
    inputs, labels = jax.device_get((list(inputs), list(labels)))
    if isinstance(dispatch, Stacked):  # the steps' leading axis
        inputs, labels = [a[index] for a in inputs], [a[index] for a in labels]
    return [np.asarray(a) for a in inputs], [np.asarray(a) for a in labels], examples, dispatch.spec


def _place(index: tuple, lead: int, examples: np.ndarray | None) -> str:
    """Where the element at `index` of a step's array lies, in words."""
    if len(index) <= lead:
        return "the step's array itself"
    row = int(index[lead])
    place = (
        f"example {row} of micro-batch {int(index[0])}" if lead else f"example {row} of the batch"
    )
    if examples is not None:
        place += f" (example {int(examples[row])} of the dataset)"
    return place


def _non_finite(name: str, array: np.ndarray, lead: int, examples: np.ndarray | None) -> str:
    """`name` holds NaN or infinite values: how many, where the first is; "" when none."""
    if not jnp.issubdtype(array.dtype, np.inexact):  # bfloat16 too
        return ""
    if not np.issubdtype(array.dtype, np.inexact):  # bfloat16 and the like: not numpy's own
        array = array.astype(np.float32)
    nan = np.isnan(array)
    bad = nan | np.isinf(array)
    if not bad.any():
        return ""
    nans = int(nan.sum())
    infs = int(bad.sum()) - nans
    counts = " and ".join(
        f"{count} {what}" for count, what in ((nans, "NaN"), (infs, "infinite")) if count
    )
    first = tuple(np.argwhere(bad)[0])
    plural = "s" if nans + infs > 1 else ""
    return f"{name} holds {counts} value{plural} (the first in {_place(first, lead, examples)})"


def _class_count(trainer: Any, spec: Any, labels: list[np.ndarray], lead: int) -> int | None:
    """The model's output width when `labels[0]` are class ids of its first prediction.

    Class ids: integers, shaped as the prediction without its last axis (or with that axis
    1), the prediction having at least two classes there. The predictions' shapes are those
    the loss got when the step's program was traced (`ExecInfo.prediction_shapes`): no
    compile, no step. None when the labels are no class ids or no such program is cached.
    """
    if not labels or not np.issubdtype(labels[0].dtype, np.integer):
        return None
    shape = next(
        (
            executor.info.prediction_shapes[0]
            for executor in reversed(trainer.executors())  # the most recently used first
            if executor.info.graph_type.startswith("train")
            and executor.info.prediction_shapes
            and _same_spec(executor.info.spec, spec)
        ),
        None,
    )
    if shape is None or len(shape) < 2 or shape[-1] < 2:
        return None
    per_example = tuple(shape[1:-1])
    if labels[0].shape[lead + 1 :] not in (per_example, (*per_example, 1)):
        return None
    return int(shape[-1])


def _same_spec(one: Any, other: Any) -> bool:
    try:
        return one is other or bool(one == other)
    except Exception:  # a spec whose == is not a truth value (an array)
        return False


def _class_ids(label: np.ndarray, classes: int, lead: int, examples: np.ndarray | None) -> str:
    """`labels[0]` holds class ids outside `[0, classes)`: how many, the first; "" when none."""
    bad = (label < 0) | (label >= classes)
    count = int(bad.sum())
    if not count:
        return ""
    first = tuple(np.argwhere(bad)[0])
    ids = "class ids" if count > 1 else "class id"
    return (
        f"labels[0] holds {count} {ids} outside [0, {classes}), the model's {classes} outputs "
        f"(e.g. {label[first]} in {_place(first, lead, examples)})"
    )
