"""Where each leaf of a sharded train state lives on the mesh: specs from annotations and rules.

Parameters and model state are annotated the Flax way (Linen `nn.with_logical_partitioning`
boxes, NNX `out_sharding` metadata, `ctx.variable(..., axes=)`); the Trainer's `rules` map
the logical names to mesh axes, and `fsdp=True` shards over `"data"` what no annotation
shards. The optimizer state follows its parameters; everything else is replicated.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ._state import TrainState, to_plain, tree_paths

DATA = "data"  # the mesh axis a batch is split over, and the one FSDP shards along

Path = tuple[str, ...]


def is_box(value: Any) -> bool:
    """Whether `value` is a Flax partitioning box (`nn.Partitioned` and its logical kind)."""
    return isinstance(value, nn.Partitioned)


def check_rules(rules: Sequence[Any] | None, mesh: Mesh) -> tuple[tuple[str, str | None], ...]:
    """`rules` as a tuple of `(logical name, mesh axis or None)` pairs.

    Raises:
      ValueError: a rule is not such a pair, or names an axis the mesh lacks.
    """
    checked = []
    for rule in rules or ():
        if not (
            isinstance(rule, (tuple, list))
            and len(rule) == 2
            and isinstance(rule[0], str)
            and (rule[1] is None or isinstance(rule[1], str))
        ):
            raise ValueError(
                f"rules must be (logical_name, mesh_axis or None) pairs, got {rule!r}; e.g. "
                "rules=[('embed', 'data'), ('mlp', 'model')]"
            )
        if rule[1] is not None and rule[1] not in mesh.axis_names:
            raise ValueError(
                f"rule {tuple(rule)!r} names mesh axis {rule[1]!r}, but the mesh has axes "
                f"{tuple(mesh.axis_names)}; map to one of them or to None (replicated)"
            )
        checked.append((rule[0], rule[1]))
    return tuple(checked)


@dataclasses.dataclass(frozen=True)
class _Names:
    """A box's axis names, as one pytree leaf."""

    names: tuple


def axis_annotations(variables: Any) -> dict[Path, tuple]:
    """The axis names of every annotated (boxed) variable, by its path in `variables`."""
    names = jax.tree.map(
        lambda leaf: _Names(tuple(leaf.names)) if is_box(leaf) else None, variables, is_leaf=is_box
    )
    return {path: leaf.names for path, leaf in tree_paths(names)}


@dataclasses.dataclass(frozen=True)
class Layout:
    """The partition specs of a model's variables on one mesh.

    Attributes:
      mesh: the mesh.
      specs: `{(collection, *path): (shape, PartitionSpec)}` of every variable (its
        collection `"params"` or a model-state one), as the model's init returns them.
    """

    mesh: Mesh
    specs: dict[Path, tuple[tuple[int, ...], P]]

    @classmethod
    def plan(
        cls,
        mesh: Mesh,
        rules: tuple[tuple[str, str | None], ...],
        fsdp: bool,
        variables: Any,
    ) -> Layout:
        """The layout of `variables` (abstract, boxed, as the model's init returns them).

        Raises:
          ValueError: a rule matches no annotation, an annotation's names do not fit its
            variable's rank, or a sharded dimension does not divide by its mesh axes.
        """
        named = axis_annotations(variables)
        mapping = dict(rules)
        axes = set(mesh.axis_names)
        used: set[str] = set()
        specs: dict[Path, tuple[tuple[int, ...], P]] = {}
        for path, leaf in tree_paths(nn.meta.unbox(variables)):
            shape = tuple(int(d) for d in leaf.shape)
            spec = P()
            names = named.get(path)
            if names is not None:
                if len(names) != len(shape):
                    raise ValueError(
                        f"variable {'/'.join(path)!r} of shape {shape} is annotated with "
                        f"{len(names)} axis names {names}; give one name (or None) per dimension"
                    )
                used.update(n for n in names if n in mapping)
                spec = P(*(_mesh_axis(n, mapping, axes) for n in names))
            if fsdp and path[0] == "params" and len(shape) >= 2 and not any(spec):
                spec = _fsdp_spec(shape, mesh.shape[DATA])
            _check_divisible(path, shape, spec, mesh)
            specs[path] = (shape, spec)
        unmatched = [rule for rule in rules if rule[0] not in used]
        if unmatched:
            seen = sorted({n for names in named.values() for n in names if n is not None})
            raise ValueError(
                f"rules {unmatched} match no annotated variable of the model (annotated "
                f"logical names: {seen}); annotate the parameters (nn.with_logical_partitioning, "
                "nnx.with_partitioning, ctx.variable(..., axes=...)) or remove the rules"
            )
        return cls(mesh, specs)

    def spec_tree(self, state: TrainState) -> TrainState:
        """A tree like `state` of `PartitionSpec`, from the layout.

        Parameters, their EMA and model state by path; an optimizer state leaf like the
        parameter it mirrors (the same path ending and shape); every other leaf replicated.
        """
        params = {path[1:]: entry for path, entry in self.specs.items() if path[0] == "params"}

        def of(path: Path, leaf: Any, table: dict, suffix: bool) -> P:
            shape = tuple(np.shape(leaf))
            ends = [path[i:] for i in range(len(path))] if suffix else [path]
            for end in ends:  # the longest ending first
                entry = table.get(end)
                if entry is not None and entry[0] == shape:
                    return entry[1]
            return P()

        def tree_of(tree: Any, table: dict, suffix: bool = False) -> Any:
            specs = [of(path, leaf, table, suffix) for path, leaf in tree_paths(tree)]
            return jax.tree.unflatten(jax.tree.structure(tree), specs)

        model_state = {path: entry for path, entry in self.specs.items() if path[0] != "params"}
        return jax.tree.map(lambda _: P(), state).replace(
            params=tree_of(state.params, params),
            opt_state=tree_of(state.opt_state, params, suffix=True),
            model_state=tree_of(state.model_state, model_state),
            ema_params=None if state.ema_params is None else tree_of(state.ema_params, params),
        )

    def param_shardings(self, params: Any) -> Any:
        """A tree like `params` of the `NamedSharding` each parameter lives in."""
        table = {path[1:]: spec for path, (_, spec) in self.specs.items() if path[0] == "params"}
        shardings = [
            NamedSharding(self.mesh, table.get(path, P())) for path, _ in tree_paths(params)
        ]
        return jax.tree.unflatten(jax.tree.structure(params), shardings)

    def shardings(self, state: TrainState) -> TrainState:
        """A tree like `state` of the `NamedSharding` each leaf lives in."""
        return jax.tree.map(
            lambda spec: NamedSharding(self.mesh, spec),
            self.spec_tree(state),
            is_leaf=lambda x: isinstance(x, P),
        )


