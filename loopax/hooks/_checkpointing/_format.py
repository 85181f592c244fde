"""The on-disk layout of loopax checkpoints.

One Orbax `CheckpointManager` directory::

    <directory>/<step>/state/     the train state as a plain tree of arrays (StandardSave)
    <directory>/<step>/loopax/    JSON: format marker, step, array fingerprints, the loop's
                                  state (history, trigger and hook states), every process's
                                  dataset position
    <directory>/damaged/<step>/   checkpoints that could not be read or verified, moved aside
    <directory>/abandoned/<step>/ checkpoints newer than the step a run went on from (after a
                                  restore of an older step): another trajectory, moved aside

The state is saved in its plain form (`Trainer.state_dict()`: nested dicts keyed by the
names in the `TrainState`), so that it reads back into host arrays without knowing the
model, onto any device count, and is then matched name by name against the model's state.

Format versions:
- 3 checks each array with a fingerprint that does not depend on its layout
  (`_fingerprint`: `"fingerprints": {"params/Dense_0/kernel": "float32[2,1]:1a2b3c4d"}`),
  computed where the arrays lie, so a checkpoint written by several processes is verified on
  any topology; and it keeps every process's dataset positions (`"process_datasets"`: one
  dict per process, in process order; `"num_processes"`); `"datasets"` stays process 0's.
- 2 keys the train metric states by name (`train_metrics/moving_average_loss`,
  `train_metrics/<metric name>`); its arrays carry CRC-32 `"checksums"` of their host bytes
  and its `"datasets"` is one process's dict.
- 1 kept them by position (`train_metrics/0` the loss's moving average, then the compiled
  train metrics in the trainer's order).
Versions 1 and 2 are still read (and verified with their CRC-32): `named_train_metrics`
turns version 1's state into the named form and `dataset_positions` reads every version's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ... import _validate

FORMAT = "loopax.checkpoint"
VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
STATE_ITEM = "state"
BUNDLE_ITEM = "loopax"
DAMAGED_DIR = "damaged"
# Checkpoints newer than the step a run continued from: another trajectory, never resumed.
ABANDONED_DIR = "abandoned"
TMP_MARK = ".orbax-checkpoint-tmp"


def incomplete_saves(directory: Path) -> list[str]:
    """The leftovers of saves cut off before their commit (a crash, a second Ctrl-C)."""
    if not directory.is_dir():
        return []
    return sorted(entry for entry in os.listdir(directory) if TMP_MARK in entry)


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
        if entry.startswith(".") or TMP_MARK in entry or entry in (DAMAGED_DIR, ABANDONED_DIR):
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


def make_bundle(
    step: int,
    *,
    num_devices: int,
    loop_state: dict,
    datasets: list[dict],
    best_metric: dict | None,
) -> dict[str, Any]:
    """The JSON description saved beside the arrays of checkpoint `step`.

    Args:
      step: the global step.
      num_devices: the devices a batch was split over.
      loop_state: `Loop.get_state()`.
      datasets: each process's dataset positions (`{name: get_state()}`), in process order.
      best_metric: `{best_metric: value}`, or None.

    The writer adds the arrays' fingerprints.

    Raises:
      TypeError: a dataset's or a hook's state is not JSON.
    """
    bundle = {
        "format": FORMAT,
        "version": VERSION,
        "global_step": step,
        "num_devices": num_devices,
        "num_processes": len(datasets),
        "loop": loop_state,
        "datasets": datasets[0],
        "process_datasets": datasets,
        "best_metric": best_metric,
        "saved_at": time.time(),
    }
    _validate.json_value(
        bundle,
        lambda err: (
            f"the checkpoint of step {step} must be JSON: a dataset's get_state() or "
            f"a hook's get_state() returned something else ({err}); return ints, floats, "
            "strings, lists and dicts"
        ),
    )
    return bundle


def named_train_metrics(state: dict, version: int, names: Sequence[str]) -> dict:
    """The plain state of a checkpoint of format `version`, its train metrics keyed by name.

    Args:
      state: the plain state as read.
      version: the checkpoint's format version.
      names: the keys of the trainer's train metric states, in the trainer's order
        (`Trainer.train_metric_state_names`): the names of version 1's positions.

    Returns:
      `state` itself for version 2; for version 1 a copy whose `train_metrics` are keyed
      by `names`. Positions beyond `names` keep their number, so that the state's check
      against the trainer names them.
    """
    by_position = state.get("train_metrics")
    if version != 1 or not isinstance(by_position, dict):
        return state
    if not all(key.isdigit() for key in by_position):  # not positional: checked as it is
        return state
    named = {
        (names[index] if index < len(names) else key): by_position[key]
        for index, key in enumerate(sorted(by_position, key=int))
    }
    return {**state, "train_metrics": named}


def with_positions(bundle: dict, positions: list[dict]) -> dict:
    """`bundle` holding every process's dataset positions (in process order)."""
    return {
        **bundle,
        "num_processes": len(positions),
        "datasets": positions[0],
        "process_datasets": positions,
    }


def dataset_positions(bundle: dict) -> list[dict]:
    """Each saving process's dataset positions (`{name: state}`), in process order.

    Versions 1 and 2 kept one process's (process 0's): a list of one.
    """
    every = bundle.get("process_datasets")
    if isinstance(every, list) and every:
        return [entry or {} for entry in every]
    return [bundle.get("datasets") or {}]


def positions_for(bundle: dict, process_index: int, process_count: int, where: str) -> dict:
    """The dataset positions that process `process_index` of `process_count` resumes from.

    The same process count: each process its own. Another count: the one position every
    saving process shared (a checkpoint of one process, or processes that all read the same
    data), which maps to any count.

    Raises:
      ValueError: the process count changed and the saved positions differ between
        processes, so they do not map to the new count (naming both counts).
    """
    positions = dataset_positions(bundle)
    if len(positions) == process_count:
        return positions[process_index]
    if all(entry == positions[0] for entry in positions) and all(
        _process_independent(state) for state in positions[0].values()
    ):
        return positions[0]
    raise ValueError(
        f"{where} was saved by {len(positions)} processes, each at its own data position, "
        f"and this run has {process_count} processes: a position of one of {len(positions)} "
        f"does not map to one of {process_count}. Resume on {len(positions)} process(es), "
        "or feed data whose position is global (loopax.ArrayDataset(..., "
        "shard_by_process=True), grain's ElasticIterator), or attach the checkpoint hook "
        "with restore='never' and start from loopax.load_params(...)"
    )


def _process_independent(state: Any) -> bool:
    """Whether a dataset position is global: the same for any number of processes."""
    if not isinstance(state, dict):
        return False
    if state.get("process_independent") is True:  # ArrayDataset(shard_by_process=True)
        return True
    iterator = state.get("iterator")  # an IterableDataset over grain's ElasticIterator
    return isinstance(iterator, dict) and "global_next_index" in iterator
