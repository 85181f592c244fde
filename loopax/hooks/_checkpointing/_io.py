"""Reading, verifying and setting aside loopax checkpoints.

A checkpoint is good only if its description is a loopax one for its step, every array
matches what was written with it (version 3: its layout-independent fingerprint, see
`_fingerprint`; versions 1 and 2: the CRC-32 of its shape, dtype and bytes), and every float
array is finite. Anything else makes it damaged: it is moved to `<directory>/damaged/` (never
deleted) and the next newest is tried. With several processes every process reads and checks
each candidate, and they agree: a checkpoint that any process finds damaged is set aside
for all.
"""

from __future__ import annotations

import logging
import shutil
import zlib
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ... import _warnings
from ...loop._internal import first_non_finite, tree_paths
from ._coordination import Coordination
from ._fingerprint import host_fingerprint
from ._format import ABANDONED_DIR, BUNDLE_ITEM, DAMAGED_DIR, FORMAT, READABLE_VERSIONS, STATE_ITEM


class DamagedCheckpointError(ValueError):
    """A checkpoint could not be read, or its arrays are not what was saved."""


def checksums(plain: dict) -> dict[str, str]:
    """`{"params/Dense_0/kernel": "crc32 hex", ...}` over each array's shape, dtype and bytes."""
    result = {}
    for path, leaf in tree_paths(plain):
        array = np.ascontiguousarray(leaf)
        crc = zlib.crc32(f"{array.dtype.str}{array.shape}".encode())
        crc = zlib.crc32(array.data.cast("B"), crc) if array.size else crc
        result["/".join(path)] = f"{crc:08x}"
    return result


def fingerprints(plain: dict) -> dict[str, str]:
    """`{"params/Dense_0/kernel": "float32[2,1]:1a2b3c4d", ...}`: each host array's fingerprint."""
    return {"/".join(path): host_fingerprint(leaf) for path, leaf in tree_paths(plain)}


def _shown(saved: str | None, read: str | None) -> tuple[str | None, str | None]:
    """Both values, without the `dtype[shape]:` they share (so the digits stand out)."""
    if saved and read and ":" in saved and saved.rsplit(":", 1)[0] == read.rsplit(":", 1)[0]:
        return saved.rsplit(":", 1)[1], read.rsplit(":", 1)[1]
    return saved, read


def verify(plain: dict, bundle: dict) -> None:
    """Raises `DamagedCheckpointError` unless `plain` matches what `bundle` says and is finite.

    A description with CRC-32 `checksums` (versions 1 and 2) is checked with them, one with
    `fingerprints` (version 3) with those. Every float must be finite. Checkpoints of loopax
    0.1 have no checksums: only finiteness is checked for them.
    """
    expected, compute = bundle.get("checksums"), checksums
    if expected is None:
        expected, compute = bundle.get("fingerprints"), fingerprints
    if expected is not None:
        actual = compute(plain)
        for name in sorted(set(expected) | set(actual)):
            if expected.get(name) != actual.get(name):
                saved, read = _shown(expected.get(name), actual.get(name))
                raise DamagedCheckpointError(
                    f"array {name!r} does not match the checksum written with it (saved "
                    f"{saved}, read {read}): its files were changed or corrupted on disk"
                )
    bad = first_non_finite(plain)
    if bad is not None:
        raise DamagedCheckpointError(f"array {bad!r} holds NaN or infinite values")


def read_bundle(manager: Any, ocp: Any, step: int) -> Any:
    """The JSON description of checkpoint `step`, as stored (not checked)."""
    return manager.restore(step, args=ocp.args.Composite(**{BUNDLE_ITEM: ocp.args.JsonRestore()}))[
        BUNDLE_ITEM
    ]


def read(manager: Any, ocp: Any, step: int) -> tuple[dict, dict]:
    """Reads checkpoint `step` into host arrays and checks it.

    Any readable format version: the state is returned as stored (see
    `_format.named_train_metrics` for version 1's train metrics).

    Raises:
      Exception: anything reading it raised; `DamagedCheckpointError` when it reads but is
        not what was saved.
    """
    bundle = read_bundle(manager, ocp, step)
    if not isinstance(bundle, dict) or bundle.get("format") != FORMAT:
        raise DamagedCheckpointError(
            f"its {BUNDLE_ITEM!r} item is not a loopax checkpoint description"
        )
    if bundle.get("version") not in READABLE_VERSIONS or bundle.get("global_step") != step:
        raise DamagedCheckpointError(
            f"version {bundle.get('version')} / step {bundle.get('global_step')} in its "
            f"description, expected a version in {list(READABLE_VERSIONS)} / step {step}"
        )
    metadata = manager.item_metadata(step)[STATE_ITEM]
    tree = getattr(metadata, "tree", metadata)
    if not isinstance(tree, dict) or not tree:
        raise DamagedCheckpointError("its state item has no arrays")
    target = jax.tree.map(lambda array: np.zeros(array.shape, array.dtype), tree)
    state = manager.restore(
        step, args=ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(target)})
    )[STATE_ITEM]
    state = jax.tree.map(np.asarray, state)
    verify(state, bundle)
    return state, bundle


