"""The whole benchmark suite in one command: one table of ratios measured side by side.

Two workloads, both trained from the same device-resident batches with donated state:
  tiny    MLP 64-128-10, batch 64, adam          (overhead-bound)
  medium  MLP 784-512-512-10, batch 128, adam    (compute-bound)

On each, one interleaved comparison against a hand-written `jax.jit` loop (no per-step
sync): loopax's Loop bare, with 5 no-op `every_n_steps` hooks, and with the README's
hooks (progress bar, TensorBoard, checkpoint every 60 s; a second row saves every 1000
steps); the same network as a Flax NNX module, trained by its hand-written `nnx.jit` step
as Flax's docs write it and by loopax's bare Loop (`loopax.Trainer(module, ...)`); Keras 3
`fit` on the JAX backend with `steps_per_execution` 1 and 32 (same network and optimizer,
the same batches as device arrays). On 4 simulated CPU devices (a
subprocess with `XLA_FLAGS=--xla_force_host_platform_device_count=4`): loopax
`parallel="shard_map"` and `"pmap"` against a hand-written `jax.jit(jax.shard_map(step))`.
The accumulate section (issue 14, `bench_accumulate.py`), on the medium network: loopax's
Loop with `accumulate_steps=8` over micro-batches of 32 against a hand-written `jax.jit`
step that `lax.scan`s over the 8 pre-stacked micro-batches (examples/s), and loopax with
`compute_dtype=bfloat16` beside loopax in float32 (batch 128). The fused section (issue 15,
`bench_fused.py`): loopax's Loop with `steps_per_execution=32` and the README's hooks, reading
an `ArrayDataset(..., on_device=True)` (device-resident batches where that option is missing),
against the hand-written per-step `jax.jit` loop, a hand-written `jax.jit(lax.scan)` of 32
steps a dispatch over pre-stacked device data, Keras `fit` with `steps_per_execution=32`
(tiny), and on 4 simulated devices the hand-written `jit(shard_map)` step; plus the seconds
compiling the 32-step program against the one-step program. The shuffled section (issue 25,
`bench_fused.py`), tiny: the same fused Loop on an on-device `ArrayDataset` that reshuffles
every epoch of 512 batches, against a hand-written scan that permutes each epoch on the
device once (one gather) and slices contiguous batches (the same batches), the scan over
pre-stacked batches (no permutation: the ceiling), the Loop with `shuffled_copy=False` and
Keras `fit(shuffle=True, steps_per_execution=32)`. The fsdp section (issue 21,
`bench_fsdp.py`), on 4 simulated devices: loopax `mesh={"data": 4}, fsdp=True` against a
hand-written `jax.jit` step with the same shardings (target >= 0.97), and the per-device
state bytes under FSDP against total/4 (target <= 1.01) for the README's network and a
50M-parameter MLP. The restart section (issue 25, `bench_restart.py`): the seconds from a
process's start to its first step, `examples/digits.py` resumed with JAX's compilation cache
filled against a cold process (target <= 0.4x). The runend section (issue 25,
`bench_run_end.py`): whole `run_steps` calls of 3000 tiny steps, the README's hooks (their
end-of-run save and flushes included) against the bare Loop (target >= 0.97).
The lm section (issue 25, `bench_lm.py`): the character transformer of
`examples/transformer_lm.py` (2 layers, width 128, context 64, batch 32) in tokens/s against
a hand-written `jax.jit` step: a hand-written `lax.scan` of 8 steps, loopax per step and fused
with K=8 on on-device data, and bfloat16 on both sides; then, one fresh process per candidate
with the compilation caches off, the seconds a run waits for compiling and its peak memory.
The ema section (issue 23, `bench_ema.py`), on both workloads: the bare Loop with
`Trainer(ema_decay=0.999)` against the same Loop without it (target >= 0.97: within 3%).

Details that matter for reading the figures:
- The README-hooks row times the steps with their per-step hooks, up to the first OnEnd
  hook; the row under it times the whole `run_steps` call of each round, which adds the
  checkpoint hook's end-of-run save (it waits for it) and the TensorBoard flush: a cost
  per run, not per step, paid here once per round.
- Keras gets the batches as device arrays (one epoch of `steps` steps per `fit` call).
  The tiny section also runs both sides as their users feed them, from numpy arrays on
  the host: loopax through an `ArrayDataset`, Keras `fit(x, y)`; the target is printed
  for both pairings.
- The hand-written shard_map loop waits for the step 4 back before dispatching the next,
  like loopax: with 4 simulated devices on 2 cores, an unbounded queue of dispatched steps
  deadlocks the all-reduce.
- Targets are printed beside the figures. Issue 13, tiny: the README hooks >= 0.97x the bare
  Loop, and the bare Loop >= 0.97x the hand-written loop that computes the same outputs (the
  loss's moving average too). Issue 6: README hooks >= 0.95x hand-written and >= 2.5x Keras
  fit (steps_per_execution=1) on tiny, >= 0.99x on medium; loopax shard_map >= the
  hand-written shard_map within noise (max(± , 0.02)) on 4 devices. Issue 12, tiny and
  medium: the NNX module through loopax >= 0.97x its hand-written `nnx.jit` step. Issue 14:
  accumulate_steps=8 through loopax >= 0.95x the hand-written scan step; bfloat16 vs
  float32 is reported without a target. Issue 15, the fused Loop (K=32, README hooks): >= 1.3x
  the per-step loop on tiny, >= 1.0x on medium, >= 1.3x the jit(shard_map) step on 4
  devices; >= 0.95x the hand-written scan and >= 1.5x Keras fit(steps_per_execution=32), tiny.
  Issue 25 item 1, shuffled: the fused Loop (K=32, README hooks) >= 0.95x the hand-written
  scan that permutes each epoch on the device, >= 1.5x Keras fit(shuffle=True, spe=32).
- The README's TensorBoard hook writes every 100 steps, and a fused group ends at the next
  step a scheduled hook fires at: with K=32 the groups run 32, 32, 32, 4 steps (the bare
  fused row has no such cuts). Every-step and time-based hooks run once per group. The
  fused section also prints the hand-written scan against Keras: the ceiling of the Keras
  target, since Keras's steps_per_execution is a Python loop of single-step calls on JAX
  and runs near the per-step loop's rate.

Every candidate of a comparison runs once per round, in an order that rotates from round
to round; a ratio is the median over rounds of the paired per-round ratio of steps/s
(> 1: faster than the reference), "±" is half the interquartile range of those ratios.

The device benchmark (issue 33, `bench_device.py`): `--device` measures on JAX's default
backend (a GPU where there is one; `JAX_PLATFORMS` respected) loopax against hand-written
loops per step and fused, the digits main job and the transformer LM at GPU size, sized by
`--size` (auto: full on an accelerator, a few-minute smoke run on the CPU);
`benchmarks/device_run.sh OUTDIR` runs it with the accelerator-safe tests in one go.

Run: python benchmarks/run_all.py [--quick]
       [--only tiny,medium,devices,keras,accumulate,fused,shuffled,fsdp,restart,runend,lm,ema]
       [--rounds N]
     python benchmarks/run_all.py --device [--size auto|small|full] [--json PATH]
       [--only tiny,fused,enqueue,sweep,digits,lm-compile,lm,first-step] [--rounds N]
Needs: pip install -r benchmarks/requirements.txt  (Keras, for the Keras rows only)
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SECTIONS = (
    "tiny",
    "medium",
    "devices",
    "keras",
    "accumulate",
    "fused",
    "shuffled",
    "fsdp",
    "restart",
    "runend",
    "lm",
    "ema",
)
DEVICE_COUNT = 4

# Steps per round: full run / --quick. Multiples of 32 so that Keras with
# steps_per_execution=32 runs whole executions only.
STEPS = {
    "tiny": (8192, 512),
    "medium": (512, 64),
    "devices-tiny": (1024, 256),
    "devices-medium": (128, 32),
    "shuffled": (8192, 512),  # whole epochs of 512 steps
}
ROUNDS = (9, 3)
WARMUP_ROUNDS = (1, 0)  # untimed rounds first (the steps are compiled before either way)

REFERENCE = "hand-written jax.jit loop"
REFERENCE_AVERAGE = "  same + the loss's moving average, as loopax"
BARE = "loopax Loop, bare"
NOOP = "loopax Loop + 5 no-op hooks"
README = "loopax Loop + README hooks"
FREQUENT_SAVES = "  same, checkpoint every 1000 steps"
README_WHOLE = "  same, whole run_steps (incl. end-of-run save)"
KERAS = "Keras fit, steps_per_execution={}"
# The same comparison fed as users of each library feed it: numpy arrays on the host.
README_HOST = "loopax Loop + README hooks, numpy ArrayDataset"
KERAS_HOST = "Keras fit, steps_per_execution=1, numpy arrays"
DEVICE_REFERENCE = "hand-written jit(shard_map) step"
SHARD_MAP = 'loopax parallel="shard_map"'
PMAP = 'loopax parallel="pmap"'
NNX_TARGET = 0.97  # issue 12, on both workloads
# Issue 15: the fused Loop (K=32, README hooks, on-device data) against each baseline.
FUSED_TARGETS = {
    "per-step": {"tiny": 1.3, "medium": 1.0, "devices": 1.3},
    "scan": {"tiny": 0.95},  # elsewhere printed without a target
    "keras": 1.5,
}
# Issue 25 item 1: the fused Loop (K=32, README hooks) on shuffled on-device data.
SHUFFLED_TARGETS = {"scan": 0.95, "keras": 1.5}
COMPILE_REPEATS = (3, 1)  # fresh trainers per compile-seconds figure: full run / --quick


# -- candidates ---------------------------------------------------------------------------


def keras_fit(
    workload: Any,
    batches: list,
    steps: int,
    steps_per_execution: int,
    host: bool = False,
    shuffled: tuple | None = None,
):
    """Keras 3 `fit` (JAX backend) of the same network on the same batches.

    One epoch of `steps` steps per round; `host=True` passes them as numpy arrays (Keras's usual
    input) instead of device arrays. With `shuffled` (x, y), `fit(shuffle=True)` on those rows
    instead: `steps` steps of whole epochs per round. Returns the run, or None and why Keras
    cannot run.
    """
    os.environ["KERAS_BACKEND"] = "jax"
    try:
        import keras  # noqa: PLC0415
    except ImportError:
        return None, "n/a (keras missing: pip install -r benchmarks/requirements.txt)"
    if keras.backend.backend() != "jax":
        return None, f"n/a (keras was imported with the {keras.backend.backend()} backend)"
    import _common  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    layers = [keras.Input((workload.dims[0],))]
    layers += [keras.layers.Dense(width, activation="relu") for width in workload.dims[1:-1]]
    layers += [keras.layers.Dense(workload.dims[-1])]
    model = keras.Sequential(layers)
    model.compile(
        optimizer=keras.optimizers.Adam(workload.learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=steps_per_execution,
        jit_compile=True,
    )
    x, y = _common.host_arrays(batches, steps) if shuffled is None else shuffled
    if not host:
        x, y = jnp.asarray(x), jnp.asarray(y)
    epochs = steps * workload.batch_size // len(x)

    def run() -> None:
        # fit reads the epoch's logs back to the host at its end: the steps are done.
        model.fit(
            x,
            y,
            batch_size=workload.batch_size,
            epochs=epochs,
            shuffle=shuffled is not None,
            verbose=0,
        )

    run()  # compile
    return run, ""


# -- sections -----------------------------------------------------------------------------


def workload_section(name: str, args: argparse.Namespace, loopax_rows: bool, keras_rows: bool):
    """One interleaved comparison on one workload; returns its table rows."""
    import _common  # noqa: PLC0415
    import bench_nnx  # noqa: PLC0415

    workload = _common.WORKLOADS[name]
    steps = STEPS[name][args.quick]
    batches = _common.make_batches(workload)
    candidates: dict[str, Callable] = {REFERENCE: _common.hand_written(workload, batches, steps)}
    unavailable: dict[str, str] = {}
    directory = Path(tempfile.mkdtemp(prefix=f"loopax-bench-{name}-"))
    # Registered before the checkpoint hook's own atexit wait, so it runs after it.
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    if loopax_rows:
        candidates[REFERENCE_AVERAGE] = _common.hand_written(
            workload, batches, steps, moving_average=True
        )
        candidates[BARE] = _common.loopax_loop(workload, batches, steps)
        candidates[NOOP] = _common.loopax_loop(
            workload, batches, steps, attach=_common.noop_hooks(5)
        )
        candidates[bench_nnx.NNX_JIT] = bench_nnx.nnx_jit(workload, batches, steps)
        candidates[bench_nnx.NNX_LOOPAX] = bench_nnx.loopax_nnx(workload, batches, steps)
        readme_rows: list[tuple[str, dict, Any]] = [
            (README, {}, None),
            (FREQUENT_SAVES, {"every_n_steps": 1000}, None),
        ]
        if keras_rows:  # the README hooks fed from numpy, to pair with Keras fed numpy
            import loopax  # noqa: PLC0415

            x, y = _common.host_arrays(batches, steps)
            readme_rows.append(
                (
                    README_HOST,
                    {},
                    loopax.ArrayDataset(
                        x, y, workload.batch_size, shuffle=False, loop_forever=True
                    ),
                )
            )
        for row, kwargs, dataset in readme_rows:
            attach, why = _common.readme_hooks(directory / row.split()[-1], **kwargs)
            if attach is None:
                unavailable[row] = why
                continue
            captured: dict[str, Any] = {}

            def attach_and_keep(loop: Any, attach=attach, captured=captured) -> None:
                attach(loop)
                captured["loop"] = loop

            loop_run = _common.loopax_loop(
                workload, batches, steps, attach=attach_and_keep, dataset=dataset
            )
            candidates[row] = _common.split_end_of_run(loop_run, captured["loop"])
    if keras_rows:
        for row, spe, host in (
            (KERAS.format(1), 1, False),
            (KERAS.format(32), 32, False),
            (KERAS_HOST, 1, True),
        ):
            run, why = keras_fit(workload, batches, steps, spe, host)
            if run is None:
                unavailable[row] = why
            else:
                candidates[row] = run
    progress(
        f"{name}: {workload.description}; {steps} steps x {args.rounds} rounds, "
        f"{len(candidates)} candidates"
    )
    timings = _common.interleave(
        candidates, steps, args.rounds, WARMUP_ROUNDS[args.quick], on_round=round_progress(name)
    )
    rows = [(REFERENCE, timings.rate(REFERENCE), 1.0, 0.0)]
    for row in (
        REFERENCE_AVERAGE,
        BARE,
        NOOP,
        README,
        README + "whole",
        FREQUENT_SAVES,
        bench_nnx.NNX_JIT,
        bench_nnx.NNX_LOOPAX,
        KERAS.format(1),
        KERAS.format(32),
        README_HOST,
        KERAS_HOST,
    ):
        label = README_WHOLE if row == README + "whole" else row
        if row in timings.seconds:
            rows.append(
                (
                    label,
                    timings.rate(row),
                    timings.ratio(row, REFERENCE),
                    timings.spread(row, REFERENCE),
                )
            )
        elif row in unavailable:
            rows.append((label, unavailable[row]))
    # Issues 13 (tiny) and 12 (both) set targets between candidates other than the
    # reference; a pair with target None is printed without one.
    issue_13 = 0.97 if name == "tiny" else None
    pairs = []
    for label, own, other, target in (
        ("README hooks vs the bare Loop", README, BARE, issue_13),
        ("bare Loop vs hand-written with the same outputs", BARE, REFERENCE_AVERAGE, issue_13),
        (
            "NNX through loopax vs hand-written nnx.jit",
            bench_nnx.NNX_LOOPAX,
            bench_nnx.NNX_JIT,
            NNX_TARGET,
        ),
    ):
        if own in timings.seconds and other in timings.seconds:
            pairs.append((label, timings.ratio(own, other), timings.spread(own, other), target))
    versus_keras = []
    for label, own, keras in (
        ("device arrays", README, KERAS.format(1)),
        ("numpy arrays", README_HOST, KERAS_HOST),
    ):
        if own in timings.seconds and keras in timings.seconds:
            versus_keras.append((label, timings.ratio(own, keras), timings.spread(own, keras)))
    return {
        "title": f"{name}: {workload.description}, {steps} steps x {args.rounds} rounds",
        "rows": rows,
        "pairs": pairs,
        "readme_vs_keras": versus_keras,
        "readme_missing": unavailable.get(README),
    }


def devices_worker(args: argparse.Namespace) -> None:
    """In the 4-device subprocess: both workloads, data-parallel; prints JSON."""
    import _common  # noqa: PLC0415
    import jax  # noqa: PLC0415

    devices = jax.devices()[:DEVICE_COUNT]
    if len(devices) != DEVICE_COUNT:
        raise SystemExit(f"expected {DEVICE_COUNT} CPU devices, got {len(jax.devices())}")
    sharding = _common.batch_sharding(devices)
    sections = []
    for name in ("tiny", "medium"):
        workload = _common.WORKLOADS[name]
        steps = STEPS[f"devices-{name}"][args.quick]
        batches = _common.make_batches(workload, sharding=sharding)
        candidates = {
            DEVICE_REFERENCE: _common.hand_written_shard_map(workload, batches, steps, devices),
            SHARD_MAP: _common.loopax_loop(workload, batches, steps, devices=devices),
            PMAP: _common.loopax_loop(workload, batches, steps, devices=devices, parallel="pmap"),
        }
        progress(
            f"devices/{name}: {workload.description} on {DEVICE_COUNT} CPU devices; "
            f"{steps} steps x {args.rounds} rounds"
        )
        timings = _common.interleave(
            candidates,
            steps,
            args.rounds,
            WARMUP_ROUNDS[args.quick],
            on_round=round_progress(f"devices/{name}"),
        )
        rows = [
            (
                row,
                timings.rate(row),
                timings.ratio(row, DEVICE_REFERENCE),
                timings.spread(row, DEVICE_REFERENCE),
            )
            for row in candidates
        ]
        rows[0] = (DEVICE_REFERENCE, rows[0][1], 1.0, 0.0)
        sections.append(
            {
                "title": f"{DEVICE_COUNT} devices, {name}: {workload.description} (global batch), "
                f"{steps} steps x {args.rounds} rounds",
                "rows": rows,
            }
        )
    print("DEVICES-JSON " + json.dumps(sections), flush=True)


def devices_section(args: argparse.Namespace, worker: str = "--devices-worker") -> list[dict]:
    """Runs `worker` (a hidden flag of this script) in a subprocess with 4 CPU devices."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICE_COUNT}"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    command = [sys.executable, __file__, worker, "--rounds", str(args.rounds)]
    if args.quick:
        command.append("--quick")
    result = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True, check=False)
    for line in result.stdout.splitlines():
        if line.startswith("DEVICES-JSON "):
            return json.loads(line[len("DEVICES-JSON ") :])
    why = f"n/a (the {DEVICE_COUNT}-device subprocess failed with exit code {result.returncode})"
    return [{"title": f"{DEVICE_COUNT} devices", "rows": [(DEVICE_REFERENCE, why)]}]


