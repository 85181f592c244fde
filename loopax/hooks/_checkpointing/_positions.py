"""Dataset positions: taken for a save on every process, given back to each at the next run.

With several processes each holds its own share of the data, so each has its own position:
the writer gathers them all to process 0 (through the coordination service) and the
checkpoint keeps one per process. A restore gives each process its own (`positions_for`).
Applying them is agreed too: a process whose dataset refuses its position makes every
process raise, instead of leaving the others waiting in the first step's collective.
"""

from __future__ import annotations

from typing import Any

from ... import _warnings
from ._coordination import Coordination


def dataset_states(dataset: Any) -> dict[str, Any]:
    """`{name: dataset.get_state()}`, or `{}` for no dataset or one without `get_state`."""
    if dataset is not None and callable(getattr(dataset, "get_state", None)):
        return {getattr(dataset, "name", "dataset"): dataset.get_state()}
    return {}


def _apply(dataset: Any, saved: dict, step: int | None) -> None:
    if not saved:
        return
    name = getattr(dataset, "name", "dataset")
    if name in saved and callable(getattr(dataset, "set_state", None)):
        dataset.set_state(saved[name])
        return
    _warnings.warn(
        f"the checkpoint of step {step} holds the position of dataset(s) "
        f"{sorted(saved)}, but this run trains on {name!r}"
        f"{'' if callable(getattr(dataset, 'set_state', None)) else ' (no set_state)'}; "
        "it starts where it is, so the batches differ from an uninterrupted run"
    )


def apply_positions(
    dataset: Any, saved: dict, step: int | None, coordination: Coordination, key: str
) -> None:
    """Sets `dataset` to its saved position; every process raises if any one could not.

    Warns (and leaves the dataset where it is) when `saved` holds the position of another
    dataset or the dataset has no `set_state`.

    Raises:
      Exception: what the dataset's `set_state` raised, on this process.
      ValueError: on the other processes, naming the process whose dataset refused.
    """
    error: BaseException | None = None
    try:
        _apply(dataset, saved, step)
    except Exception as err:  # every process must hear of it before raising
        error = err
    if coordination.single:
        if error is not None:
            raise error
        return
    verdicts = coordination.all_gather(
        key,
        None if error is None else f"{type(error).__name__}: {error}",
        f"restoring the dataset positions of checkpoint {step}",
    )
    if error is not None:
        raise error
    failed = [(process, v) for process, v in enumerate(verdicts) if v is not None]
    if failed:
        process, message = failed[0]
        raise ValueError(
            f"process {process} could not restore its dataset position from the checkpoint "
            f"of step {step} ({message}); every process stops here so that none waits for it"
        )
