"""How a per-device step body becomes one data-parallel program: one object per strategy.

A `Strategy` is chosen once, when the Trainer is built, from `parallel=` and the process
count. Everything that differs between strategies lives here: how state is placed (pmap
keeps a leading device axis), how a host batch becomes the program's input (multi-process
assembles global arrays from each process's share), how the gradient of the loss is made
the mean over devices, and how a body is wrapped and compiled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.stages import Wrapped

from .._devices import AXIS, Device


class ProgramShape(Protocol):
    """What a strategy's `wrap` reads of a `Program`: how its arguments are laid out."""

    @property
    def replicated(self) -> int:
        """How many leading arguments are replicated (the states)."""
        ...

    @property
    def donate(self) -> tuple[int, ...]:
        """The arguments whose buffers the program reuses."""
        ...

    @property
    def per_example_output(self) -> bool:
        """Whether the body returns per-example values (predictions)."""
        ...

    @property
    def updates_state(self) -> bool:
        """Whether the body returns a new train state first (train programs)."""
        ...

    @property
    def split_batch(self) -> bool:
        """Whether the batch is split over the devices (off for a mesh's global eval batch)."""
        ...


STRATEGIES = ("shard_map", "pmap")


class Strategy:
    """`jax.jit` of `jax.shard_map` over a 1-D mesh of `devices` (one process).

    Attributes:
      name: the `parallel=` value that chose it.
      devices: the devices a batch is split over.
      mesh: the 1-D mesh over `devices`, axis `AXIS`.
      num_devices: how many devices in all; `local_devices`: how many of this process's.
    """

    name = "shard_map"
    multi_process = False
    # Whether a per-device program can take replicated arrays and slice its own shard of
    # each fused step's batch from them (on-device data; pmap's state has a device axis).
    slices_in_scan = True
    # The model's `ctx.axis_name`; whether the model's init boxes annotated variables
    # (`nn.with_logical_partitioning`) for a layout (only a mesh reads them).
    axis_name: str | None = AXIS
    annotates = False
    # Whether a program can be compiled for a batch's shapes alone, before the batch comes
    # (`Trainer.compile_ahead`).
    compiles_ahead = True
    # Whether the placed state keeps the EMA of the parameters packed (`_packed`): a
    # replicated one may be; a mesh shards it as the parameters.
    packs_average = True

    def __init__(self, devices: Sequence[Device]):
        self.devices = list(devices)
        self.mesh = Mesh(np.array(self.devices), (AXIS,))
        self.num_devices = len(self.devices)
        self.local_devices = sum(1 for d in self.devices if d.process_index == jax.process_index())
        # How many per-device copies of a step body run (their collectives reduce over them).
        self.body_devices = self.num_devices
        self._replicated = NamedSharding(self.mesh, P())
        # The batch split on axis 0, 1 or 2 (behind steps and micro-batch axes).
        self._shardings = [NamedSharding(self.mesh, P(*([None] * axis), AXIS)) for axis in range(3)]

    # -- state and batches --------------------------------------------------------------

    def place_state(self, state: Any) -> Any:
        """Puts a host state on the devices, replicated."""
        return jax.device_put(state, self._replicated)

    def sharding_of(self, leaf: Any) -> Any:
        """Where a leaf of the state (as `PlacedState.state` gives it) lives: replicated."""
        return self._replicated

    def host_state(self, state: Any) -> Any:
        """`state` as `place_state` takes it: a host copy."""
        return jax.device_get(state)

    def unplace(self, state: Any) -> Any:
        """The state as one copy (no device axis)."""
        return state

    def device_index(self) -> Any:
        """Traced in a step body: this device's index, folded into its RNG key."""
        return jax.lax.axis_index(AXIS)

    def global_batch(self, arrays: list[Any], batch_axis: int = 0) -> list[Any]:
        """The program's input for this process's batch `arrays`.

        Host arrays are unchanged (the compiled program places them). A JAX array already
        on the devices with another sharding (e.g. a piece sliced off an on-device batch)
        is moved onto the batch's: jit refuses a committed argument sharded otherwise.
        """
        target = self._shardings[batch_axis]
        return [
            jax.device_put(a, target)
            if isinstance(a, jax.Array) and not a.sharding.is_equivalent_to(target, a.ndim)
            else a
            for a in arrays
        ]

    # -- the step body ------------------------------------------------------------------

    def gradient_objective(self, local_loss: jax.Array, pmean: Callable[[Any], Any]) -> Any:
        """What to differentiate so that gradients are the mean over devices.

        Under shard_map the gradient of replicated params w.r.t. a per-device value is
        summed over devices; averaging the loss first makes it the mean.
        """
        return pmean(local_loss)

    def gradient_mean(self, grads: Any, pmean: Callable[[Any], Any]) -> Any:
        """Gradients of `gradient_objective` made the mean over devices (already are)."""
        return grads

    # -- compiling ----------------------------------------------------------------------

    def wrap(
        self, body: Callable[..., Any], program: ProgramShape, sharded: int, batch_axis: int = 0
    ) -> Wrapped:
        """`body(*state, *batch) -> (new_state, values)` as one jit-compiled program.

        The first `program.replicated` arguments are replicated (state); the next `sharded`
        are split on `batch_axis` across devices (the batch); `program.donate`'s buffers are
        reused. The replicated `values` come back as one copy. With
        `program.per_example_output` the body returns per-example values (predictions),
        which come back as one global batch in order.
        """
        batch_spec = P(*([None] * batch_axis), AXIS)
        in_specs = (P(),) * program.replicated + (batch_spec,) * sharded
        # One device skips the collectives that mark values replicated, so skips the check.
        out_specs = P(AXIS) if program.per_example_output else (P(), P())
        stepped = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            check_vma=self.num_devices > 1,
        )
        shardings = tuple(NamedSharding(self.mesh, spec) for spec in in_specs)
        return jax.jit(stepped, in_shardings=shardings, donate_argnums=program.donate)

    def initializer(self, body: Callable[..., Any]) -> Callable[..., Any]:
        """Runs `body(rng, inputs)` once per device; every device builds the same variables.

        Annotated variables (`nn.with_logical_partitioning`) come out unboxed: the state
        holds the same arrays on every strategy.
        """
        # check_vma is off: variables come from the replicated key, but a data-dependent
        # initializer would mark them per-device; device 0's copy is the one kept.
        return jax.jit(
            jax.shard_map(
                lambda key, inputs: nn.meta.unbox(body(key, inputs)),
                mesh=self.mesh,
                in_specs=(P(), P(AXIS)),
                out_specs=P(),
                check_vma=False,
            )
        )

    def state_creation(
        self,
        init: Callable[[Any, Any], dict],
        build: Callable[[dict, Any, Any], Any],
        rng: Any,
        inputs: list[Any],
        given_params: Callable[[Any], Any] | None,
    ) -> tuple[Wrapped, tuple]:
        """The program creating the train state `build(variables, rng, start)`, and its arguments.

        One program: `variables` are what `init(rng, inputs)` builds on every device, and
        the optimizer and metric states are built beside them (built op by op, each would
        compile a small program of its own). `start` is `given_params(abstract params)`, or
        None without one (unused random parameters are left out of the program).
        """
        initializer = self.initializer(init)
        start = None
        if given_params is not None:
            start = given_params(jax.eval_shape(initializer, rng, inputs).get("params", {}))

        def create(key: Any, batch: Any, start: Any) -> Any:
            return build(initializer(key, batch), key, start)

        return jax.jit(create, out_shardings=self._replicated), (rng, inputs, start)

    def abstract_placed(self, state: Any) -> Any:
        """The shapes, dtypes and shardings `place_state` gives `state` (its leaves abstract).

        What a program is lowered against while the state it will run on is being created.
        """
        return jax.tree.map(
            lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=self._replicated),
            state,
        )

    def plan_layout(self, init: Callable[[Any, Any], dict], rng: Any, inputs: list[Any]) -> bool:
        """Plans where the variables `init(rng, inputs)` live; whether placement changed.

        Every leaf is replicated here: nothing to plan.
        """
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(devices={self.num_devices})"


