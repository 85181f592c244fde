"""The Trainer's train state, placed on the devices: adopted, read back whole or in plain form.

Also the global step, the optimizer's live learning rate, and the initializers run when the
state is created.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from .._devices import start_host_copies
from ..optimizers import get_learning_rate, set_learning_rate
from ..optimizers._internal import check_not_schedule, constant_learning_rate
from ._models import NnxModel
from ._packed import PackedAverage, pack, unpack_placed, worth_packing
from ._replicas import check_replicas
from ._state import TrainState, from_plain, state_from_tree, to_plain, tree_paths, with_ema

if TYPE_CHECKING:
    import optax

    from ._parallel import Strategy
    from ._steps import StepBuilder

# A compiled copy: eager jnp.copy dispatches in ~20 µs, this in ~4 µs.
_copy_scalar = jax.jit(jnp.copy)
_NO_RATE = -1  # `PlacedState._learning_rate_leaf` of an optimizer state holding no rate


class PlacedState:
    """The train state on the devices, with its compiled-in RNG key and the global step.

    The key never changes during training, so the compiled steps hold it as a constant
    instead of passing it in and out: each state leaf costs the runtime a few microseconds
    per step. The placed state therefore has `rng=None`; `rng` holds the key.

    Args:
      strategy: places and unplaces the state.
      optimizer: builds a fresh optimizer state for a state loaded in plain form.
      on_new_key: called when an adopted state brings another RNG key (the programs
        compiled with the old one are stale).

    Attributes:
      device_state: the state on the devices (with `rng=None`), or None before there is
        one. Only this object changes it (and `global_step`): `adopt`, `advance`.
      rng: the RNG key the steps are compiled with, or None.
      global_step: optimizer steps taken (a Python int, never read from the device).
      unverified_source: where a state loaded before the first batch came from, until the
        model's variables are checked against it (`take_unverified`).
    """

    def __init__(
        self,
        strategy: Strategy,
        optimizer: optax.GradientTransformation,
        on_new_key: Callable[[], None],
    ):
        self._strategy = strategy
        self._optimizer = optimizer
        self._on_new_key = on_new_key
        self._initializers: list[Callable[[TrainState], TrainState]] = []
        self.device_state: TrainState | None = None
        self.rng: jax.Array | None = None
        self.global_step = 0
        self.unverified_source: str | None = None
        # Where the optimizer state holds the learning rate: the index of its leaf, None
        # until looked for, or _NO_RATE: it holds none (e.g. plain `optax.adam`).
        self._learning_rate_leaf: int | None = None
        self._constant_learning_rate: float | None = None

    def check_replicas(self) -> int:
        """Compares the copies of every replicated array of the placed state.

        See `_replicas.check_replicas`: each device fingerprints its blocks where they lie,
        processes exchange the fingerprints, and the copies of each block are compared.

        Returns:
          How many arrays have copies on several devices (0 before the first step).

        Raises:
          ReplicaMismatchError: naming the first array and device whose copy differs.
        """
        if self.device_state is None:
            return 0
        leaves = [("/".join(path), leaf) for path, leaf in tree_paths(self.device_state)]
        pmap = self._strategy.name == "pmap"  # its state has a leading device axis
        return check_replicas(leaves, self._strategy.devices, device_axis=pmap)

    @property
    def state(self) -> TrainState | None:
        """The whole train state without a device axis, or None; see `Trainer.state`."""
        if self.device_state is None:
            return None
        state = self._strategy.unplace(self.device_state).replace(rng=self.rng)
        if isinstance(state.ema_params, PackedAverage):
            state = state.replace(ema_params=unpack_placed(state.ema_params, state.params))
        return state

    @state.setter
    def state(self, state: TrainState) -> None:
        if not isinstance(state, TrainState):
            raise TypeError(f"Trainer.state must be a TrainState, got {type(state).__name__}")
        if self.device_state is not None:
            expected = jax.tree.structure(self.state)
            if jax.tree.structure(state) != expected:
                raise ValueError(
                    "the new train state's structure differs from the trainer's: "
                    f"{jax.tree.structure(state)} vs {expected}"
                )
        self.adopt(state)

    def adopt(self, state: TrainState) -> None:
        """Places `state` on the devices; its RNG key becomes the compiled-in constant.

        Its leaves may be host arrays or `jax.Array`s of any sharding; on a mesh they are
        resharded on the devices, never gathered to a host.
        """
        rng = np.asarray(jax.device_get(state.rng), dtype=np.uint32)
        if self.rng is not None and not np.array_equal(rng, np.asarray(self.rng)):
            self._on_new_key()  # the steps were compiled with the old key
        self.rng = jnp.asarray(rng)
        host = self._strategy.host_state(state.replace(rng=None))
        ema = host.ema_params
        if ema is not None and self._strategy.packs_average and worth_packing(host.params):
            host = host.replace(ema_params=pack(jax.tree.map(np.asarray, ema)))
        self._learning_rate_leaf = None  # found again in the new state
        # Without a schedule the rate changes only here (set_learning_rate adopts a state):
        # a log of it then needs no device copy.
        self._constant_learning_rate = constant_learning_rate(host.opt_state)
        self.device_state = self._strategy.place_state(host)
        self.global_step = int(np.asarray(jax.device_get(state.step)))

    def advance(self, state: TrainState, steps: int) -> None:
        """Takes the placed `state` a train program returned after `steps` optimizer steps."""
        self.device_state = state
        self.global_step += steps

    def create(self, state: TrainState) -> None:
        """Adopts a newly created `state`, after the initializers have seen it."""
        for initializer_fn in self._initializers:
            state = initializer_fn(state)
        self.adopt(state)

    def add_initializer(self, fn: Callable[[TrainState], TrainState]) -> None:
        """Runs `fn(state) -> state` when the state is created (now, if it exists)."""
        self._initializers.append(fn)
        state = self.state  # None exactly when `self.device_state` is
        if state is not None:
            self.state = fn(state)

    def replace_train_metrics(self, fresh: dict[str, Any]) -> None:
        """Replaces the train metric states with `fresh` (host) ones, if there is a state."""
        if self.device_state is not None:
            metrics = self._strategy.place_state(fresh)
            self.device_state = self.device_state.replace(train_metrics=metrics)

    def state_dict(self) -> dict | None:
        """The train state as nested dicts of host arrays; see `Trainer.state_dict`."""
        state = self.state
        if state is None:
            return None
        partial = [
            "/".join(path)
            for path, leaf in tree_paths(state)
            if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable
        ]
        if partial:
            raise ValueError(
                f"state_dict() would gather the whole state to this process, but {partial[0]!r} "
                f"(and {len(partial) - 1} more) are sharded across processes; save and "
                "restore with hooks.checkpoint, which writes each process's shards"
            )
        # A real copy: the next train step donates (reuses) the device buffers, and on CPU
        # `device_get` may return a view of them. The copies start together: one wait for
        # the device on an accelerator, not one per leaf.
        plain = to_plain(state)
        start_host_copies(jax.tree.leaves(plain))
        return jax.tree.map(np.array, plain)

    def state_shardings(self) -> dict | None:
        """Every state leaf's sharding, as `to_plain` nests them; see `Trainer.state_shardings`."""
        state = self.state
        if state is None:
            return None
        return to_plain(jax.tree.map(self._strategy.sharding_of, state))

    def load_state_dict(self, tree: dict, where: str, steps: StepBuilder) -> None:
        """Replaces the state with `tree`; see `Trainer.load_state_dict`.

        Before the first batch, the state is built from `tree` with `steps`' fresh train
        metrics and loss scale, and its source is kept for `take_unverified`. A tree without
        EMA weights starts them at its parameters when `steps` keep them (see `with_ema`).
        """
        if not isinstance(tree, dict) or not isinstance(tree.get("params"), dict):
            raise ValueError(f"{where} is not a loopax train state: it has no 'params' dict")
        tree = with_ema(tree, steps.config.ema_decay is not None)
        if self.device_state is not None:
            self.state = from_plain(self.state, tree, where)
            return
        # Shapes only: the tree holds the values (building them would compile tiny programs).
        fresh_metrics = jax.eval_shape(steps.fresh_train_metrics)
        fresh_scale = jax.eval_shape(steps.fresh_loss_scale)
        self.adopt(state_from_tree(tree, self._optimizer, fresh_metrics, where, fresh_scale))
        self.unverified_source = where

    def take_unverified(self) -> tuple[str, TrainState]:
        """Where the loaded state came from, and the state; it counts as verified after."""
        where, self.unverified_source = self.unverified_source, None
        state = self.state
        if where is None or state is None:
            raise RuntimeError("no loaded train state awaits verification")  # never: see caller
        return where, state

    def learning_rate_array(self) -> Any:
        """The live learning rate, or None; see `Trainer.learning_rate_array`."""
        if self.device_state is None:
            return None
        if self._constant_learning_rate is not None:
            return np.float32(self._constant_learning_rate)
        where = self._learning_rate_leaf
        if where == _NO_RATE:  # the walk found none in this state's structure
            return None
        leaves = jax.tree.leaves(self.device_state.opt_state)
        if where is None:
            rate = get_learning_rate(self.device_state.opt_state)
            # Found (or not) once by a walk of the optimizer state (dozens of Python calls);
            # then by position, a few µs: a TensorBoard log reads it every 100 steps. Only
            # `adopt` changes the state's structure, and it looks again.
            if rate is None:
                self._learning_rate_leaf = _NO_RATE
                return None
            where = next(i for i, leaf in enumerate(leaves) if leaf is rate)
            self._learning_rate_leaf = where
        rate = leaves[where]
        return _copy_scalar(self._strategy.unplace(rate))

    def set_learning_rate(self, value: float) -> None:
        """Sets the optimizer's learning rate; see `Trainer.set_learning_rate`."""
        check_not_schedule(value)  # before "no state yet": a schedule is never right here
        state = self.state
        if state is None:
            raise RuntimeError(
                "the learning rate can be set once the optimizer state exists, after the "
                "trainer's first step"
            )
        self.state = state.replace(opt_state=set_learning_rate(state.opt_state, value))

    def nnx_module(self, adapted: Any, model: Any) -> Any:
        """The NNX module holding the state's values; see `Trainer.nnx_module`.

        Args:
          adapted: the model as the steps call it.
          model: the model as the user gave it (for the message).
        """
        if not isinstance(adapted, NnxModel):
            raise TypeError(
                f"nnx_module() is for a Trainer of a flax.nnx.Module; this one trains a "
                f"{type(model).__name__} (its parameters are trainer.params)"
            )
        state = self.state
        if state is None:
            return adapted.module
        params, model_state = jax.device_get((state.params, state.model_state))
        return adapted.update_module(params, model_state)
