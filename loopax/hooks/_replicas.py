"""`check_replicas`: compare every replicated array's copies across devices on a schedule."""

from __future__ import annotations

from typing import Any

from ..loop import Loop, Priority
from ._schedules import EveryNSteps


def check_replicas(
    loop: Loop, every_n_steps: int = 1000, *, priority: int = Priority.VALIDATE
) -> EveryNSteps:
    """Runs `trainer.check_replicas()` every `every_n_steps` steps (bobbin's replica check).

    At global steps that are multiples of `every_n_steps` (so a resumed run checks where an
    uninterrupted one would), every replicated array of the train state is compared across
    devices and processes by fingerprint; a copy that differs stops the run with a
    `loopax.HookError` whose cause is a `loopax.ReplicaMismatchError` naming the array and
    the device. At its default priority (`Priority.VALIDATE`) it runs before evaluations and
    checkpoints, so a diverged state is not saved. Attach it on every process of a
    multi-process run (each computes its devices' fingerprints; they are exchanged).

    Args:
      loop: the `loopax.Loop`.
      every_n_steps: check after step k iff `(k + 1) % every_n_steps == 0`. Each check
        reads every array once on its device and waits for the steps in flight.
      priority: the hook's priority.

    Returns:
      The hook's schedule (`hooks.EveryNSteps`).

    Raises:
      ValueError: `every_n_steps` is not a positive int.

    Example:
      >>> import jax, optax, numpy as np, flax.linen as nn
      >>> import loopax
      >>> from loopax import hooks
      >>> trainer = loopax.Trainer(lambda ctx, spec, x: nn.Dense(1)(x[0]),
      ...                          loopax.losses.mean_squared_error, optax.sgd(0.1),
      ...                          devices=jax.devices()[:2])
      >>> loop = loopax.Loop(trainer)
      >>> _ = hooks.check_replicas(loop, every_n_steps=2)
      >>> data = loopax.ArrayDataset(np.ones((8, 3), np.float32), np.ones((8, 1), np.float32),
      ...                            batch_size=4, loop_forever=True)
      >>> _ = loop.run_steps(data, 4)  # checked at global steps 2 and 4: the copies agree
    """
    schedule = EveryNSteps(every_n_steps)

    def check(loop: Loop, metrics: Any) -> None:
        del metrics
        loop.trainer.check_replicas()

    loop.on_step(f"check_replicas(every {every_n_steps} steps)", check, priority, when=schedule)
    return schedule
