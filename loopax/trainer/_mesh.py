"""Training on a device mesh with sharded state: `Trainer(mesh=, rules=, fsdp=)`.

Here the step bodies see the global batch: each is one `jax.jit` with the state's
shardings in and out and the batch split over the mesh axis `"data"`, and XLA's SPMD
partitioner places the computation. No per-device code runs, so the bodies' collectives
are identities, the RNG key is one per step over the global batch (dropout draws the same
masks on any mesh), and `ctx.axis_name` is None.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.stages import Wrapped

from .._compilation_cache import enable_default_cache
from .._devices import Device
from ._layout import DATA, Layout, check_rules
from ._parallel import ProgramShape, Strategy, choose
from ._state import TrainState


def build_mesh(mesh: Any, devices: Sequence[Device] | None) -> Mesh:
    """The mesh for `Trainer(mesh=...)`: a dict of axis sizes or a `jax.sharding.Mesh`.

    A dict's axes come in its order over `devices` (default all of `jax.devices()`), one
    size may be -1 (the rest of the devices); every axis is an Auto axis (GSPMD places
    what no sharding pins; Explicit axes break plain Flax layers).

    Raises:
      ValueError: no `"data"` axis, sizes that do not multiply to the device count, a
        bad size, a mesh with Explicit axes, or `devices` other than the mesh's.
    """
    if isinstance(mesh, Mesh):
        if DATA not in mesh.axis_names:
            raise ValueError(
                f"the mesh has axes {tuple(mesh.axis_names)} but no {DATA!r} axis, which "
                f"batches are split over; name one axis {DATA!r}"
            )
        explicit = [n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
                    if t == AxisType.Explicit]  # fmt: skip
        if explicit:
            raise ValueError(
                f"mesh axes {explicit} are Explicit; loopax needs Auto axes (plain Flax layers "
                "fail on Explicit ones): build it with axis_types=(AxisType.Auto,) * n, or "
                "pass a dict of axis sizes"
            )
        if devices is not None and set(devices) != set(mesh.devices.flat):
            raise ValueError(
                "devices= differs from the mesh's devices; pass only mesh= (its devices are used)"
            )
        return mesh
    if not isinstance(mesh, Mapping):
        raise ValueError(
            f"mesh must be None, a dict of axis sizes such as {{'data': 2, 'model': 2}}, or a "
            f"jax.sharding.Mesh; got {type(mesh).__name__}"
        )
    chosen = list(jax.devices() if devices is None else devices)
    sizes = dict(mesh)
    if DATA not in sizes:
        raise ValueError(
            f"mesh {sizes} has no {DATA!r} axis, which batches are split over; add one "
            f"(e.g. {{'data': -1, **mesh}})"
        )
    for name, size in sizes.items():
        if not isinstance(name, str) or not isinstance(size, int) or (size < 1 and size != -1):
            raise ValueError(
                f"mesh {sizes}: each axis needs a str name and a positive int size (one may "
                f"be -1), got {name!r}: {size!r}"
            )
    free = [name for name, size in sizes.items() if size == -1]
    known = math.prod(size for size in sizes.values() if size != -1)
    if len(free) > 1:
        raise ValueError(f"mesh {sizes} has more than one -1 size; give all but one")
    if free:
        if len(chosen) % known:
            raise ValueError(
                f"mesh {sizes}: the other axes' sizes multiply to {known}, which does not "
                f"divide the {len(chosen)} devices; pick sizes whose product divides it"
            )
        sizes[free[0]] = len(chosen) // known
    if math.prod(sizes.values()) != len(chosen):
        raise ValueError(
            f"mesh {dict(mesh)} needs {math.prod(sizes.values())} devices in all, but there "
            f"are {len(chosen)}; give sizes that multiply to {len(chosen)} (one may be -1)"
        )
    shape = tuple(sizes.values())
    return Mesh(
        np.array(chosen).reshape(shape), tuple(sizes), axis_types=(AxisType.Auto,) * len(shape)
    )


def _local_data_shards(mesh: Mesh) -> int:
    """How many of the `"data"` axis's shards this process's devices hold.

    Raises:
      ValueError: (several processes) processes would share a shard of the batch.
    """
    data_axis = mesh.axis_names.index(DATA)
    owners: dict[int, set[int]] = {}
    for index, device in np.ndenumerate(mesh.devices):
        owners.setdefault(index[data_axis], set()).add(device.process_index)
    shared = [shard for shard, processes in owners.items() if len(processes) > 1]
    mine = [shard for shard, processes in owners.items() if jax.process_index() in processes]
    if shared:
        raise ValueError(
            f"mesh {dict(mesh.shape)}: the processes share shards of the 'data' axis, so "
            "their batches would overlap; make the 'data' axis the first and a multiple of "
            f"the process count ({jax.process_count()})"
        )
    return len(mine)


class Sharded(Strategy):
    """`jax.jit` of the global-batch step bodies on a mesh, with the state's shardings.

    Attributes:
      mesh: the mesh; batches are split over its `"data"` axis.
      rules: the logical-axis rules; `fsdp`: whether unannotated parameters are sharded
        over `"data"`.
      layout: the partition specs of the model's variables, once the state was created.
      state_shardings: the placed state's shardings (a tree like it), or None.
    """

    name = "mesh"
    slices_in_scan = False  # a global-batch program gathers its fused steps' batches first
    axis_name = None
    annotates = True
    packs_average = False  # the average is sharded as the parameters, leaf by leaf

    def __init__(self, mesh: Mesh, rules: Sequence[Any] | None, fsdp: bool):
        super().__init__(list(mesh.devices.flat))
        self.mesh = mesh
        self.rules = check_rules(rules, mesh)
        self.fsdp = bool(fsdp)
        self.multi_process = jax.process_count() > 1
        self.compiles_ahead = not self.multi_process
        self.body_devices = 1  # one program over the global batch
        self.local_devices = _local_data_shards(mesh)  # what a local batch must divide by
        self._replicated = NamedSharding(mesh, P())
        self._shardings = [NamedSharding(mesh, P(*([None] * axis), DATA)) for axis in range(3)]
        self.layout: Layout | None = None
        self.state_shardings: Any = None

    def device_index(self) -> Any:
        """One key per step over the global batch: the same as device 0's of one device."""
        return 0

    # -- state and batches --------------------------------------------------------------

    def place_state(self, state: Any) -> Any:
        """A train state in its layout's shardings (before there is one: replicated).

        Anything else replicated. Host arrays or jax.Arrays of any sharding: jax.Arrays are
        resharded on the devices, never gathered to a host.
        """
        if not isinstance(state, TrainState):
            return jax.device_put(state, self._replicated)
        if self.layout is None:  # until the first batch plans one: jax.Arrays stay put
            shardings = jax.tree.map(
                lambda leaf: leaf.sharding if isinstance(leaf, jax.Array) else self._replicated,
                state,
            )
        else:
            shardings = self.layout.shardings(state)
        self.state_shardings = shardings
        return jax.device_put(state, shardings)

    def sharding_of(self, leaf: Any) -> Any:
        """Where a leaf of the placed state lives: its own sharding."""
        return leaf.sharding

    def host_state(self, state: Any) -> Any:
        """`state` as `place_state` takes it: unchanged (no host copy is made)."""
        return state

    def global_batch(self, arrays: list[Any], batch_axis: int = 0) -> list[Any]:
        """This process's batch as the program takes it, split over `"data"`.

        A batch that the data shards do not divide (an uneven eval batch) is replicated.

        Raises:
          ValueError: several processes and such a batch.
        """
        if any(np.shape(a)[batch_axis] % self.local_devices for a in arrays):
            if self.multi_process:
                raise ValueError(
                    f"eval batch of {np.shape(arrays[0])[batch_axis]} examples on a mesh of "
                    f"several processes: each process's batch must divide by its "
                    f"{self.local_devices} data shards; pad the dataset or pick such a batch size"
                )
            return arrays
        if self.multi_process:
            sharding = self._shardings[batch_axis]
            return [jax.make_array_from_process_local_data(sharding, np.asarray(a)) for a in arrays]
        return super().global_batch(arrays, batch_axis)

    # -- compiling ----------------------------------------------------------------------

    def wrap(
        self, body: Callable[..., Any], program: ProgramShape, sharded: int, batch_axis: int = 0
    ) -> Wrapped:
        """`body` as one jit over the global batch.

        The state in its shardings, the batch split over `"data"` (replicated when
        `program.split_batch` is off), values replicated.
        """
        batch = self._shardings[batch_axis] if program.split_batch else self._replicated
        replicated = self._replicated
        in_shardings = (
            self.state_shardings,
            *(replicated,) * (program.replicated - 1),
            *(batch,) * sharded,
        )
        if program.per_example_output:
            out_shardings: Any = batch
        else:
            out_shardings = (self.state_shardings if program.updates_state else replicated,
                             replicated)  # fmt: skip
        return jax.jit(
            body,
            in_shardings=in_shardings,
            out_shardings=out_shardings,
            donate_argnums=program.donate,
        )

    def initializer(self, body: Callable[..., Any]) -> Callable[..., Any]:
        """`body(rng, inputs)` on the global batch; the variables unboxed."""
        return jax.jit(lambda key, inputs: nn.meta.unbox(body(key, inputs)))

    def _plan(self, init: Callable[[Any, Any], dict], rng: Any, inputs: list[Any]) -> tuple:
        """Sets `layout` from the abstract variables of `init(rng, inputs)`; both."""
        boxed = jax.eval_shape(init, rng, inputs)
        layout = self.layout = Layout.plan(self.mesh, self.rules, self.fsdp, boxed)
        return boxed, layout

    def plan_layout(self, init: Callable[[Any, Any], dict], rng: Any, inputs: list[Any]) -> bool:
        """Sets `layout` from the variables of `init(rng, inputs)`; True: move the state.

        A state placed before there was a layout (loaded before the first batch) moves in.
        """
        self._plan(init, rng, inputs)
        return True

    def state_creation(
        self,
        init: Callable[[Any, Any], dict],
        build: Callable[[dict, Any, Any], TrainState],
        rng: Any,
        inputs: list[Any],
        given_params: Any,
    ) -> tuple[Wrapped, tuple]:
        """The program creating the train state sharded (no replicated copy), and its arguments.

        `eval_shape` of the init plans the layout, then the one program puts out every
        leaf in its sharding.

        Args:
          init: `init(rng, inputs)`, the model's variables (boxed where annotated).
          build: `build(variables, rng, given_params)`, the train state from them.
          rng: the init key.
          inputs: the global batch.
          given_params: a function of the abstract params returning the parameters to start
            from (`init_params` checked against them), or None.
        """
        boxed, layout = self._plan(init, rng, inputs)

        def build_state(key: Any, batch: Any, start: Any) -> TrainState:
            return build(nn.meta.unbox(init(key, batch)), key, start)

        start = start_shardings = None
        if given_params is not None:
            abstract = nn.meta.unbox(boxed).get("params", {})
            start_shardings = layout.param_shardings(abstract)
            start = jax.device_put(given_params(abstract), start_shardings)
        shardings = layout.shardings(jax.eval_shape(build_state, rng, inputs, start))
        data = self.mesh.shape[DATA]
        batch = [self._replicated if np.shape(a)[0] % data else self._shardings[0] for a in inputs]
        creation = jax.jit(
            build_state,
            in_shardings=(self._replicated, batch, start_shardings),
            out_shardings=shardings,
        )
        return creation, (rng, inputs, start)

    def abstract_placed(self, state: Any) -> Any:
        """The state's leaves as `place_state` lays them out, abstract (see `Strategy`).

        Sets `state_shardings`, which the programs lowered against it take.
        """
        if self.layout is None:  # never: `state_creation` plans it first
            raise RuntimeError("the layout is planned when the state's creation starts")
        shardings = self.state_shardings = self.layout.shardings(state)
        return jax.tree.map(
            lambda leaf, sharding: jax.ShapeDtypeStruct(
                leaf.shape, leaf.dtype, sharding=sharding, weak_type=leaf.weak_type
            ),
            state,
            shardings,
        )

    def __repr__(self) -> str:
        return f"Sharded(mesh={dict(self.mesh.shape)})"


def choose_strategy(
    parallel: str,
    devices: Sequence[Device] | None,
    mesh: Any = None,
    rules: Sequence[Any] | None = None,
    fsdp: bool = False,
) -> Strategy:
    """The strategy for the Trainer's arguments.

    `Sharded` when `mesh`, `rules` or `fsdp` is given, else `choose(parallel, devices)`.

    It also turns on the persistent compilation cache the strategy's programs go to
    (`loopax.set_compilation_cache`).

    Raises:
      ValueError: as `choose` and `build_mesh`; `parallel="pmap"` with a mesh; bad rules.
    """
    enable_default_cache()
    if mesh is None and rules is None and not fsdp:
        return choose(parallel, devices)
    if parallel != "shard_map":
        raise ValueError(
            f"mesh=, rules= and fsdp= run on a device mesh with jax.jit; parallel={parallel!r} "
            "cannot: leave parallel at its default"
        )
    if devices is not None and not list(devices):
        raise ValueError("devices is empty; pass None for all devices or a non-empty list")
    built = build_mesh({DATA: -1} if mesh is None else mesh, devices)
    return Sharded(built, rules, fsdp)
