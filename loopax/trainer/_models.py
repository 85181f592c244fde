"""What a Trainer trains: a model function, a Flax Linen module, or a Flax NNX module.

Each is adapted to one interface, Linen's: `init(rngs, spec, inputs, training)` returns the
variables (`{"params": ..., <other collections>: ...}`, nested dicts of arrays) and
`apply(variables, spec, inputs, training, rngs=, mutable=)` returns
`((predictions, added_loss), new_model_state)`, predictions a list. The compiled steps,
checkpoints and data parallelism then treat all three alike.
"""

from __future__ import annotations

import abc
import contextlib
import inspect
import sys
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ._context import ModelModule, check_predictions
from ._state import from_plain, tree_paths

# The keyword a Linen module's __call__ takes for train/eval mode, and its value in training.
_MODE_KEYWORDS = {"train": True, "training": True, "deterministic": False}
NNX_STATE = "nnx"  # the model-state collection holding an NNX module's non-parameter state


def _as_list(predictions: Any) -> list:
    return list(predictions) if isinstance(predictions, (list, tuple)) else [predictions]


class _FlaxModel(abc.ABC):
    """A Flax module adapted to the Linen interface: `apply` runs `_predict` and checks it.

    `spec` and `global_step` are for model functions (`ModelModule`); a module takes neither.
    """

    module: Any

    @abc.abstractmethod
    def _predict(
        self, variables: dict, inputs: list, training: bool, rngs: dict, mutable: list[str]
    ) -> tuple[Any, dict]:
        """The module's raw predictions on `inputs` and its new model state."""

    def apply(
        self,
        variables: dict,
        spec: Any,
        inputs: list,
        training: bool,
        *,
        rngs: dict,
        mutable: list[str],
        global_step: Any = None,
    ) -> tuple[tuple[list, None], dict]:
        del spec, global_step
        predictions, new_state = self._predict(variables, inputs, training, rngs, mutable)
        predictions = _as_list(predictions)
        check_predictions(self.module, predictions)
        return (predictions, None), new_state


class LinenModel(_FlaxModel):
    """A `flax.linen.Module` instance, called as `module(*inputs, train=...)`.

    The keyword is the one it takes among `train`, `training` (True in train steps) and
    `deterministic` (False in train steps), if any.
    """

    def __init__(self, module: nn.Module):
        self.module = module
        parameters = inspect.signature(module.__call__).parameters
        self.mode_keyword = next((k for k in _MODE_KEYWORDS if k in parameters), None)

    def _kwargs(self, training: bool) -> dict[str, Any]:
        # `Any`, not `bool`: a `**dict[str, bool]` would be checked against `init`'s and
        # `apply`'s `method` parameter, which it never fills (its keys are mode keywords).
        if self.mode_keyword is None:
            return {}
        in_training = _MODE_KEYWORDS[self.mode_keyword]
        return {self.mode_keyword: in_training if training else not in_training}

    def init(self, rngs: dict, spec: Any, inputs: list, training: bool) -> dict:
        del spec
        return dict(self.module.init(rngs, *inputs, **self._kwargs(training)))

    def _predict(
        self, variables: dict, inputs: list, training: bool, rngs: dict, mutable: list[str]
    ) -> tuple[Any, dict]:
        predictions, new_state = self.module.apply(
            variables, *inputs, **self._kwargs(training), rngs=rngs, mutable=mutable
        )
        return predictions, dict(new_state)


