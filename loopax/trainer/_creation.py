"""The train state's creation from the first batch, compiled beside the first step's program.

Only a batch shows the model's variables, so the state is created when the first program
is compiled. Creating it is a program of its own (the model's initializers, the optimizer
and metric states), about as long to compile as a train step; it compiles on a background
thread while the first program, lowered against the state's shapes, compiles on the
training thread. A state loaded before the first batch is checked against the model's
variables instead (shapes only: nothing compiles).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _background
from ._compiler_options import compile_lowered
from ._models import no_parameters_message
from ._packed import pack_abstract, worth_packing
from ._state import TrainState, from_plain, to_plain

if TYPE_CHECKING:
    import optax

    from ._parallel import Strategy
    from ._placed_state import PlacedState
    from ._steps import StepBuilder


@dataclasses.dataclass(frozen=True)
class StateRecipe:
    """What the programs build the state from: the model, its seed and its start.

    Attributes:
      given: the model as the user gave it (for messages).
      adapted: the model as the step bodies call it (`_models.adapt`).
      optimizer: builds the optimizer state.
      seed: seeds the parameters' initialization.
      init_params: the parameters to start from (host arrays), or None for fresh ones.
    """

    given: Any
    adapted: Any
    optimizer: optax.GradientTransformation
    seed: int
    init_params: Any


@dataclasses.dataclass(frozen=True)
class PendingState:
    """A train state being created: its program compiling in the background.

    Attributes:
      compiled: the future of the compiled creation program.
      arguments: what it runs on.
      abstract: the placed state's shapes, dtypes and shardings, to lower programs against.
      rng: the RNG key the state will hold, which programs are compiled with.
      model_state: the model-state collections `init_params` gave (host arrays), which
        replace the created ones.
    """

    compiled: concurrent.futures.Future
    arguments: tuple
    abstract: TrainState
    rng: jax.Array
    model_state: dict = dataclasses.field(default_factory=dict)


_INIT_PARAMS_HINT = (
    "pass the parameters or variables of this model, e.g. loopax.load_params(directory) or "
    "loopax.load_variables(directory) of a checkpoint of the same model"
)


def holds_variables(init_params: Any, params: Any) -> bool:
    """Whether `init_params` are variables (`{"params": ..., "batch_stats": ...}`).

    Rather than the parameters themselves: the model's `params` have no entry `"params"`
    of their own at their top.
    """
    return (
        isinstance(init_params, dict)
        and isinstance(init_params.get("params"), dict)
        and not (isinstance(params, dict) and "params" in params)
    )


def _given_model_state(state: TrainState, given: dict) -> dict:
    """The created state's model state with the collections `init_params` gave instead.

    Raises:
      ValueError: a collection the model does not have, or one that does not fit it
        (naming the first differing entry and both shapes).
    """
    model_state = dict(state.model_state)
    for name, collection in given.items():
        if name not in model_state:
            raise ValueError(
                f"init_params holds the collection {name!r}, which the model does not have "
                f"(it has {sorted(['params', *model_state])}); {_INIT_PARAMS_HINT}"
            )
        model_state[name] = from_plain(
            model_state[name], collection, f"init_params[{name!r}]", hint=_INIT_PARAMS_HINT
        )
    return model_state


def _signature(tree: Any) -> tuple:
    """What a compiled program checks of its arguments: structure, shapes, dtypes, placement."""
    leaves, structure = jax.tree.flatten(tree)
    return structure, tuple(
        (
            tuple(np.shape(leaf)),
            np.dtype(leaf.dtype),
            bool(getattr(leaf, "weak_type", False)),
            getattr(leaf, "sharding", None),
        )
        for leaf in leaves
    )


class StateCreator:
    """Creates the train state from the first batch, or checks a loaded one against the model.

    Args:
      recipe: what the state is built from.
      strategy: where the state lives.
      placed: the train state the programs run on.

    Attributes:
      pending: the state being created, or None.
    """

    def __init__(self, recipe: StateRecipe, strategy: Strategy, placed: PlacedState):
        self._recipe = recipe
        self._strategy = strategy
        self._placed = placed
        self.pending: PendingState | None = None
        self._fresh_train_metrics: dict[str, Any] | None = None

    def fresh_train_metrics(self, steps: StepBuilder) -> dict[str, Any]:
        """The train metric states before any step (host arrays when the state was created).

        Those the created state started with: a copy kept then, so that resetting the train
        metrics compiles nothing (the creation program made them inside itself).
        """
        if self._fresh_train_metrics is not None:
            return self._fresh_train_metrics
        return steps.fresh_train_metrics()

    def prepare(self, steps: StepBuilder, spec: Any, model_inputs: Callable[[], list]) -> None:
        """Before a program is lowered: starts creating the state, or checks a loaded one.

        `model_inputs()` is one step's inputs of the batch the program is compiled for.
        Nothing happens when the state exists and is checked, or is being created.
        """
        placed = self._placed
        if self.pending is not None:
            return
        if placed.device_state is None:
            self.pending = self._start(steps, spec, model_inputs())
        elif placed.unverified_source is not None:
            self._verify_loaded_state(steps, spec, self._strategy.global_batch(model_inputs()))

    def lowering_state(self) -> tuple[Any, Any]:
        """The state programs are lowered against (abstract while being created), and its key."""
        pending = self.pending
        if pending is not None:
            return pending.abstract, pending.rng
        return self._placed.device_state, self._placed.rng

    def finish(self) -> bool:
        """Creates the state being created, if any; whether the programs lowered for it fit it.

        They do unless a state initializer (`Trainer.add_state_initializer`) changed its
        RNG key or its arrays' shapes or placement.
        """
        pending, self.pending = self.pending, None
        if pending is None:
            return True
        placed = self._placed
        state = pending.compiled.result()(*pending.arguments)
        if pending.model_state:
            state = state.replace(model_state=_given_model_state(state, pending.model_state))
        metrics = state.train_metrics
        if all(leaf.is_fully_addressable for leaf in jax.tree.leaves(metrics)):
            # A real copy: the first step may reuse (donate) the state's buffers.
            self._fresh_train_metrics = jax.tree.map(np.array, jax.device_get(metrics))
        placed.create(state)
        rng = placed.rng
        return (
            rng is not None
            and np.array_equal(np.asarray(rng), np.asarray(pending.rng))
            and _signature(placed.device_state) == _signature(pending.abstract)
        )

    def cancel(self) -> None:
        """Forgets a creation underway (the step bodies changed: it starts again)."""
        self.pending = None

    def abandon(self) -> None:
        """After a failure: waits for a creation's compiling to end, and forgets it.

        Nothing the failed call started goes on behind the error (its result is not
        needed: the next program compiled starts the creation again).
        """
        pending, self.pending = self.pending, None
        if pending is not None:
            concurrent.futures.wait([pending.compiled])

    def _start(self, steps: StepBuilder, spec: Any, inputs: list[Any]) -> PendingState:
        recipe = self._recipe
        init_params = recipe.init_params
        given_state: dict = {}

        def given(params: Any) -> Any:
            start = init_params
            if holds_variables(init_params, params):  # e.g. loopax.load_variables(directory)
                start = init_params["params"]
                given_state.update({k: v for k, v in init_params.items() if k != "params"})
            return from_plain(params, start, "init_params", hint=_INIT_PARAMS_HINT)

        per_device = steps.init_variables
        rng = jax.random.PRNGKey(recipe.seed)
        creation, arguments = self._strategy.state_creation(
            lambda key, xs: per_device(spec, key, xs),
            functools.partial(self._build_state, steps),
            rng,
            self._strategy.global_batch(inputs),
            None if init_params is None else given,
        )
        lowered = creation.lower(*arguments)  # here: tracing runs the model's code
        out = lowered.out_info.replace(rng=None)
        if (
            out.ema_params is not None
            and self._strategy.packs_average
            and worth_packing(out.params)
        ):
            out = out.replace(ema_params=pack_abstract(out.ema_params))
        abstract = self._strategy.abstract_placed(out)
        options = steps.config.options
        compiled = _background.submit(lambda: compile_lowered(lowered, options))
        return PendingState(compiled, arguments, abstract, rng, given_state)

    def _build_state(self, steps: StepBuilder, variables: dict, rng: Any, start: Any) -> TrainState:
        """The train state of the model's `variables`, from parameters `start` if given."""
        variables = dict(variables)
        params = variables.pop("params", {})
        if start is not None:
            params = start
        if not jax.tree.leaves(params):
            raise ValueError(no_parameters_message(self._recipe.given))
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=self._recipe.optimizer.init(params),
            model_state=variables,
            rng=rng,
            train_metrics=steps.initial_train_metrics(),  # in the creation program
            loss_scale=steps.fresh_loss_scale(),
            # The average starts at the initial parameters (a copy: its own buffers).
            ema_params=None if steps.config.ema_decay is None else jax.tree.map(jnp.copy, params),
        )

    def _verify_loaded_state(self, steps: StepBuilder, spec: Any, inputs: list[Any]) -> None:
        """Checks a state loaded before the first batch against the model's variables."""
        where, state = self._placed.take_unverified()
        key = jax.random.PRNGKey(self._recipe.seed)
        per_device = steps.init_variables
        initializer = self._strategy.initializer(lambda k, xs: per_device(spec, k, xs))
        expected = dict(jax.eval_shape(initializer, key, inputs))
        expected_params = expected.pop("params", {})
        from_plain(
            {"params": expected_params, "model_state": expected},
            to_plain({"params": state.params, "model_state": state.model_state}),
            where,
        )
        if self._strategy.plan_layout(lambda k, xs: per_device(spec, k, xs), key, inputs):
            self._placed.state = state  # moved into the layout's shardings
