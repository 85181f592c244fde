"""The `Context` a model function receives, and the Flax module that hosts it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

VARIABLES = "variables"  # the model-state collection of non-trainable `ctx.variable`s
ModelFn = Callable[["Context", Any, list[jax.Array]], Any]


class VariableHandle:
    """A non-trainable `ctx.variable`: `.value` reads it, `.value = x` writes it.

    Writes while the variables are being created (the model's first run, before the first
    step) are dropped, as Flax's BatchNorm skips its update then: the first step reads the
    initial value.
    """

    def __init__(self, variable: Any, initializing: bool):
        self._variable = variable
        self._initializing = initializing

    @property
    def value(self) -> Any:
        """The variable's current value."""
        return self._variable.value

    @value.setter
    def value(self, new_value: Any) -> None:
        if not self._initializing:
            self._variable.value = new_value


class Context:
    """What a model function can ask of the step that runs it.

    A model function `model_fn(ctx, spec, inputs)` runs inside a Flax Linen scope, so
    `flax.linen` modules may be created in it (`nn.Dense(10)(x)`); their variables are
    created on the first step, as in GoMLX.

    Attributes:
      training: True in a train step, False in an eval step.
      axis_name: the device axis name, for collectives such as `jax.lax.pmean(x,
        ctx.axis_name)` (cross-device batch statistics). None on a mesh
        (`Trainer(mesh=...)`): there the model computes over the global batch, so batch
        statistics are already global without an axis name.
      spec: the batch's spec.
      global_step: the optimizer steps taken before this step, a traced int32 scalar (0 in
        the first train step; the same in every micro-batch of an accumulated step; the
        trainer's `global_step` in an eval step). Like GoMLX's global step, e.g. for
        schedules computed inside the model.
    """

    def __init__(
        self,
        module: nn.Module,
        training: bool,
        axis_name: str | None,
        spec: Any,
        global_step: jax.Array | None = None,
        annotate: bool = False,
    ):
        self._module = module
        self._annotate = annotate
        self.training = training
        self.axis_name = axis_name
        self.spec = spec
        self.global_step = jnp.zeros((), jnp.int32) if global_step is None else global_step
        self._losses: list[jax.Array] = []

    def variable(
        self, name: str, init: Any, trainable: bool = True, axes: Sequence[str | None] | None = None
    ) -> Any:
        """A variable of the model function, created on the first step, without a Flax module.

        Like GoMLX's `VariableWithValue`.

        Args:
          name: unique among this model function's variables.
          init: its initial value (a number or an array), or `init(key) -> array` called
            once with a key of the `"params"` stream.
          trainable: trained with the parameters (in `trainer.params[name]`), or model
            state (in `trainer.state.model_state["variables"][name]`): kept across steps,
            written by the model, averaged across devices after each train step.
          axes: a logical axis name (or None) per dimension of its value, as in
            `nn.with_logical_partitioning`: on a mesh the Trainer's `rules` map them to
            mesh axes (see `Trainer`); ignored without a mesh.

        Returns:
          Trainable: its current value, an array. Not trainable: a handle whose `.value`
          reads it and `.value = x` writes it (writes in eval steps are discarded).

        Raises:
          TypeError: `name` is not a string, or `init` is neither a value nor a callable
            returning an array.

        Example:
          >>> def model_fn(ctx, spec, inputs):
          ...     scale = ctx.variable("scale", 1.0)
          ...     calls = ctx.variable("calls", 0, trainable=False)
          ...     calls.value = calls.value + 1
          ...     return inputs[0] * scale
        """
        if not isinstance(name, str):
            raise TypeError(f"ctx.variable needs a str name, got {type(name).__name__}")

        def initial(key: jax.Array) -> jax.Array:
            value = init(key) if callable(init) else init
            try:
                return jnp.asarray(value)
            except TypeError:
                raise TypeError(
                    f"ctx.variable({name!r}): init must be a number, an array or a callable "
                    f"init(key) returning one; got {type(value).__name__}"
                ) from None

        if axes is not None and (
            isinstance(axes, str) or not all(a is None or isinstance(a, str) for a in axes)
        ):
            raise TypeError(
                f"ctx.variable({name!r}): axes must be a sequence of axis names or None, one "
                f"per dimension, e.g. ('embed', 'mlp'); got {axes!r}"
            )
        boxed: Callable[[jax.Array], Any] = initial
        if axes is not None and self._annotate:  # boxed for the mesh's layout, unboxed on use
            boxed = nn.with_logical_partitioning(initial, tuple(axes))
        if trainable:
            return self._module.param(name, boxed)
        variable = self._module.variable(
            VARIABLES, name, lambda: boxed(self._module.make_rng("params"))
        )
        return VariableHandle(variable, self._module.is_initializing())

    def make_rng(self, name: str = "dropout") -> jax.Array:
        """Returns a fresh PRNG key of stream `name`: different per step and per device.

        `"dropout"` is the stream `nn.Dropout` uses; any other name works too, all
        deterministic from the trainer's seed.
        """
        return self._module.make_rng(name)

    def add_loss(self, value: jax.Array) -> None:
        """Adds a regularization term to the loss (non-scalars are mean-reduced).

        Raises:
          TypeError: `value` is not a number or an array.
        """
        if not hasattr(value, "dtype") and not isinstance(value, (int, float)):
            raise TypeError(
                f"ctx.add_loss expects an array or a number, got {type(value).__name__}"
            )
        self._losses.append(jnp.mean(jnp.asarray(value, jnp.float32)))

    def total_added_loss(self) -> jax.Array | None:
        """The sum of the `add_loss` terms of this call, or None when there are none."""
        if not self._losses:
            return None
        return sum(self._losses[1:], self._losses[0])


class ModelModule(nn.Module):
    """Runs `model_fn` inside a compact Flax scope; returns (predictions, added loss)."""

    model_fn: ModelFn
    axis_name: str | None
    annotate: bool = False

    @nn.compact
    def __call__(self, spec: Any, inputs: list[jax.Array], training: bool, global_step: Any = None):
        ctx = Context(self, training, self.axis_name, spec, global_step, self.annotate)
        predictions = self.model_fn(ctx, spec, list(inputs))
        if isinstance(predictions, (list, tuple)):
            predictions = list(predictions)
        else:
            predictions = [predictions]
        check_predictions(self.model_fn, predictions)
        return predictions, ctx.total_added_loss()


def check_predictions(model: Any, predictions: list[Any]) -> None:
    """Raises TypeError unless `predictions` (what `model` returned, as a list) are arrays."""
    name = getattr(model, "__name__", type(model).__name__)
    if not predictions:
        raise TypeError(
            f"model {name!r} returned an empty list; it must return its predictions: "
            "an array or a list of arrays"
        )
    for position, prediction in enumerate(predictions):
        if prediction is None:
            where = "None" if len(predictions) == 1 else f"None as prediction {position}"
            raise TypeError(
                f"model {name!r} returned {where}; it must return its predictions "
                "(an array, or a list of arrays): is a `return` missing?"
            )
        if not (hasattr(prediction, "shape") and hasattr(prediction, "dtype")):
            raise TypeError(
                f"model {name!r} returned a {type(prediction).__name__} as prediction "
                f"{position}; predictions must be arrays (e.g. the output of a Flax module)"
            )