def fused_pairs(timings: Any, reference: str, section: str, keras_row: str | None) -> list:
    """Issue 15's targets: the fused Loop against each baseline.

    The train_steps row stands in for the fused Loop until it exists.
    """
    import bench_fused  # noqa: PLC0415

    own = bench_fused.FUSED if bench_fused.FUSED in timings.seconds else bench_fused.TRAIN_STEPS
    name = "fused Loop" if own == bench_fused.FUSED else "train_steps (stand-in)"
    pairs = []
    # The last pair is the ceiling of the Keras target: the hand-written scan (the limit of
    # fusing, by the issue's own reckoning) against Keras; where it is near 1.5x, so is any
    # fused loop's.
    for mine, other, label, target in (
        (own, reference, f"{name} vs per-step hand-written", FUSED_TARGETS["per-step"][section]),
        (
            own,
            bench_fused.SCAN,
            f"{name} vs hand-written lax.scan",
            FUSED_TARGETS["scan"].get(section),
        ),
        (own, keras_row, f"{name} vs Keras fit, spe=32", FUSED_TARGETS["keras"]),
        (
            bench_fused.SCAN,
            keras_row,
            "hand-written lax.scan vs Keras fit, spe=32 (the ceiling)",
            None,
        ),
    ):
        if other in timings.seconds and mine in timings.seconds:
            pairs.append((label, timings.ratio(mine, other), timings.spread(mine, other), target))
    return pairs