class MultiProcess(Strategy):
    """shard_map over devices of several processes, each passing its share of the batch.

    The shares are assembled into global arrays before every call.
    """

    multi_process = True
    compiles_ahead = False  # a global batch is assembled from this process's real arrays
    # Read back on one process (a writer's hook), a packed average's unpacking would be a
    # program over arrays that span the processes: kept leaf by leaf.
    packs_average = False

    def __init__(self, devices: Sequence[Device]):
        super().__init__(devices)

    def global_batch(self, arrays: list[Any], batch_axis: int = 0) -> list[Any]:
        """Global arrays assembled from each process's local share, split on `batch_axis`."""
        sharding = self._shardings[batch_axis]
        return [jax.make_array_from_process_local_data(sharding, np.asarray(a)) for a in arrays]


class Pmap(Strategy):
    """Literal `jax.pmap` over this process's devices: state keeps a leading device axis."""

    name = "pmap"
    slices_in_scan = False
    compiles_ahead = False  # its programs take their batches' placement from the batches

    def __init__(self, devices: Sequence[Device]):
        if any(d.process_index != jax.process_index() for d in devices):
            raise ValueError("parallel='pmap' runs on this process's devices only; use 'shard_map'")
        super().__init__(devices)

    def place_state(self, state: Any) -> Any:
        """Host arrays with a leading device axis: pmap takes them so and keeps them so."""
        n = self.num_devices
        return jax.tree.map(
            lambda leaf: np.broadcast_to(np.asarray(leaf), (n, *np.shape(leaf))), state
        )

    def global_batch(self, arrays: list[Any], batch_axis: int = 0) -> list[Any]:
        """Unchanged: the pmapped program takes a batch of any placement."""
        return arrays

    def unplace(self, state: Any) -> Any:
        """Device 0's copy."""
        return jax.tree.map(lambda leaf: leaf[0], state)

    def abstract_placed(self, state: Any) -> Any:
        """As `Strategy.abstract_placed`: host arrays with a leading device axis."""
        n = self.num_devices
        return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct((n, *leaf.shape), leaf.dtype), state)

    def gradient_objective(self, local_loss: jax.Array, pmean: Callable[[Any], Any]) -> Any:
        """The local loss: pmap's gradients are per device, averaged by `gradient_mean`."""
        return local_loss

    def gradient_mean(self, grads: Any, pmean: Callable[[Any], Any]) -> Any:
        """The per-device gradients averaged over devices."""
        return pmean(grads)

    def wrap(
        self, body: Callable[..., Any], program: ProgramShape, sharded: int, batch_axis: int = 0
    ) -> Wrapped:
        """As `Strategy.wrap`; the state arguments and new state carry the device axis."""
        num_devices, num_replicated = self.num_devices, program.replicated
        pmapped = jax.pmap(
            body,
            axis_name=AXIS,
            devices=self.devices,
            out_axes=0 if program.per_example_output else (0, None),
            donate_argnums=program.donate,
        )

        def to_devices(a: jax.Array) -> jax.Array:
            # The batch axis split into (devices, per device), the device axis moved first;
            # inside the compiled program: an eager reshape per step would cost more than a
            # small step.
            shape = a.shape
            split = a.reshape(
                (*shape[:batch_axis], num_devices, shape[batch_axis] // num_devices)
                + shape[batch_axis + 1 :]
            )
            return jnp.moveaxis(split, batch_axis, 0)

        def split_batch_then_pmap(*args):
            state, batch = args[:num_replicated], args[num_replicated:]
            out = pmapped(*state, *jax.tree.map(to_devices, batch))
            if program.per_example_output:  # devices x per-device examples -> one batch
                out = jax.tree.map(lambda a: a.reshape((-1, *a.shape[2:])), out)
            return out

        return jax.jit(split_batch_then_pmap, donate_argnums=program.donate)


def choose(parallel: str, devices: Sequence[Device] | None) -> Strategy:
    """The strategy for `parallel=` over `devices` (default: all of `jax.devices()`).

    Raises:
      ValueError: unknown `parallel`, empty `devices`, or pmap over another process's
        devices.
    """
    if parallel not in STRATEGIES:
        raise ValueError(f"parallel must be 'shard_map' or 'pmap', got {parallel!r}")
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("devices is empty; pass None for all devices or a non-empty list")
    if parallel == "pmap":
        return Pmap(devices)
    if jax.process_count() > 1:
        return MultiProcess(devices)
    return Strategy(devices)
