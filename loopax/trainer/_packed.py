"""A replicated EMA of the parameters, kept on the devices as one vector per dtype.

Every leaf of the placed state costs the runtime about a microsecond per step (an argument
in, a donated buffer out, a kernel): the average of a small model's 4 parameters took 4 of
each. Packed, it takes one per dtype, and the step updates it in one fused kernel from the
parameters joined in the same order. Everywhere else (`Trainer.state`, checkpoints,
evaluation inside the programs) it is a tree like the parameters: `PlacedState` packs it
when it places a state and unpacks it when it reads one back, and a program unpacks it
where it uses it (slices of the vector, which XLA fuses into their users). Only small
leaves are worth it (`worth_packing`): the step joins the parameters into vectors, a copy
of them, which a model of large leaves pays more for than it saves. A mesh keeps it
leaf by leaf, sharded as the parameters, and so do several processes (one process reading
it back would run a program over arrays that span them).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class PackedAverage:
    """An average of a tree of parameters as one vector per dtype.

    Attributes:
      vectors: the leaves of each dtype, raveled and joined in the tree's order; one vector
        per dtype, dtypes in the order they first appear among the leaves.
    """

    vectors: tuple


# Packing pays where leaves are small: the step joins the parameters into the vectors it
# averages, a copy that costs more than it saves on large leaves (docs/benchmarks.md, "Why
# the code is the way it is").
_PACK_MEAN_LEAF_BYTES = 32 * 1024


def worth_packing(params: Any) -> bool:
    """Whether an average of `params` (arrays or their shapes) is placed packed."""
    leaves = jax.tree.leaves(params)
    total = sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize for leaf in leaves)
    return len(leaves) > 1 and total <= _PACK_MEAN_LEAF_BYTES * len(leaves)


def _groups(tree: Any) -> list[list[int]]:
    """The positions of `tree`'s leaves by dtype, dtypes in the order they first appear."""
    by_dtype: dict[Any, list[int]] = {}
    for index, leaf in enumerate(jax.tree.leaves(tree)):
        by_dtype.setdefault(np.dtype(leaf.dtype), []).append(index)
    return list(by_dtype.values())


def pack(tree: Any) -> PackedAverage:
    """`tree` as a `PackedAverage`: host arrays give host vectors, traced ones traced."""
    leaves = jax.tree.leaves(tree)
    on_host = all(isinstance(leaf, np.ndarray) for leaf in leaves)
    join = np.concatenate if on_host else jnp.concatenate
    return PackedAverage(tuple(join([leaves[i].reshape(-1) for i in g]) for g in _groups(tree)))


def pack_abstract(tree: Any) -> PackedAverage:
    """The `PackedAverage` of a tree of `jax.ShapeDtypeStruct`s, abstract too."""
    leaves = jax.tree.leaves(tree)
    return PackedAverage(
        tuple(
            jax.ShapeDtypeStruct(
                (sum(int(np.prod(leaves[i].shape)) for i in g),), leaves[g[0]].dtype
            )
            for g in _groups(tree)
        )
    )


def unpack(packed: PackedAverage, like: Any) -> Any:
    """`packed` as a tree like `like` (the parameters it averages: structure and shapes)."""
    leaves = jax.tree.leaves(like)
    out: list[Any] = [None] * len(leaves)
    for vector, group in zip(packed.vectors, _groups(like), strict=True):
        start = 0
        for index in group:
            shape = np.shape(leaves[index])
            size = int(np.prod(shape))
            out[index] = vector[start : start + size].reshape(shape)
            start += size
    return jax.tree.unflatten(jax.tree.structure(like), out)


# Reading a placed state back unpacks in one compiled program, not a dispatch per slice.
unpack_placed = jax.jit(unpack)


def averaged(ema: Any, params: Any, decay: float) -> Any:
    """Traced: `decay * ema + (1 - decay) * params`, for a packed average or a tree."""
    if isinstance(ema, PackedAverage):
        joined = pack(params).vectors
        return PackedAverage(
            tuple(decay * e + (1 - decay) * p for e, p in zip(ema.vectors, joined, strict=True))
        )
    return jax.tree.map(lambda e, p: decay * e + (1 - decay) * p, ema, params)
