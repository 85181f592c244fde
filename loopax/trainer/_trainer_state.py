"""The Trainer's state: placed on the devices, read and written whole or in its plain form,
and the optimizer's live learning rate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from ..optimizers._learning_rate import (
    constant_learning_rate,
    get_learning_rate,
    set_learning_rate,
)
from ._models import NnxModel
from ._state import TrainState, from_plain, state_from_tree, to_plain

if TYPE_CHECKING:
    import optax

    from ._executors import ExecutorCache
    from ._parallel import Strategy
    from ._steps import StepBuilder

# A compiled copy: eager jnp.copy dispatches in ~20 µs, this in ~4 µs.
_copy_scalar = jax.jit(jnp.copy)


class StateAccess:
    """The part of `Trainer` that holds its train state; see `Trainer`."""

    # Provided by `Trainer`.
    optimizer: optax.GradientTransformation
    seed: int
    _strategy: Strategy
    _steps: StepBuilder
    _cache: ExecutorCache
    _state: TrainState | None
    _rng: jax.Array | None
    _global_step: int
    _unverified_source: str | None
    _learning_rate_leaf: int | None
    _constant_learning_rate: float | None
    model: Any
    _model: Any
    _make_initializer: Callable[[Any], Callable[..., Any]]

    @property
    def state(self) -> TrainState | None:
        """The whole train state without a device axis, or None before the first step."""
        if self._state is None:
            return None
        return self._strategy.unplace(self._state).replace(rng=self._rng)

    @state.setter
    def state(self, state: TrainState) -> None:
        if not isinstance(state, TrainState):
            raise TypeError(f"Trainer.state must be a TrainState, got {type(state).__name__}")
        if self._state is not None:
            expected = jax.tree.structure(self.state)
            if jax.tree.structure(state) != expected:
                raise ValueError(
                    "the new train state's structure differs from the trainer's: "
                    f"{jax.tree.structure(state)} vs {expected}"
                )
        self._adopt(state)

    def _adopt(self, state: TrainState) -> None:
        """Places `state` on the devices; its RNG key becomes the compiled-in constant."""
        rng = np.asarray(jax.device_get(state.rng), dtype=np.uint32)
        if self._rng is not None and not np.array_equal(rng, np.asarray(self._rng)):
            self._cache.clear()  # the steps were compiled with the old key
        self._rng = jnp.asarray(rng)
        host = jax.device_get(state.replace(rng=None))
        self._learning_rate_leaf: int | None = None  # found again in the new state
        # Without a schedule the rate changes only here (set_learning_rate adopts a state):
        # a log of it then needs no device copy.
        self._constant_learning_rate = constant_learning_rate(host.opt_state)
        # The key never changes during training, so the compiled steps hold it as a
        # constant instead of passing it in and out: each state leaf costs the runtime a
        # few microseconds per step.
        self._state = self._strategy.place_state(host)
        self._global_step = int(np.asarray(jax.device_get(state.step)))

    def state_dict(self) -> dict | None:
        """The train state as nested dicts of host arrays keyed by field names, or None
        before the first step.

        This is what checkpoints store: `params` and `model_state` as the model names
        them, `opt_state` with optax's field names, `step`, `rng`, `train_metrics`.
        """
        state = self.state
        if state is None:
            return None
        # A real copy: the next train step donates (reuses) the device buffers, and on CPU
        # `device_get` may return a view of them.
        return jax.tree.map(np.array, to_plain(state))

    def load_state_dict(self, tree: dict, *, where: str = "the given state") -> None:
        """Replaces the train state with `tree`, as `state_dict` returns it.

        Works before the first batch too: the state is then built from `tree` at once
        (`params`, `state`, `global_step` are available right away), and the model's
        variables are checked against it when the first batch shows their shapes.

        Args:
          tree: nested dicts of arrays, as `state_dict()` returns.
          where: what `tree` is, for error messages (e.g. the checkpoint's path).

        Raises:
          ValueError: `tree` does not fit the model's state (naming the first differing
            entry and both shapes).
        """
        if not isinstance(tree, dict) or not isinstance(tree.get("params"), dict):
            raise ValueError(f"{where} is not a loopax train state: it has no 'params' dict")
        if self._state is not None:
            self.state = from_plain(self.state, tree, where)
            return
        fresh_scale = self._steps.fresh_loss_scale()
        self._adopt(
            state_from_tree(
                tree, self.optimizer, self._steps.fresh_train_metrics(), where, fresh_scale
            )
        )
        self._unverified_source = where

    def _verify_loaded_state(self, spec: Any, inputs: list[Any]) -> None:
        """Checks a state loaded before the first batch against the model's variables."""
        where, self._unverified_source = self._unverified_source, None
        expected = dict(
            jax.eval_shape(self._make_initializer(spec), jax.random.PRNGKey(self.seed), inputs)
        )
        expected_params = expected.pop("params", {})
        state = self.state
        from_plain(
            {"params": expected_params, "model_state": expected},
            to_plain({"params": state.params, "model_state": state.model_state}),
            where,
        )

    @property
    def learning_rate(self) -> float | None:
        """The optimizer's live learning rate, or None when it has none to read (build it
        with `loopax.optimizers` or `optax.inject_hyperparams`) or before the first step.
        """
        rate = self.learning_rate_array()
        return None if rate is None else float(np.asarray(jax.device_get(rate)))

    def learning_rate_array(self) -> Any:
        """The live learning rate, without waiting for the device: the host value when no
        schedule drives it, else a device copy (the state's own buffers are reused by the
        next step); None as `learning_rate`.
        """
        if self._state is None:
            return None
        if self._constant_learning_rate is not None:
            return np.float32(self._constant_learning_rate)
        leaves = jax.tree.leaves(self._state.opt_state)
        if self._learning_rate_leaf is None:
            rate = get_learning_rate(self._state.opt_state)
            if rate is None:
                return None
            # Found once by a walk of the optimizer state; then by position, a few µs: a
            # TensorBoard log reads it every 100 steps.
            self._learning_rate_leaf = next(i for i, leaf in enumerate(leaves) if leaf is rate)
        rate = leaves[self._learning_rate_leaf]
        return _copy_scalar(self._strategy.unplace(rate))

    def set_learning_rate(self, value: float) -> None:
        """Sets the optimizer's learning rate for the next steps, without recompiling.

        Raises:
          RuntimeError: before the first step (the optimizer state does not exist yet).
          ValueError: the optimizer has no injectable learning rate, or a schedule drives
            it (see `loopax.optimizers.set_learning_rate`).
        """
        state = self.state
        if state is None:
            raise RuntimeError(
                "the learning rate can be set once the optimizer state exists, after the "
                "trainer's first step"
            )
        self.state = state.replace(opt_state=set_learning_rate(state.opt_state, value))

    def nnx_module(self) -> Any:
        """The `flax.nnx.Module` this trainer trains, updated in place with the current
        parameters and model state, ready to call (`module.eval()` for inference).

        Raises:
          TypeError: the trainer's model is not an NNX module.
        """
        if not isinstance(self._model, NnxModel):
            raise TypeError(
                f"nnx_module() is for a Trainer of a flax.nnx.Module; this one trains a "
                f"{type(self.model).__name__} (its parameters are trainer.params)"
            )
        state = self.state
        if state is None:
            return self._model.module
        params, model_state = jax.device_get((state.params, state.model_state))
        return self._model.update_module(params, model_state)