def fused_rows(
    candidates: dict[str, Any], unavailable: dict[str, str], timings: Any, reference: str
) -> list:
    """The table rows of a fused comparison, in the candidates' order, reference first."""
    import bench_fused  # noqa: PLC0415

    rows = [(reference, timings.rate(reference), 1.0, 0.0)]
    order = [*candidates, *unavailable]
    if bench_fused.FUSED in order:  # its whole-run timing right under it
        order.insert(order.index(bench_fused.FUSED) + 1, bench_fused.FUSED + "whole")
    for row in order:
        label = bench_fused.FUSED_WHOLE if row == bench_fused.FUSED + "whole" else row
        if row == reference:
            continue
        if row in timings.seconds:
            rows.append(
                (
                    label,
                    timings.rate(row),
                    timings.ratio(row, reference),
                    timings.spread(row, reference),
                )
            )
        elif row in unavailable:
            rows.append((label, unavailable[row]))
    return rows


def fused_workload_section(name: str, args: argparse.Namespace) -> dict:
    """Issue 15 on one workload: the fused Loop, K=32, against per-step, scan and Keras loops."""
    import _common  # noqa: PLC0415
    import bench_fused  # noqa: PLC0415

    workload = _common.WORKLOADS[name]
    steps = STEPS[name][args.quick]
    batches = _common.make_batches(workload)
    directory = Path(tempfile.mkdtemp(prefix=f"loopax-bench-fused-{name}-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    candidates: dict[str, Callable] = {
        REFERENCE: _common.hand_written(workload, batches, steps),
        bench_fused.SCAN: bench_fused.hand_written_scan(workload, batches, steps),
    }
    unavailable: dict[str, str] = {}
    attach, why = _common.readme_hooks(directory)
    for row, hooks_of in ((bench_fused.FUSED, attach), (bench_fused.FUSED_BARE, None)):
        if row == bench_fused.FUSED and attach is None:
            unavailable[row] = why
            continue
        run, why_not = bench_fused.fused_loop(workload, batches, steps, attach=hooks_of)
        if run is None:
            unavailable[row] = why_not
        else:
            candidates[row] = run
    candidates[bench_fused.TRAIN_STEPS] = bench_fused.train_steps_direct(workload, batches, steps)
    keras_row = None
    if name == "tiny":
        keras_row = KERAS.format(bench_fused.K)
        run, why = keras_fit(workload, batches, steps, bench_fused.K)
        if run is None:
            unavailable[keras_row] = why
        else:
            candidates[keras_row] = run
    progress(
        f"fused/{name}: {workload.description}; {steps} steps x {args.rounds} rounds, "
        f"{len(candidates)} candidates"
    )
    timings = _common.interleave(
        candidates,
        steps,
        args.rounds,
        WARMUP_ROUNDS[args.quick],
        on_round=round_progress(f"fused/{name}"),
    )
    return {
        "title": f"fused, {name}: {workload.description}, {steps} steps x {args.rounds} rounds",
        "rows": fused_rows(candidates, unavailable, timings, REFERENCE),
        "pairs": fused_pairs(timings, REFERENCE, name, keras_row),
    }


def fused_compile_section(args: argparse.Namespace) -> dict:
    """Seconds compiling the K=32 program against the one-step program, fresh trainers."""
    import _common  # noqa: PLC0415
    import bench_fused  # noqa: PLC0415

    repeats = COMPILE_REPEATS[args.quick]
    progress(f"fused/compile: K=1 and K={bench_fused.K}, {repeats} fresh trainers each")
    rows: list[tuple] = []
    for name in ("tiny", "medium"):
        workload = _common.WORKLOADS[name]
        batches = _common.make_batches(workload)
        seconds, how = bench_fused.compile_seconds(workload, batches, (1, bench_fused.K), repeats)
        one, fused = seconds[1], seconds[bench_fused.K]
        rows.append(
            (
                f"{name}: K=1 / K={bench_fused.K}",
                f"{one:.2f} s / {fused:.2f} s  ({fused / one:.2f}x)",
            )
        )
    return {
        "title": f"fused, compile seconds (ExecInfo.compile_seconds via {how}; "
        f"median of {repeats} fresh trainers)",
        "rows": rows,
        "header": False,
    }


def fused_devices_worker(args: argparse.Namespace) -> None:
    """In the 4-device subprocess: the fused Loop against jit(shard_map), tiny; prints JSON."""
    import _common  # noqa: PLC0415
    import bench_fused  # noqa: PLC0415
    import jax  # noqa: PLC0415

    devices = jax.devices()[:DEVICE_COUNT]
    if len(devices) != DEVICE_COUNT:
        raise SystemExit(f"expected {DEVICE_COUNT} CPU devices, got {len(jax.devices())}")
    sharding = _common.batch_sharding(devices)
    workload = _common.TINY
    steps = STEPS["devices-tiny"][args.quick]
    batches = _common.make_batches(workload, sharding=sharding)
    directory = Path(tempfile.mkdtemp(prefix="loopax-bench-fused-devices-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    candidates: dict[str, Callable] = {
        DEVICE_REFERENCE: _common.hand_written_shard_map(workload, batches, steps, devices),
    }
    unavailable: dict[str, str] = {}
    attach, why = _common.readme_hooks(directory)
    run, why = (
        bench_fused.fused_loop(workload, batches, steps, attach=attach, devices=devices)
        if attach is not None
        else (None, why)
    )
    if run is None:
        unavailable[bench_fused.FUSED] = why
    else:
        candidates[bench_fused.FUSED] = run
    candidates[bench_fused.TRAIN_STEPS] = bench_fused.train_steps_direct(
        workload, batches, steps, devices=devices, sharding=sharding
    )
    progress(
        f"fused/devices: {workload.description} on {DEVICE_COUNT} CPU devices; "
        f"{steps} steps x {args.rounds} rounds"
    )
    timings = _common.interleave(
        candidates,
        steps,
        args.rounds,
        WARMUP_ROUNDS[args.quick],
        on_round=round_progress("fused/devices"),
    )
    section = {
        "title": f"fused, {DEVICE_COUNT} devices, tiny: {workload.description} (global batch), "
        f"{steps} steps x {args.rounds} rounds",
        "rows": fused_rows(candidates, unavailable, timings, DEVICE_REFERENCE),
        "pairs": fused_pairs(timings, DEVICE_REFERENCE, "devices", None),
    }
    print("DEVICES-JSON " + json.dumps([section]), flush=True)


def fused_section(args: argparse.Namespace) -> list[tuple[str, dict]]:
    sections = [
        (f"fused-{name}", fused_workload_section(name, args)) for name in ("tiny", "medium")
    ]
    sections += [
        ("fused-devices", section)
        for section in devices_section(args, worker="--fused-devices-worker")
    ]
    sections.append(("fused-compile", fused_compile_section(args)))
    return sections


def shuffled_section(args: argparse.Namespace) -> dict:
    """Issue 25 item 1: the fused Loop on shuffled on-device data against hand-written scans.

    On tiny, epochs of 512 steps: the reference is the hand-written scan that permutes each
    epoch on the device once and slices contiguous batches (the same batches as loopax's).
    """
    import _common  # noqa: PLC0415
    import bench_fused  # noqa: PLC0415

    workload = _common.TINY
    steps = STEPS["shuffled"][args.quick]
    arrays = bench_fused.shuffled_arrays(workload)
    directory = Path(tempfile.mkdtemp(prefix="loopax-bench-shuffled-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    reference = bench_fused.SHUFFLED_SCAN
    candidates: dict[str, Callable] = {
        reference: bench_fused.hand_written_shuffled_scan(workload, arrays, steps),
        bench_fused.PRESTACKED_SCAN: bench_fused.prestacked_scan(workload, arrays, steps),
    }
    rows = (
        (bench_fused.SHUFFLED, "copy", True),
        (bench_fused.SHUFFLED_BARE, None, True),
        (bench_fused.SHUFFLED_GATHER, "gather", False),
        (bench_fused.SHUFFLED_IN_ORDER, None, True, False),
    )
    fused, unavailable = bench_fused.shuffled_candidates(workload, arrays, steps, rows, directory)
    candidates.update(fused)
    keras_row = KERAS.format(bench_fused.K) + ", shuffle=True"
    run, why = keras_fit(workload, [], steps, bench_fused.K, shuffled=arrays)
    if run is None:
        unavailable[keras_row] = why
    else:
        candidates[keras_row] = run
    progress(
        f"shuffled: {workload.description}, epochs of {bench_fused.SHUFFLED_BATCHES} batches; "
        f"{steps} steps x {args.rounds} rounds, {len(candidates)} candidates"
    )
    timings = _common.interleave(
        candidates,
        steps,
        args.rounds,
        WARMUP_ROUNDS[args.quick],
        on_round=round_progress("shuffled"),
    )
    rows = [(reference, timings.rate(reference), 1.0, 0.0)]
    for row in [*candidates, *unavailable]:
        if row == reference:
            continue
        if row in timings.seconds:
            rate, spread = timings.rate(row), timings.spread(row, reference)
            rows.append((row, rate, timings.ratio(row, reference), spread))
            if row == bench_fused.SHUFFLED:  # its whole-run timing right under it
                whole = row + "whole"
                rows.append(
                    (
                        bench_fused.SHUFFLED_WHOLE,
                        timings.rate(whole),
                        timings.ratio(whole, reference),
                        timings.spread(whole, reference),
                    )
                )
        else:
            rows.append((row, unavailable[row]))
    own = bench_fused.SHUFFLED
    pairs = []
    for other, label, target in (
        (reference, "fused Loop vs hand-written scan, same batches", SHUFFLED_TARGETS["scan"]),
        (keras_row, "fused Loop vs Keras fit, spe=32, shuffled", SHUFFLED_TARGETS["keras"]),
        (bench_fused.PRESTACKED_SCAN, "fused Loop vs scan over pre-stacked batches", None),
        (bench_fused.SHUFFLED_GATHER, "shuffled copy vs rows gathered each step", None),
    ):
        if own in timings.seconds and other in timings.seconds:
            pairs.append((label, timings.ratio(own, other), timings.spread(own, other), target))
    # What shuffling itself costs the Loop: the bare Loop on the same arrays in order.
    bare, in_order = bench_fused.SHUFFLED_BARE, bench_fused.SHUFFLED_IN_ORDER
    if bare in timings.seconds and in_order in timings.seconds:
        label = "bare fused Loop, shuffled vs in order"
        pairs.append((label, timings.ratio(bare, in_order), timings.spread(bare, in_order), None))
    return {
        "title": f"shuffled, tiny: {workload.description}, reshuffled epochs of "
        f"{bench_fused.SHUFFLED_BATCHES} batches, {steps} steps x {args.rounds} rounds",
        "rows": rows,
        "pairs": pairs,
        "reference": reference,
    }


def accumulate_sections(args: argparse.Namespace) -> list[dict]:
    """Issue 14: gradient accumulation vs a hand-written scan step, bfloat16 vs float32."""
    import bench_accumulate  # noqa: PLC0415

    sections = []
    for name, compare in (
        ("accumulate", bench_accumulate.accumulate_comparison),
        ("precision", bench_accumulate.precision_comparison),
    ):
        progress(f"{name}: starting")
        section = compare(args.quick, args.rounds, on_round=round_progress(name))
        section["reference"] = section["rows"][0][0] if section["rows"] else None
        sections.append(section)
    return sections


# -- report -------------------------------------------------------------------------------


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def round_progress(name: str) -> Callable[[int], None]:
    return lambda index: progress(f"  {name}: round {index + 1} done")


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} cores"


def mark(passed: bool) -> str:
    return "PASS" if passed else "FAIL"


def target_of(section: str, label: str, ratio: float, spread: float, targets: dict) -> str:
    """The issue's target for this row, with the measured figure's pass/fail mark."""
    if label in targets:
        return f">= {targets[label]}  {mark(ratio >= targets[label])}"
    if label == README and section == "tiny":
        return f">= 0.95  {mark(ratio >= 0.95)}"
    if label == README and section == "medium":
        return f">= 0.99  {mark(ratio >= 0.99)}"
    if label == SHARD_MAP:
        tolerance = max(spread, 0.02)
        return f">= 1 within noise (±{tolerance:.3f})  {mark(ratio >= 1 - tolerance)}"
    return ""


def print_header(load_before: tuple, title: str = "loopax benchmark suite") -> None:
    import jax  # noqa: PLC0415

    print()
    print(title)
    print(f"date:     {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}")
    print(f"machine:  {machine()}")
    load_after = os.getloadavg()
    print(
        f"load:     {load_before[0]:.2f} at start, {load_after[0]:.2f} at end "
        "(1-minute load average; > cores means shared, noisy timings)"
    )
    print(
        f"versions: python {platform.python_version()}, jax {jax.__version__} "
        f"({jax.default_backend()}), flax {version('flax')}, optax {version('optax')}, "
        f"keras {version('keras')}, loopax {version('loopax')}"
    )
    print(
        "ratio:    steps/s relative to the section's reference (first row), median of paired "
        "per-round ratios, ± half their interquartile range"
    )


def print_section(key: str, section: dict) -> None:
    width = 48
    print()
    print(section["title"])
    unit = section.get("unit", "steps/s")
    reference = section.get("reference")
    if section.get("header", True):
        print(f"  {'':{width}} {unit:>9}  {'ratio':>13}  target")
    for row in section["rows"]:
        if len(row) == 2:
            print(f"  {row[0]:{width}} {'':>9}  {row[1]}")
            continue
        label, rate, ratio, spread = row
        ratio_text = (
            f"{ratio:.3f} ± {spread:.3f}"
            if label not in (REFERENCE, DEVICE_REFERENCE, reference)
            else "1 (reference)"
        )
        print(
            f"  {label:{width}} {rate:9.0f}  {ratio_text:>13}  "
            f"{target_of(key, label, ratio, spread, section.get('targets', {}))}"
        )
    for label, ratio, spread, target in section.get("pairs", ()):
        text = f"{ratio:.3f} ± {spread:.3f}"
        goal = f">= {target}  {mark(ratio >= target)}" if target is not None else ""
        print(f"  {label:{width}} {'':>9}  {text:>13}  {goal}")
    if key == "tiny":
        versus = section.get("readme_vs_keras")
        for fed, ratio, spread in versus or ():
            label = f"README hooks vs Keras fit, spe=1, {fed}"
            text = f"{ratio:.3f} ± {spread:.3f}"
            print(f"  {label:{width}} {'':>9}  {text:>13}  >= 2.5  {mark(ratio >= 2.5)}")
        if not versus:
            label = "README hooks vs Keras fit, spe=1"
            why = section.get("readme_missing") or "n/a (needs the README and Keras rows)"
            print(f"  {label:{width}} {'':>9}  {why}")


def print_table(sections: list[tuple[str, dict]], started: float, load_before: tuple) -> None:
    print_header(load_before)
    for key, section in sections:
        print_section(key, section)
    print()
    print(f"total time: {time.perf_counter() - started:.0f} s")


def unmeasured_rows(sections: list[tuple[str, dict]]) -> list[str]:
    return [
        f"{section['title']}: {row[0]}: {row[1]}"
        for _, section in sections
        for row in section["rows"]
        if len(row) == 2 and str(row[1]).startswith("n/a")
    ]


def device_main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """`--device`: the device benchmark (`bench_device.py`), each section printed when measured."""
    # This process and the ones it starts (digits, the LM's fresh compiles) share one GPU:
    # none takes 75% of its memory up front (JAX reads this when its backend starts).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import bench_device  # noqa: PLC0415
    import jax  # noqa: PLC0415

    only = set(bench_device.SECTIONS)
    if args.only is not None:
        only = {part.strip() for part in args.only.split(",") if part.strip()}
        unknown = only - set(bench_device.SECTIONS)
        if unknown or not only:
            parser.error(
                "with --device, --only takes a comma-separated subset of "
                f"{', '.join(bench_device.SECTIONS)}; got {args.only!r}"
            )
    started = time.perf_counter()
    load_before = os.getloadavg()
    size = bench_device.resolve_size(args.size)
    print_header(load_before, title="loopax device benchmark (run_all.py --device)")
    devices = jax.devices()
    print(
        f"device:   {bench_device.describe_device()}; size {size.name} "
        f"(--size {args.size}); the targets are the issue's, for an accelerator"
    )
    sys.stdout.flush()
    done: list[tuple[str, dict]] = []
    record = {
        "date": datetime.datetime.now().astimezone().isoformat(),
        "machine": machine(),
        "backend": jax.default_backend(),
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "jax": jax.__version__,
        "size": size.name,
        "sections": [],
    }

    def emit(key: str, section: dict) -> None:
        done.append((key, section))
        print_section(f"device-{key}", section)  # none of the CPU suite's targets
        sys.stdout.flush()
        if args.json:
            record["sections"].append({"key": key, **section})
            record["seconds"] = time.perf_counter() - started
            Path(args.json).write_text(json.dumps(record, indent=1, default=str) + "\n")

    bench_device.sections(args, only, emit, progress)
    print()
    print(
        f"total time: {time.perf_counter() - started:.0f} s (1-minute load at the end "
        f"{os.getloadavg()[0]:.2f})"
    )
    unmeasured = unmeasured_rows(done)
    if args.strict and unmeasured:
        sys.exit("rows not measured:\n  " + "\n  ".join(unmeasured))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a ~1-minute smoke run")
    parser.add_argument(
        "--only",
        default=None,
        help="comma-separated sections among tiny, medium, devices, keras, accumulate, fused, "
        "shuffled, fsdp, restart, runend, lm, ema (keras alone runs the Keras rows on both "
        "workloads; fused: issue 15's rows; shuffled: the fused Loop on reshuffled on-device "
        "data, issue 25; lm: the transformer LM of examples/transformer_lm.py). With "
        "--device: among tiny, fused, enqueue, sweep, digits, lm-compile, lm, first-step",
    )
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per comparison")
    parser.add_argument(
        "--strict",
        action="store_true",
        help="exit with status 1 if a row could not be measured (a worker failed, Keras "
        "missing): CI's smoke run",
    )
    parser.add_argument(
        "--device",
        action="store_true",
        help="the device benchmark (issue 33) on JAX's default backend (JAX_PLATFORMS is "
        "respected): loopax against hand-written loops, the digits main job, the transformer "
        "LM at --size; see bench_device.py",
    )
    parser.add_argument(
        "--size",
        choices=("auto", "small", "full"),
        default="auto",
        help="--device sizes: full (the issue's, for an accelerator), small (a CPU smoke run of "
        "a few minutes), auto (full on an accelerator, small on the CPU)",
    )
    parser.add_argument(
        "--json", default=None, help="--device: also write the sections measured so far here"
    )
    parser.add_argument("--devices-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fused-devices-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.quick = int(args.quick)
    if args.device:
        device_main(args, parser)
        return
    explicit_rounds = args.rounds
    if args.rounds is None:
        args.rounds = ROUNDS[args.quick]
    if args.devices_worker:
        devices_worker(args)
        return
    if args.fused_devices_worker:
        fused_devices_worker(args)
        return
    if args.only is None:
        args.only = ",".join(SECTIONS)
    only = {part.strip() for part in args.only.split(",") if part.strip()}
    unknown = only - set(SECTIONS)
    if unknown or not only:
        parser.error(
            f"--only takes a comma-separated subset of {', '.join(SECTIONS)}; got {args.only!r}"
        )
    started = time.perf_counter()
    load_before = os.getloadavg()
    workloads = [name for name in ("tiny", "medium") if name in only]
    loopax_rows = bool(workloads)
    keras_rows = "keras" in only
    if not workloads and keras_rows:
        workloads = ["tiny", "medium"]
    sections: list[tuple[str, dict]] = []
    for name in workloads:
        sections.append((name, workload_section(name, args, loopax_rows, keras_rows)))
    if "devices" in only:
        sections += [("devices", section) for section in devices_section(args)]
    if "accumulate" in only:
        sections += [("accumulate", section) for section in accumulate_sections(args)]
    if "fused" in only:
        sections += fused_section(args)
    if "shuffled" in only:
        sections.append(("shuffled", shuffled_section(args)))
    if "fsdp" in only:
        import bench_fsdp  # noqa: PLC0415

        sections += bench_fsdp.sections(args)
    if "restart" in only:
        import bench_restart  # noqa: PLC0415

        sections += bench_restart.sections(args)
    if "runend" in only:
        import bench_run_end  # noqa: PLC0415

        progress("runend: whole runs of 3000 tiny steps, README hooks against the bare Loop")
        section = bench_run_end.section(
            bool(args.quick), explicit_rounds, on_round=round_progress("runend")
        )
        sections.append(("runend", section))
    if "lm" in only:
        import bench_lm  # noqa: PLC0415

        progress("lm: starting")
        lm = bench_lm.sections(args.quick, args.rounds, on_round=round_progress("lm"))
        sections += [("lm", section) for section in lm]
    if "ema" in only:
        import bench_ema  # noqa: PLC0415

        progress("ema: starting")
        sections += bench_ema.sections(args, on_round=round_progress)
    print_table(sections, started, load_before)
    unmeasured = unmeasured_rows(sections)
    if args.strict and unmeasured:
        sys.exit("rows not measured:\n  " + "\n  ".join(unmeasured))


if __name__ == "__main__":
    main()