def _off_explicit_meshes(pure: dict) -> dict:
    """`pure` with every array whose type names a mesh with Explicit axes as a host copy.

    A module built under `jax.set_mesh` of a mesh with Explicit axes (JAX's default) holds
    arrays whose type carries that mesh: no program of the trainer's own mesh or devices
    takes them. They are only the starting values, which a host copy keeps.

    Raises:
      ValueError: such an array spans several processes (no host holds it whole).
    """

    def plain(path: tuple[str, ...], leaf: Any) -> Any:
        if not isinstance(leaf, jax.Array):
            return leaf
        axis_types = jax.typeof(leaf).sharding.mesh.axis_types
        if jax.sharding.AxisType.Explicit not in axis_types:
            return leaf
        if not leaf.is_fully_addressable:
            raise ValueError(
                f"the NNX module's variable {'/'.join(path)} was created sharded over a mesh with "
                "Explicit axes that spans several processes; build the module with "
                "nnx.use_eager_sharding(False) (annotations only: the Trainer places the "
                "variables on its mesh)"
            )
        return np.asarray(leaf)

    leaves = [plain(path, leaf) for path, leaf in tree_paths(pure)]
    return jax.tree.unflatten(jax.tree.structure(pure), leaves)


class NnxModel(_FlaxModel):
    """A `flax.nnx.Module` instance, called as `module(*inputs)`.

    Its `nnx.Param`s are the trained parameters; its other variables (`BatchStat`, ...)
    are the model state (collection `"nnx"`), updated in train steps and averaged across
    devices; its `nnx.Rngs` streams are fresh in every step, derived from the trainer's
    key, the step and the device; train and eval steps run it in `train()` and `eval()`
    mode. The values it holds when the Trainer is made are the starting point, wherever
    they live (a module built under a mesh holds them sharded on it).
    """

    def __init__(self, module: Any, annotate: bool = False):
        from flax import nnx  # noqa: PLC0415

        self._nnx = nnx
        self.module = module
        self._annotate = annotate
        self._filters = (nnx.Param, nnx.RngState, ...)
        module.eval()
        self._eval_graph = nnx.split(module, *self._filters)[0]
        module.train()
        self._train_graph, params, rngs, rest = nnx.split(module, *self._filters)
        # Templates: the States are rebuilt from the trainer's plain dicts in every step.
        self._templates = (params, rngs, rest)
        self._params = _off_explicit_meshes(nnx.to_pure_dict(params))
        self._rest = _off_explicit_meshes(nnx.to_pure_dict(rest))
        self._rng_structure = nnx.to_pure_dict(rngs)

    def _filled(self, template: Any, pure: dict) -> Any:
        state = jax.tree.map(lambda leaf: leaf, template)  # a copy: the template stays as it is
        self._nnx.replace_by_pure_dict(state, pure)
        return state

    def _fresh_rngs(self, key: jax.Array) -> dict:
        """The module's RNG streams with keys derived from `key` (one per stream), count 0."""
        index = iter(range(1, 1 << 30))

        def fresh(leaf: Any) -> Any:
            if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                return jax.random.wrap_key_data(jax.random.fold_in(key, next(index)))
            return jnp.zeros_like(leaf)

        return jax.tree.map(fresh, self._rng_structure)

    def init(self, rngs: dict, spec: Any, inputs: list, training: bool) -> dict:
        del rngs, spec, inputs, training
        params, _, rest = self._templates
        variables = {"params": self._boxed(params, self._params)}
        if self._rest:
            variables[NNX_STATE] = self._boxed(rest, self._rest)
        return variables

    def _boxed(self, template: Any, pure: dict) -> dict:
        """`pure` with each variable annotated `nnx.with_partitioning` boxed by its names."""
        if not self._annotate:
            return pure
        # The logical names as annotated: the Trainer's `rules` map them, not rules a
        # `logical_axis_rules` context around the Trainer happens to hold.
        with nn.logical_axis_rules(()):
            specs = self._nnx.to_pure_dict(self._nnx.get_partition_spec(template))
        names = {path: tuple(spec) for path, spec in tree_paths(specs) if any(spec)}
        values = [
            nn.LogicallyPartitioned(value, names[path]) if path in names else value
            for path, value in tree_paths(pure)
        ]
        return jax.tree.unflatten(jax.tree.structure(pure), values)

    def _predict(
        self, variables: dict, inputs: list, training: bool, rngs: dict, mutable: list[str]
    ) -> tuple[Any, dict]:
        del mutable  # the model state is all of the module's non-parameter variables
        nnx = self._nnx
        params, rng_state, rest = self._templates
        module = nnx.merge(
            self._train_graph if training else self._eval_graph,
            self._filled(params, variables["params"]),
            self._filled(rng_state, self._fresh_rngs(rngs["dropout"])),
            self._filled(rest, variables.get(NNX_STATE, {})),
        )
        predictions = module(*inputs)
        new_state = {}
        if self._rest:
            rest = nnx.state(module, nnx.Not(nnx.Any(nnx.Param, nnx.RngState)))
            new_state[NNX_STATE] = nnx.to_pure_dict(rest)
        return predictions, new_state

    def update_module(self, params: dict, model_state: dict) -> Any:
        """Writes the trainer's parameters and model state (host arrays) into the user's module.

        Returns that module.
        """
        nnx = self._nnx
        params_template, _, rest_template = self._templates
        states = [self._filled(params_template, params)]
        if NNX_STATE in model_state:
            states.append(self._filled(rest_template, model_state[NNX_STATE]))
        nnx.update(self.module, *states)
        return self.module


