"""`load_params`: the parameters of a loopax checkpoint, with no model or trainer."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def load_params(directory: str | os.PathLike[str], step: int | None = None) -> Any:
    """The trained parameters saved in a loopax checkpoint directory, as numpy arrays.

    Reads them with Orbax and checks them as a restore does (the checksums written with them,
    finite values); no model, trainer or devices needed. The result is the nested dict of
    `trainer.params` (`{"Dense_0": {"kernel": ..., "bias": ...}, ...}`), ready for
    `Trainer(..., init_params=...)`, `model.apply({"params": ...}, x)` or your own code.

    Args:
      directory: a directory written by `hooks.checkpoint`.
      step: the checkpoint's global step; default the newest good one (a damaged newer one is
        skipped with a warning, and left where it is).

    Returns:
      The parameters, nested dicts of numpy arrays.

    Raises:
      FileNotFoundError: the directory or the step does not exist, or holds no checkpoint.
      ValueError: the directory holds something that is not a loopax checkpoint.
      loopax.hooks.DamagedCheckpointError: checkpoint `step` (given) is damaged, or every
        checkpoint is.

    Example:
      >>> import tempfile, jax, numpy as np, optax, flax.linen as nn, loopax
      >>> trainer = loopax.Trainer(lambda ctx, spec, x: nn.Dense(1)(x[0]),
      ...     loopax.losses.mean_squared_error, optax.sgd(0.1), devices=jax.devices()[:1])
      >>> loop = loopax.Loop(trainer)
      >>> directory = tempfile.mkdtemp()
      >>> _ = loopax.hooks.checkpoint(loop, directory)
      >>> _ = loop.run_steps(loopax.ArrayDataset(np.ones((4, 2), np.float32),
      ...     np.ones((4, 1), np.float32), 4, loop_forever=True), 3)
      >>> params = loopax.load_params(directory)
      >>> params["Dense_0"]["kernel"].shape, bool(np.all(params["Dense_0"]["kernel"]
      ...     == jax.device_get(trainer.params)["Dense_0"]["kernel"]))
      ((2, 1), True)
    """
    import orbax.checkpoint as ocp  # noqa: PLC0415  (heavy: imported only when used)

    from .hooks._checkpointing._active import wait_for_saves  # noqa: PLC0415
    from .hooks._checkpointing._format import check_directory  # noqa: PLC0415
    from .hooks._checkpointing._io import (  # noqa: PLC0415
        DamagedCheckpointError,
        open_manager,
        read,
        read_newest_good,
    )

    directory = Path(directory).expanduser().absolute()
    wait_for_saves(directory)  # a run returns before its end-of-run save is committed
    if not directory.is_dir():
        raise FileNotFoundError(f"no checkpoint directory {str(directory)!r}")
    check_directory(directory)
    manager = open_manager(ocp, directory, create=False)
    try:
        steps = sorted(manager.all_steps(), reverse=True)
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {str(directory)!r}")
        if step is not None:
            if step not in steps:
                raise FileNotFoundError(
                    f"no checkpoint of step {step} in {str(directory)!r}; there are {sorted(steps)}"
                )
            return read(manager, ocp, step)[0]["params"]
        found = read_newest_good(manager, ocp, directory, move_damaged=False)
        if found is None:
            raise DamagedCheckpointError(f"every checkpoint in {str(directory)!r} is damaged")
        return found[1]["params"]
    finally:
        manager.close()
