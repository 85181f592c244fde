"""Loopax checkpoints read back with no trainer: `load_params`, `load_variables`, `load_into`.

The parameters, every variable collection, or all of them set into an NNX module.
"""

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
    These are the raw parameters, as `trainer.params`; `load_variables` gives a model's
    other state (BatchNorm statistics) too, and the EMA weights where they were kept.

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
    return read_state(directory, step)["params"]


def load_variables(
    directory: str | os.PathLike[str], step: int | None = None, *, ema: bool | None = None
) -> dict:
    """Every variable collection saved in a loopax checkpoint, as numpy arrays.

    `{"params": ..., "batch_stats": ..., ...}`: the parameters and the model's other state
    (BatchNorm statistics and any mutable collection; `"nnx"` for an NNX module's), read
    and checked as `load_params` reads them. Ready for a Linen module's
    `module.apply(variables, x)` and for `Trainer(..., init_params=variables)`, which then
    starts from the statistics too; an NNX module takes them with `load_into`. A checkpoint
    of a Trainer with `ema_decay` gives its EMA weights as `"params"` (those its evaluations
    and predictions used), unless `ema=False`.

    Args:
      directory: a directory written by `hooks.checkpoint`.
      step: the checkpoint's global step; default the newest good one.
      ema: None: the EMA weights when the checkpoint holds them, else the parameters;
        True: the EMA weights (an error without them); False: the raw parameters.

    Returns:
      The variables, nested dicts of numpy arrays, `"params"` first.

    Raises:
      FileNotFoundError, loopax.hooks.DamagedCheckpointError: as `load_params`.
      ValueError: as `load_params`, or `ema=True` and the checkpoint holds no EMA weights.

    Example:
      >>> import tempfile, jax, numpy as np, optax, flax.linen as nn, loopax
      >>> class Net(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x, train: bool = False):
      ...         x = nn.BatchNorm(use_running_average=not train)(x)
      ...         return nn.Dense(1)(x)
      >>> trainer = loopax.Trainer(Net(), loopax.losses.mean_squared_error, optax.sgd(0.1),
      ...     devices=jax.devices()[:1])
      >>> loop = loopax.Loop(trainer)
      >>> directory = tempfile.mkdtemp()
      >>> _ = loopax.hooks.checkpoint(loop, directory)
      >>> x = np.arange(8, dtype=np.float32).reshape(4, 2)
      >>> _ = loop.run_steps(loopax.ArrayDataset(x, np.ones((4, 1), np.float32), 4,
      ...     loop_forever=True), 3)
      >>> variables = loopax.load_variables(directory)
      >>> sorted(variables)
      ['batch_stats', 'params']
      >>> bool(np.allclose(Net().apply(variables, x), trainer.predict(x)))
      True
    """
    state = read_state(directory, step)
    params = state["params"]
    if ema is not False and "ema_params" in state:
        params = state["ema_params"]
    elif ema:
        raise ValueError(
            f"the checkpoint in {str(directory)!r} holds no EMA weights (it was saved by a "
            "Trainer without ema_decay); load its parameters with ema=None or False"
        )
    return {"params": params, **state.get("model_state", {})}


def load_into(
    module: Any,
    directory: str | os.PathLike[str],
    step: int | None = None,
    *,
    ema: bool | None = None,
) -> Any:
    """Sets a `flax.nnx.Module`'s parameters and other state from a loopax checkpoint.

    The parameters and every other variable the module holds (e.g. `nnx.BatchNorm`'s
    statistics) take the values a Trainer of the same module saved; each is checked (name,
    shape, dtype) before any is set. Its RNG streams and its train/eval mode stay as they
    are: call `module.eval()` to predict.

    Args:
      module: the `flax.nnx.Module`, built as the trained one was (its values are replaced).
      directory: a directory written by `hooks.checkpoint`.
      step: the checkpoint's global step; default the newest good one.
      ema: which parameters, as `load_variables` takes it (default: the EMA weights when
        the checkpoint holds them).

    Returns:
      `module`.

    Raises:
      TypeError: `module` is not a `flax.nnx.Module`.
      ValueError: the checkpoint does not fit the module (naming the first differing entry
        and both shapes), or was saved from a Linen model.
      FileNotFoundError, loopax.hooks.DamagedCheckpointError: as `load_params`.
    """
    from .trainer._internal import load_nnx_variables  # noqa: PLC0415

    where = f"the checkpoint in {str(Path(directory).expanduser())!r}"
    if step is not None:
        where = f"checkpoint {step} in {str(Path(directory).expanduser())!r}"
    return load_nnx_variables(module, load_variables(directory, step, ema=ema), where)


def read_state(directory: str | os.PathLike[str], step: int | None) -> dict:
    """The whole train state (plain form) of a checkpoint, as numpy; see `load_params`."""
    import orbax.checkpoint as ocp  # noqa: PLC0415  (heavy: imported only when used)

    from .hooks import DamagedCheckpointError  # noqa: PLC0415
    from .hooks._internal import (  # noqa: PLC0415
        check_directory,
        open_manager,
        read,
        read_newest_good,
        wait_for_saves,
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
            return read(manager, ocp, step)[0]
        found = read_newest_good(manager, ocp, directory, move_damaged=False)
        if found is None:
            raise DamagedCheckpointError(f"every checkpoint in {str(directory)!r} is damaged")
        return found[1]
    finally:
        manager.close()
