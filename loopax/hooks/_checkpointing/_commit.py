"""A checkpoint's commit, on the writer thread: verify, fingerprint, agree, write with Orbax."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...loop import NonFiniteLossError
from ._coordination import Coordination
from ._format import BUNDLE_ITEM, STATE_ITEM, with_positions
from ._snapshot import Snapshot, check, local_part


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
        raise NonFiniteLossError(
            f"refused to save checkpoint {step}: {bad!r} holds NaN or infinite values; the "
            "newest good checkpoint is kept"
        )
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
