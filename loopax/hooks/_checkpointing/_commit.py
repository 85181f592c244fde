"""A checkpoint's commit, on the writer thread: verify, fingerprint, agree, write with Orbax."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...loop import NonFiniteLossError
from ...loop._internal import SET_RATE_FIX, rate_is
from ._coordination import Coordination
from ._format import BUNDLE_ITEM, STATE_ITEM, with_positions
from ._snapshot import Snapshot, check, is_learning_rate, local_part, non_finite_value


def commit(
    manager: Any,
    ocp: Any,
    coordination: Coordination,
    save: int,
    step: int,
    snapshot: Snapshot,
    bundle: dict,
    best_metric: dict[str, float] | None,
    flushed: Callable[[], None],
) -> None:
    """Writes checkpoint `step` once its logs are on disk; returns when it is committed.

    Runs off the training thread. Every process's dataset positions and its part of the
    device checks are exchanged first, so that every process decides alike whether the
    state is fit to save; then, once every process is there, Orbax writes the arrays and
    the bundle and renames the checkpoint into place (atomic).

    Args:
      manager: the directory's Orbax `CheckpointManager`.
      ocp: the `orbax.checkpoint` module.
      coordination: the exchanges between processes.
      save: the number of this save among the Checkpointer's (names its exchanges).
      step: the checkpoint's global step.
      snapshot: the state, as taken on the training thread.
      bundle: the JSON bundle, without fingerprints and other processes' positions yet.
      best_metric: `{best_metric: value}` for the retention by metric, or None.
      flushed: waits until the logs of the step are on disk.

    Raises:
      NonFiniteLossError: the state holds NaN or infinite values (nothing is written).
      CoordinationError: another process did not answer in time.
    """
    flushed()
    every = coordination.all_gather(
        f"save{save}",
        {"datasets": bundle["datasets"], **local_part(snapshot)},
        f"the dataset positions and array checks of checkpoint {step}",
    )
    fingerprints, bad = check(snapshot, every)
    if bad is not None:
        raise NonFiniteLossError(_refused(snapshot, step, bad))
    bundle = with_positions(bundle, [part["datasets"] for part in every])
    bundle["fingerprints"] = fingerprints
    # Everyone is here and alive before Orbax's own barriers (their timeout is Orbax's).
    coordination.barrier(f"save{save}/start", f"the save of checkpoint {step}")
    coordination.forget(f"save{save}")  # every process has read every part now
    manager.save(
        step,
        args=ocp.args.Composite(
            **{
                STATE_ITEM: ocp.args.StandardSave(snapshot.plain),
                BUNDLE_ITEM: ocp.args.JsonSave(bundle),
            }
        ),
        metrics=best_metric,
        force=True,
    )
    manager.wait_until_finished()


def _refused(snapshot: Snapshot, step: int, bad: str) -> str:
    """Why checkpoint `step` was refused: `bad` holds NaN or infinity.

    A learning rate is named as the loss check and `hooks.nan_guard` name it (its value, the
    step, the one fix), with the array it is kept in; any other array by its path.
    """
    kept = "the newest good checkpoint is kept"
    if is_learning_rate(bad):
        try:
            value = non_finite_value(snapshot, bad)
        except Exception:  # noqa: BLE001 - the path still names it
            value = None
        if value is not None:
            return (
                f"refused to save checkpoint {step}: {rate_is(value, step - 1)}, kept in "
                f"{bad!r}. {SET_RATE_FIX}; {kept}"
            )
        return (
            f"refused to save checkpoint {step}: the learning rate ({bad!r}) holds NaN or "
            f"infinite values. {SET_RATE_FIX}; {kept}"
        )
    return f"refused to save checkpoint {step}: {bad!r} holds NaN or infinite values; {kept}"
