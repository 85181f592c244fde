"""What a save takes from the trainer on the training thread, and what the writer makes of it.

One process: the state's host copy (`Trainer.state_dict()`), as always; its fingerprints are
computed on the writer thread from those copies. Several processes: the arrays that span
processes are never brought whole to one host: the training thread starts a copy of them
on their own devices (the next step donates the state's buffers, the copy stays) and each
device's part of their fingerprints and finite checks; Orbax then writes, on the writer
thread, each process's own shards. Whatever any process holds whole (the RNG key) is copied
to the host. No device program here has a collective: a collective dispatched beside the
training steps could interleave with theirs differently on each process (gloo then fails
or hangs); the parts are added up on the hosts, through the coordination service.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ...loop._internal import nest_paths, tree_paths
from ...trainer import Trainer
from ._fingerprint import combine, describe, device_checks, host_fingerprint, local_checks


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The state of one save as taken on the training thread.

    Attributes:
      plain: the state in plain form (nested dicts): host arrays and, with several
        processes, device copies of the arrays spread over processes.
      device_paths: the paths (`"params/Dense_0/kernel"`) of the device copies, in the
        order of `checks`.
      checks: each device's part of the fingerprint and finite check of each device copy,
        being computed on the devices.
    """

    plain: dict
    device_paths: tuple[str, ...] = ()
    checks: list[tuple[jax.Array, jax.Array]] = dataclasses.field(default_factory=list)


@functools.lru_cache(maxsize=8)
def _copier(shardings: tuple[jax.sharding.Sharding, ...]) -> Any:
    """A compiled copy that keeps each array's sharding (no data moves between devices)."""
    return jax.jit(lambda arrays: [jnp.copy(x) for x in arrays], out_shardings=list(shardings))


def _copy(arrays: list[jax.Array]) -> list[jax.Array]:
    return _copier(tuple(x.sharding for x in arrays))(arrays)


def take(trainer: Trainer) -> Snapshot:
    """The trainer's state for a save, taken now on the training thread.

    Raises:
      RuntimeError: the trainer has no state yet.
    """
    if jax.process_count() == 1:
        state = trainer.state_dict()
        if state is None:
            raise RuntimeError("the trainer has no state yet")
        return Snapshot(state)
    state = trainer.state
    if state is None:
        raise RuntimeError("the trainer has no state yet")
    host, spread = [], []
    for path, leaf in tree_paths(state):
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            if not isinstance(leaf.sharding, jax.sharding.NamedSharding):
                raise TypeError(
                    f"cannot checkpoint {'/'.join(path)!r}: it spans processes with a "
                    f"{type(leaf.sharding).__name__}; loopax saves arrays placed with a "
                    "jax.sharding.NamedSharding"
                )
            spread.append((path, leaf))
        elif leaf is not None:
            # A real copy: on CPU `device_get` may return a view of a donated buffer.
            host.append((path, np.array(leaf)))
    if not spread:
        return Snapshot(nest_paths(host))
    copies = _copy([leaf for _, leaf in spread])
    checks = device_checks(copies)
    return Snapshot(
        nest_paths(host + [(path, copy) for (path, _), copy in zip(spread, copies, strict=True)]),
        tuple("/".join(path) for path, _ in spread),
        checks,
    )


def local_part(snapshot: Snapshot) -> dict[str, Any]:
    """This process's part of the device checks (JSON), read on the writer thread."""
    sums, finite = local_checks(snapshot.checks)
    return {"sums": sums, "finite": finite}


def is_learning_rate(name: str) -> bool:
    """Whether the state path `name` is an optimizer's injected learning rate."""
    return name.startswith("opt_state/") and name.endswith("/hyperparams/learning_rate")


def _worse(bad: str | None, name: str) -> str:
    """Of two paths holding NaN or infinity, the one to name.

    A learning rate goes first (the parameters only follow it), then the first found.
    """
    if bad is None or (is_learning_rate(name) and not is_learning_rate(bad)):
        return name
    return bad


def check(snapshot: Snapshot, parts: list[dict[str, Any]]) -> tuple[dict[str, str], str | None]:
    """`(fingerprints by path, the path holding NaN or infinity to name, or None)`.

    The path named is a learning rate's if one holds them (the parameters only follow it),
    else the first. Run on the writer thread: the host arrays' fingerprints are computed
    here; the device copies' from every process's `local_part` (`parts`, in process order).
    """
    device = set(snapshot.device_paths)
    fingerprints, bad = {}, None
    for path, leaf in tree_paths(snapshot.plain):
        name = "/".join(path)
        if name in device:
            continue
        fingerprints[name] = host_fingerprint(leaf)
        array = np.asarray(leaf)
        if np.issubdtype(array.dtype, np.inexact) and not np.isfinite(array).all():
            bad = _worse(bad, name)
    if snapshot.device_paths:
        sums, finite = combine([(part["sums"], part["finite"]) for part in parts])
        leaves = dict(tree_paths(snapshot.plain))
        for index, name in enumerate(snapshot.device_paths):
            leaf = leaves[tuple(name.split("/"))]
            fingerprints[name] = describe(leaf.dtype, leaf.shape, sums[index])
            if not finite[index]:
                bad = _worse(bad, name)
    return dict(sorted(fingerprints.items())), bad


def non_finite_value(snapshot: Snapshot, name: str) -> float | None:
    """The first NaN or infinity that this process holds of the array at path `name`, or None.

    A device copy is read from this process's first shard, which may hold none of them.
    """
    leaf = dict(tree_paths(snapshot.plain))[tuple(name.split("/"))]
    if isinstance(leaf, jax.Array):
        leaf = leaf.addressable_data(0)
    array = np.asarray(leaf)
    bad = array[~np.isfinite(array)]
    return float(bad.flat[0]) if bad.size else None