def no_parameters_message(model: Any) -> str:
    """Why a model has no trainable parameters, as likely as it can be told."""
    name = getattr(model, "__name__", type(model).__name__)
    if isinstance(model, nn.Module) or is_nnx_module(model):
        cause = "its layers hold no parameters (or all of them are constants)"
    else:
        cause = (
            "a model function that builds a flax.nnx.Module inside it (NNX variables are not "
            "Linen variables, so nothing is trained: pass the module itself, "
            "loopax.Trainer(module, ...)), or one that uses only constants"
        )
    return (
        f"model {name!r} has no trainable parameters, so training would change nothing; "
        f"likely cause: {cause}"
    )


def is_nnx_module(model: Any) -> bool:
    """Whether `model` is a `flax.nnx.Module`.

    An NNX module's class was defined with `flax.nnx` imported; when nothing imported it,
    `model` is none (and importing it here would cost a Linen user ~0.15 s at start).
    """
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(model, nnx.Module)


def adapt(model: Any, axis_name: str | None, annotate: bool = False) -> Any:
    """The model interface for a model function, a Linen module or an NNX module.

    With `annotate`, `init` returns annotated variables boxed (`nn.LogicallyPartitioned`)
    for a mesh's layout; `ctx.axis_name` is `axis_name`.

    Raises:
      TypeError: `model` is none of them.
    """
    if isinstance(model, nn.Module):
        return LinenModel(model)
    if is_nnx_module(model):
        return NnxModel(model, annotate)
    if callable(model):
        check_model_fn(model)
        return ModelModule(model_fn=model, axis_name=axis_name, annotate=annotate)
    raise TypeError(
        f"the model must be a model function model_fn(ctx, spec, inputs), a flax.linen.Module "
        f"or a flax.nnx.Module, got {type(model).__name__}"
    )


def _module_class(model: Any) -> str | None:
    """`"flax.linen"` or `"flax.nnx"` when `model` is a module class rather than an instance."""
    if not isinstance(model, type):
        return None
    if issubclass(model, nn.Module):
        return "flax.linen"
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and issubclass(model, nnx.Module):
        return "flax.nnx"
    return None


