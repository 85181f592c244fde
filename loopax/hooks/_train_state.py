"""The trainer's state as the hooks that read it between steps need it: present."""

from __future__ import annotations

from ..trainer import Trainer, TrainState


def state_of(trainer: Trainer, hook: str) -> TrainState:
    """`trainer.state`, or a RuntimeError naming `hook` when no step has created it yet."""
    state = trainer.state
    if state is None:
        raise RuntimeError(
            f"{hook} needs the trainer's state, which the first train step creates; run a "
            "step (or restore a checkpoint) before this hook reads it"
        )
    return state