def _mesh_axis(name: str | None, mapping: dict[str, str | None], axes: set[str]) -> str | None:
    """A logical name's mesh axis: its rule's, else a mesh axis of that name, else None."""
    if name is None:
        return None
    if name in mapping:
        return mapping[name]
    return name if name in axes else None


def _fsdp_spec(shape: tuple[int, ...], data_size: int) -> P:
    """Sharded over `"data"` along the largest dimension it divides; replicated if none."""
    if data_size == 1:
        return P()
    candidates = [d for d in range(len(shape)) if shape[d] % data_size == 0]
    if not candidates:
        return P()
    dim = max(candidates, key=lambda d: (shape[d], -d))
    return P(*([None] * dim), DATA)


def _check_divisible(path: Path, shape: tuple[int, ...], spec: P, mesh: Mesh) -> None:
    """Raises ValueError unless each sharded dimension divides and no mesh axis repeats."""
    axes = [name for entry in spec if entry is not None
            for name in (entry if isinstance(entry, tuple) else (entry,))]  # fmt: skip
    if len(axes) != len(set(axes)):
        raise ValueError(
            f"variable {'/'.join(path)!r} of shape {shape} would be sharded {spec}: a mesh "
            "axis may shard one dimension only; map its logical names to different axes"
        )
    for dim, entry in enumerate(spec):
        if entry is None:
            continue
        names = entry if isinstance(entry, tuple) else (entry,)
        size = math.prod(mesh.shape[n] for n in names)
        if shape[dim] % size:
            raise ValueError(
                f"variable {'/'.join(path)!r} of shape {shape} is sharded {spec} on the mesh "
                f"{dict(mesh.shape)}: dimension {dim} ({shape[dim]}) does not divide by "
                f"{size}; change the rules or the mesh sizes"
            )


def sharding_report(state: TrainState) -> str:
    """A text table of every state leaf: path, shape, partition spec, bytes per device."""
    rows = []
    total = per_device_total = 0
    for path, leaf in tree_paths(to_plain(state.replace(rng=None))):
        shape = tuple(np.shape(leaf))
        itemsize = np.dtype(leaf.dtype).itemsize
        sharding = getattr(leaf, "sharding", None)
        spec = getattr(sharding, "spec", P())
        shard = sharding.shard_shape(shape) if sharding is not None else shape
        nbytes, per_device = math.prod(shape) * itemsize, math.prod(shard) * itemsize
        total += nbytes
        per_device_total += per_device
        rows.append(("/".join(path), str(shape), str(spec), f"{per_device:,}"))
    header = ("path", "shape", "partition spec", "bytes per device")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(4)]

    def line(row: Sequence[str]) -> str:
        cells = [cell.ljust(width) for cell, width in zip(row[:3], widths[:3], strict=True)]
        return "  ".join([*cells, row[3].rjust(widths[3])])

    rule = "-" * len(line(header))
    return "\n".join(
        [
            line(header),
            rule,
            *(line(row) for row in rows),
            rule,
            f"total: {len(rows)} arrays, {total:,} bytes; {per_device_total:,} bytes per device",
        ]
    )
