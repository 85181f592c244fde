"""FSDP on 4 simulated CPU devices: loopax `fsdp=True` against a hand-written `jax.jit` step.

Issue 21's targets:
- steps/s of loopax's bare Loop with `Trainer(mesh={"data": 4}, fsdp=True)` >= 0.97x a
  hand-written `jax.jit` step with the same shardings (parameters and Adam moments of rank
  >= 2 sharded over "data" along their largest dimension 4 divides, everything else
  replicated, the batch split over "data", state donated). Both train the README's network
  (Dense 256, dropout 0.2, Dense 10) on 784 features, global batch 128, adam, with one
  dropout key per step, the loss's moving average kept as loopax keeps it, from the same
  device-resident batches, at most 4 steps in flight (as loopax bounds them on several
  devices).
- per-device state bytes (parameters + optimizer state) under FSDP <= total/N + 1%: from
  the compiled train step's `memory_analysis()` (arguments, less the batch) and from the
  arrays' shards, for the README's network and for an MLP of >= 50M parameters (4096 wide,
  one step trained).

Run: python benchmarks/bench_fsdp.py [--quick] [--rounds N]
(it runs itself again in a subprocess with 4 simulated CPU devices.) `run_all.py` runs it
as its "fsdp" section.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

DEVICE_COUNT = 4
STEPS = (512, 64)  # per round: full run / --quick
ROUNDS = (9, 3)
REFERENCE = "hand-written jax.jit step, FSDP shardings"
LOOPAX = 'loopax Loop, bare, mesh={"data": 4}, fsdp=True'
TARGET = 0.97
BYTES_TARGET = 1.01  # per-device state bytes over total/N


def readme_model(ctx: Any, spec: Any, inputs: list) -> Any:
    import flax.linen as nn  # noqa: PLC0415

    x = nn.relu(nn.Dense(256)(inputs[0]))
    x = nn.Dropout(0.2, deterministic=not ctx.training)(x)
    return nn.Dense(10)(x)


def big_model(ctx: Any, spec: Any, inputs: list) -> Any:
    """An MLP 4096-4096-4096-4096-10: 50.4M parameters."""
    import flax.linen as nn  # noqa: PLC0415

    x = inputs[0]
    for _ in range(3):
        x = nn.relu(nn.Dense(4096)(x))
    return nn.Dense(10)(x)


def fsdp_spec(shape: tuple[int, ...]) -> Any:
    """The hand-written rule: rank >= 2 sharded on its largest dimension 4 divides."""
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    candidates = [d for d in range(len(shape)) if shape[d] % DEVICE_COUNT == 0]
    if len(shape) < 2 or not candidates:
        return P()
    dim = max(candidates, key=lambda d: (shape[d], -d))
    return P(*([None] * dim), "data")


def hand_written(mesh: Any, batches: list, steps: int) -> Any:
    """The README network's train step, written by hand with FSDP shardings."""
    import _common  # noqa: PLC0415
    import flax.linen as nn  # noqa: PLC0415
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import optax  # noqa: PLC0415
    from jax.sharding import NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    class Network(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            x = nn.relu(nn.Dense(256)(x))
            x = nn.Dropout(0.2, deterministic=not train)(x)
            return nn.Dense(10)(x)

    network, optimizer, key = Network(), optax.adam(1e-3), jax.random.PRNGKey(0)

    def step(state, x, y):
        params, opt_state, count, average = state
        dropout = jax.random.fold_in(key, count)

        def loss_of(p):
            logits = network.apply(p, x, True, rngs={"dropout": dropout})
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        weight = jnp.maximum(0.01, 1.0 / (count + 1.0))
        average = average * (1.0 - weight) + loss * weight
        return (optax.apply_updates(params, updates), opt_state, count + 1, average), loss

    x0 = batches[0][1][0]

    def sharding_of(leaf: Any) -> Any:
        return NamedSharding(mesh, fsdp_spec(tuple(leaf.shape)))

    def init() -> Any:
        params = network.init(key, x0, False)
        return (params, optimizer.init(params), jnp.zeros((), jnp.int32), jnp.zeros(()))

    shardings = jax.tree.map(sharding_of, jax.eval_shape(init))
    state = jax.jit(init, out_shardings=shardings)()
    batch = NamedSharding(mesh, P("data"))
    stepped = jax.jit(
        step,
        in_shardings=(shardings, batch, batch),
        out_shardings=(shardings, NamedSharding(mesh, P())),
        donate_argnums=0,
    )
    return _common._cycle(stepped, state, batches, steps, 4)


def loopax_run(mesh: Any, batches: list, steps: int) -> Any:
    import _common  # noqa: PLC0415
    import optax  # noqa: PLC0415

    import loopax  # noqa: PLC0415

    trainer = loopax.Trainer(readme_model, _common.loss_fn, optax.adam(1e-3), mesh=mesh, fsdp=True)
    loop = loopax.Loop(trainer)
    dataset = _common.CyclingDataset(batches)
    loop.run_steps(dataset, 2)  # compile

    def run() -> None:
        loop.run_steps(dataset, steps)["loss"].block_until_ready()

    return run


def state_bytes(model: Any, features: int, batch: int) -> dict:
    """Per-device state bytes of one FSDP train step, from XLA and from the shards."""
    import _common  # noqa: PLC0415
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import optax  # noqa: PLC0415

    import loopax  # noqa: PLC0415

    trainer = loopax.Trainer(model, _common.loss_fn, optax.adam(1e-3), mesh={"data": -1}, fsdp=True)
    x = np.zeros((batch, features), np.float32)
    y = np.zeros((batch,), np.int32)
    trainer.train_step(None, [x], [y])
    (executor,) = trainer.executors()
    arguments = executor.run.memory_analysis().argument_size_in_bytes
    batch_bytes = (x.nbytes + y.nbytes) // DEVICE_COUNT
    state = trainer.state.replace(rng=None)
    leaves = jax.tree.leaves(state)
    total = sum(leaf.nbytes for leaf in leaves)
    shards = sum(leaf.addressable_shards[0].data.nbytes for leaf in leaves)
    params = sum(leaf.size for leaf in jax.tree.leaves(trainer.params))
    ideal = total / DEVICE_COUNT
    return {
        "parameters": params,
        "total": total,
        "xla_per_device": arguments - batch_bytes,
        "shards_per_device": shards,
        "ratio_xla": (arguments - batch_bytes) / ideal,
        "ratio_shards": shards / ideal,
    }


def worker(args: argparse.Namespace) -> None:
    """In the 4-device subprocess: the timed comparison and the bytes; prints JSON."""
    import _common  # noqa: PLC0415
    import jax  # noqa: PLC0415
    from jax.sharding import AxisType, NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    if jax.device_count() != DEVICE_COUNT:
        raise SystemExit(f"expected {DEVICE_COUNT} CPU devices, got {jax.device_count()}")
    mesh = jax.make_mesh((DEVICE_COUNT,), ("data",), axis_types=(AxisType.Auto,))
    workload = _common.Workload("readme", (784, 256, 10), 128)
    batches = _common.make_batches(workload, sharding=NamedSharding(mesh, P("data")))
    steps = STEPS[args.quick]
    candidates = {
        REFERENCE: hand_written(mesh, batches, steps),
        LOOPAX: loopax_run(mesh, batches, steps),
    }
    timings = _common.interleave(candidates, steps, args.rounds, 0 if args.quick else 1)
    rows = [
        (row, timings.rate(row), timings.ratio(row, REFERENCE), timings.spread(row, REFERENCE))
        for row in candidates
    ]
    memory = {
        "README net": state_bytes(readme_model, 784, 128),
        "MLP 4096-4096x3-10": state_bytes(big_model, 4096, 8),
    }
    print("FSDP-JSON " + json.dumps({"rows": rows, "memory": memory}), flush=True)


def sections(args: argparse.Namespace) -> list[tuple[str, dict]]:
    """Runs the worker with 4 simulated CPU devices; `run_all.py`'s sections."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICE_COUNT}"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    command = [sys.executable, __file__, "--worker", "--rounds", str(args.rounds)]
    if args.quick:
        command.append("--quick")
    result = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True, check=False)
    found = [line for line in result.stdout.splitlines() if line.startswith("FSDP-JSON ")]
    title = f"FSDP on {DEVICE_COUNT} devices: README network, 784 features, batch 128, adam"
    if not found:
        why = (
            f"n/a (the {DEVICE_COUNT}-device subprocess failed with exit code {result.returncode})"
        )
        return [("fsdp", {"title": title, "rows": [(REFERENCE, why)]})]
    data = json.loads(found[0][len("FSDP-JSON ") :])
    rows = [tuple(row) for row in data["rows"]]
    rows[0] = (REFERENCE, rows[0][1], 1.0, 0.0)
    timed = {"title": title, "rows": rows, "reference": REFERENCE, "targets": {LOOPAX: TARGET}}
    memory_rows = []
    for name, figures in data["memory"].items():
        for source in ("xla", "shards"):
            ratio = figures[f"ratio_{source}"]
            label = f"{name}, {'memory_analysis()' if source == 'xla' else 'shard sizes'}"
            text = (
                f"{figures[f'{source}_per_device']:,} B/device of {figures['total']:,} "
                f"({figures['parameters']:,} params): {ratio:.4f} x total/{DEVICE_COUNT}  "
                f"<= {BYTES_TARGET}  {'PASS' if ratio <= BYTES_TARGET else 'FAIL'}"
            )
            memory_rows.append((label, text))
    memory = {"title": "FSDP per-device state bytes (params + adam)", "rows": memory_rows,
              "header": False}  # fmt: skip
    return [("fsdp", timed), ("fsdp-memory", memory)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.quick = int(args.quick)
    if args.rounds is None:
        args.rounds = ROUNDS[args.quick]
    if args.worker:
        worker(args)
        return
    from run_all import print_table  # noqa: PLC0415 - the suite's table, for this section alone

    started, load_before = time.perf_counter(), os.getloadavg()
    print_table(sections(args), started, load_before)


if __name__ == "__main__":
    main()