def check_model_fn(model_fn: Any) -> None:
    """Checks that a callable can be called as a model function, `model_fn(ctx, spec, inputs)`.

    A callable whose signature Python cannot read (some built-in or C callables) passes:
    only its first call can tell.

    Raises:
      TypeError: `model_fn` is a Flax module class (not an instance), or its signature
        cannot take the three arguments (a Keras-style `model(inputs)`), naming it.
    """
    name = getattr(model_fn, "__name__", None) or type(model_fn).__name__
    kind = _module_class(model_fn)
    if kind is not None:
        raise TypeError(
            f"the model is the {kind} module class {name}, not a module: pass an instance, "
            f"loopax.Trainer({name}(...), ...)"
        )
    try:
        signature = inspect.signature(model_fn)
    except (TypeError, ValueError):  # no signature to read: the first call will tell
        return
    try:
        signature.bind(None, None, None)
    except TypeError as err:
        raise TypeError(
            f"the model function {name}{signature} cannot be called as loopax calls a model "
            f"function, model_fn(ctx, spec, inputs) ({err}): ctx is the loopax.Context "
            "(ctx.training, ctx.make_rng(), ...), spec the batch's spec (often None) and "
            f"inputs the list of input arrays; write e.g. `def {name}(ctx, spec, inputs): "
            "x = inputs[0] ...`, or pass a flax.linen.Module or flax.nnx.Module instance, "
            "which loopax calls as module(*inputs)"
        ) from None


_NNX_RNGS_FIX = (
    "loopax: build the layer with its RNG streams in __init__, e.g. "
    "`nnx.Dropout(rate, rngs=rngs)`: loopax calls an NNX module as `module(*inputs)`, passing "
    "no `rngs` at call time, and derives its `nnx.Rngs` streams per step and device"
)


@contextlib.contextmanager
def explained_model_errors(model: Any, spec: Any, inputs: Any, what: str) -> Iterator[None]:
    """Adds a note to an error the model raises while traced: the model and the batch's shapes.

    An NNX layer built without its `rngs` (the tutorial's `nnx.Dropout(rate)`, `rngs` at
    call time) gets the fix named as well.
    """
    try:
        yield
    except Exception as err:
        add_note = getattr(err, "add_note", None)  # Python >= 3.11
        if add_note is not None:
            shapes = [tuple(getattr(x, "shape", ())) for x in inputs]
            given = getattr(model, "model_fn", None) or getattr(model, "module", model)
            name = getattr(given, "__name__", None) or type(given).__name__
            add_note(
                f"loopax: raised by the model {name} while {what}, on "
                f"inputs of shapes {shapes} (one device's share of the batch) for spec "
                f"{spec!r}"
            )
            if "no `rngs` argument was provided" in str(err):
                add_note(_NNX_RNGS_FIX)
        raise


def load_nnx_variables(module: Any, variables: dict, where: str) -> Any:
    """Sets an NNX module's parameters and other state from a checkpoint's `variables`.

    `variables` is `{"params": ..., "nnx": ...}` as a Trainer of an NNX module saves them
    (see `NnxModel`); every entry is checked against the module's own (name, shape, dtype)
    before any is set. Returns the module.

    Raises:
      TypeError: `module` is not a `flax.nnx.Module`.
      ValueError: `variables` do not fit the module (naming the first differing entry), or
        hold collections an NNX module has no place for (a Linen model's).
    """
    if not is_nnx_module(module):
        raise TypeError(
            f"load_into sets a flax.nnx.Module's variables, got a {type(module).__name__}; for "
            "a Linen module or a model function use module.apply(loopax.load_variables(...), x) "
            "or Trainer(..., init_params=loopax.load_variables(...))"
        )
    from flax import nnx  # noqa: PLC0415

    others = sorted(set(variables) - {"params", NNX_STATE})
    if others:
        raise ValueError(
            f"{where} holds the collections {others}, which a flax.nnx.Module has no place "
            "for: was it saved by a Trainer of a Linen module or a model function? Load it "
            "with loopax.load_variables and Linen's module.apply"
        )
    _, params, _, rest = nnx.split(module, nnx.Param, nnx.RngState, ...)
    hint = "was it saved by a Trainer of another model? Build the module the checkpoint holds"
    checked = []
    for state, saved in ((params, variables["params"]), (rest, variables.get(NNX_STATE, {}))):
        pure = from_plain(nnx.to_pure_dict(state), saved, where, hint)
        nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, pure))
        checked.append(state)
    nnx.update(module, *checked)
    return module