def set_aside(directory: Path, step: int, into: str = DAMAGED_DIR) -> Path | None:
    """Moves checkpoint `step` to `<directory>/<into>/<step>`; returns where it went.

    `into` is `damaged` (by default) or `abandoned`. Only process 0 moves it; a name taken
    already gets a suffix (`<step>.2`), so nothing set aside before is overwritten.
    """
    if jax.process_index() != 0:
        return None
    damaged = directory / into
    damaged.mkdir(exist_ok=True)
    destination, count = damaged / str(step), 2
    while destination.exists():
        destination, count = damaged / f"{step}.{count}", count + 1
    shutil.move(str(directory / str(step)), str(destination))
    return destination


def abandon_after(
    manager: Any, directory: Path, coordination: Coordination, step: int, key: str
) -> list[int]:
    """Training goes on from `step`: moves the checkpoints after it to `<directory>/abandoned/`.

    They hold another trajectory (that of the run a restore of an older step left, or of a
    run before a fresh start): resumed from, they would pass for this run's, and this run's
    saves of their steps would be skipped as done. Moved, never deleted, with one warning
    (the logs drop their points after `step` as on every resume). With several processes
    process 0 moves them and every process waits for it (exchange `key`); every process
    sees the same steps on disk, so all decide alike.

    Returns:
      The steps moved, ascending (none: nothing was done).
    """
    newer = [later for later in sorted(manager.all_steps()) if later > step]
    if not newer:
        return []
    for later in newer:
        set_aside(directory, later, ABANDONED_DIR)
    if not coordination.single:
        coordination.barrier(key, f"setting checkpoints {newer} aside")
    manager.reload()
    if coordination.process_index == 0:
        _warnings.warn(
            f"training goes on from step {step}, before checkpoints {newer} in "
            f"{str(directory)!r}: they hold another trajectory and will not be resumed from; "
            f"moved to {str(directory / ABANDONED_DIR)!r}"
        )
    return newer


def set_aside_entries(directory: Path) -> list[str]:
    """The names of the checkpoints in `<directory>/damaged/`."""
    damaged = directory / DAMAGED_DIR
    return sorted(entry.name for entry in damaged.iterdir()) if damaged.is_dir() else []


def read_agreed(
    manager: Any, ocp: Any, step: int, coordination: Coordination, key: str
) -> tuple[dict, dict]:
    """`read` on every process; every process raises if it failed on any.

    Raises:
      DamagedCheckpointError: it could not be read or checked (on any process).
      CoordinationError: another process did not answer within the timeout.
    """
    found = _read_checked(manager, ocp, step)
    if coordination.single:
        if isinstance(found, BaseException):
            raise found
        return found
    error = f"{type(found).__name__}: {found}" if isinstance(found, BaseException) else None
    verdicts = coordination.all_gather(
        f"{key}/{step}", error, f"checking checkpoint {step} on every process"
    )
    failed = [(process, v) for process, v in enumerate(verdicts) if v is not None]
    if failed:
        process, message = failed[0]
        raise DamagedCheckpointError(
            f"checkpoint {step} could not be read or checked on process {process}: {message}"
        ) from (found if isinstance(found, BaseException) else None)
    assert not isinstance(found, BaseException)
    return found


def _read_checked(manager: Any, ocp: Any, step: int) -> tuple[dict, dict] | BaseException:
    try:
        return read(manager, ocp, step)
    except Exception as err:  # any failure to read makes it unusable
        return err


def read_newest_good(
    manager: Any,
    ocp: Any,
    directory: Path,
    *,
    move_damaged: bool = True,
    coordination: Coordination | None = None,
    key: str = "restore",
) -> tuple[int, dict, dict] | None:
    """`(step, state, bundle)` of the newest good checkpoint, or None when none is.

    Every newer damaged one draws a warning naming it and why, and is moved to
    `<directory>/damaged/` (with `move_damaged`; else left where it is, for a reader).
    With a `coordination` of several processes, every process checks each candidate and
    they agree (exchanges named `key`): one that any process found damaged is damaged for
    all, process 0 moves it, and every process waits for that before reading on.

    Raises:
      CoordinationError: another process did not answer within the timeout.
    """
    together = coordination is not None and not coordination.single
    for step in sorted(manager.all_steps(), reverse=True):
        found = _read_checked(manager, ocp, step)
        error = f"{type(found).__name__}: {found}" if isinstance(found, BaseException) else None
        if together:
            assert coordination is not None
            verdicts = coordination.all_gather(
                f"{key}/{step}", error, f"checking checkpoint {step} on every process"
            )
            failed = [(process, v) for process, v in enumerate(verdicts) if v is not None]
            if failed and error is None:
                process, error = failed[0]
                error = f"on process {process}: {error}"
        if error is None:
            assert not isinstance(found, BaseException)
            return step, *found
        moved = set_aside(directory, step) if move_damaged else None
        kept = "moved aside" if together and move_damaged else "left in place"
        kept = f"moved to {str(moved)!r}" if moved else kept
        _warnings.warn(
            f"checkpoint {str(directory / str(step))!r} is damaged ({error}); falling back: "
            f"reading the next newest. It was not deleted: it was {kept}"
        )
        if move_damaged:  # on every process: process 0 moved it
            if together:
                assert coordination is not None
                coordination.barrier(f"{key}/{step}/moved", f"setting checkpoint {step} aside")
            manager.reload()
    return None


def read_metric_values(manager: Any, ocp: Any, metric: str) -> dict[int, float]:
    """`{step: value}` of `metric` in the descriptions of the checkpoints on disk.

    The unreadable ones and those without the value are left out.
    """
    values = {}
    for step in manager.all_steps():
        try:
            bundle = read_bundle(manager, ocp, step)
        except Exception:  # noqa: BLE001 - an unreadable one is no candidate
            continue
        if not isinstance(bundle, dict):
            continue
        value = (bundle.get("best_metric") or {}).get(metric)
        if value is not None:
            values[step] = float(value)
    return values


class _FirstOfEqualBest:
    """Orbax's `BestN`, keeping the earliest of checkpoints whose values are equal.

    `BestN` sorts stably and keeps the last: of equal values, the newest. The best step is
    the first that reached the value, as early stopping (and Keras) count only a strict
    improvement: a tie kept the other way would lose the step early stopping restores.
    """

    def __init__(self, best: Any):
        self._best = best

    def should_preserve(self, checkpoints: Any, *, context: Any) -> list[bool]:
        newest_first = list(reversed(checkpoints))
        return list(reversed(self._best.should_preserve(newest_first, context=context)))


def open_manager(
    ocp: Any,
    directory: Path,
    *,
    keep: int | None = None,
    best_metric: str | None = None,
    best_mode: str = "min",
    keep_best: int = 1,
    keep_period: int | None = None,
    create: bool = True,
    barrier_prefix: str | None = None,
    cleanup: bool | None = None,
) -> Any:
    """The Orbax `CheckpointManager` of a loopax checkpoint directory, with its retention.

    It keeps the newest `keep`, the `keep_best` best by `best_metric`, multiples of `keep_period`;
    by default everything (a reader's manager deletes nothing).

    With several processes Orbax's barriers go through the coordination service (named with
    `barrier_prefix`), not through a device collective, so a save can run beside the
    training thread's steps; the directory must then exist already (Orbax creates none).
    `cleanup` (default: `create`) has Orbax remove the leftovers of cut-off saves. A reader
    (`create=False`) is opened quietly: Orbax's notes that it is read-only are not shown.
    """
    from orbax.checkpoint import checkpoint_managers as policies  # noqa: PLC0415

    preserve: list[Any] = [policies.LatestN(keep)]
    if best_metric is not None:
        best = policies.BestN(
            get_metric_fn=lambda metrics: metrics[best_metric],
            reverse=best_mode == "min",  # BestN keeps the largest after sorting
            n=keep_best,
            keep_checkpoints_without_metrics=False,
        )
        preserve.append(_FirstOfEqualBest(best))
    if keep_period is not None:
        preserve.append(policies.EveryNSteps(interval_steps=keep_period))
    processes = jax.process_count()
    every_process = ocp.options.MultiprocessingOptions(
        primary_host=0,
        active_processes=set(range(processes)) if processes > 1 else None,
        barrier_sync_key_prefix=barrier_prefix if processes > 1 else None,
    )
    options = ocp.CheckpointManagerOptions(
        preservation_policy=policies.AnyPreservationPolicy(preserve),
        multiprocessing_options=every_process,
        # The loopax writer thread makes the whole save, so Orbax itself saves synchronously.
        enable_async_checkpointing=False,
        # Leftovers of saves cut off by a crash: never committed, so never checkpoints.
        cleanup_tmp_directories=create if cleanup is None else cleanup,
        create=create and processes == 1,
        read_only=not create,
        save_interval_steps=1 if create else 0,  # a reader saves nothing (Orbax says so)
    )
    absl = logging.getLogger("absl")
    level = absl.level
    if not create:  # "Given directory is read only": what a reader is, not news
        absl.setLevel(logging.ERROR)
    try:
        return ocp.CheckpointManager(
            directory,
            options=options,
            item_handlers={
                STATE_ITEM: ocp.StandardCheckpointHandler(),
                BUNDLE_ITEM: ocp.JsonCheckpointHandler(),
            },
        )
    finally:
        absl.setLevel(level)
