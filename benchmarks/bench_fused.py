"""Fused execution (issue 15): K optimizer steps per dispatch, against the loops it replaces.

`loopax.Loop(trainer, steps_per_execution=K)` runs K steps as one compiled `lax.scan` (hooks
still step-exact) and `ArrayDataset(..., on_device=True)` keeps the data on the devices: the
fused scan takes each step's batch from those arrays itself. This module builds the
candidates that `run_all.py --only fused` times side by side:

- the fused Loop, K=32, with the README's hooks, reading an on-device `ArrayDataset`;
- a hand-written `lax.scan` of K steps per dispatch (same network, optimizer and donated state
  as `_common.hand_written`) over device-resident, pre-stacked `(K, batch, ...)` data: the
  best a user can write by hand, and so the fused Loop's ceiling;
- `trainer.train_steps` called directly on the same pre-stacked data (no Loop, no hooks,
  no dataset): what the Loop's fusion costs on top of the compiled scan;
- the compile seconds of K=32 against K=1 (`trainer.on_exec_creation`'s
  `ExecInfo.compile_seconds`).

Until the fused Loop and `on_device=` exist, `fused_loop` answers why not and the
`train_steps` row stands in for it (see `FEATURES`).

Run: python benchmarks/bench_fused.py [--quick] [--rounds N]   (= run_all.py --only fused)
"""

from __future__ import annotations

import inspect
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from _common import (
    Batch,
    CyclingDataset,
    Run,
    Workload,
    _hand_written_step,
    host_arrays,
    loss_fn,
    split_end_of_run,
)

import loopax

K = 32  # steps per execution, on every fused candidate

SCAN = f"hand-written lax.scan, {K} steps a dispatch"
TRAIN_STEPS = f"loopax trainer.train_steps, K={K}, no Loop"


def _features() -> dict[str, bool]:
    def accepts(fn: Callable, name: str) -> bool:
        return name in inspect.signature(fn).parameters

    return {
        "steps_per_execution": accepts(loopax.Loop.__init__, "steps_per_execution"),
        "on_device": accepts(loopax.ArrayDataset.__init__, "on_device"),
    }


FEATURES = _features()
# Without `on_device=`, the fused Loop reads the device-resident batches one by one and
# stacks each group's on the device (`_common.CyclingDataset`); the rows say which.
DATA = "on-device data" if FEATURES["on_device"] else "device batches"
FUSED = f"loopax Loop, K={K}, README hooks, {DATA}"
FUSED_WHOLE = "  same, whole run_steps (incl. end-of-run save)"
FUSED_BARE = f"loopax Loop, K={K}, bare, {DATA}"


def fused_dataset(
    workload: Workload, batches: Sequence[Batch], k: int, devices: Sequence[Any] | None = None
) -> Any:
    """The fused Loop's data: an on-device `ArrayDataset` of 2k cycled batches.

    It loops over them in order, so executions also cross its epoch boundary. It is held
    on the trainer's `devices` (default: the first device, as `_trainer`'s). Without
    `on_device=`: the device-resident batches themselves, cycled.
    """
    if not FEATURES["on_device"]:
        return CyclingDataset(batches)
    x, y = host_arrays(batches, 2 * k)
    return loopax.ArrayDataset(
        x,
        y,
        workload.batch_size,
        shuffle=False,
        loop_forever=True,
        on_device=True,
        devices=list(devices) if devices is not None else jax.devices()[:1],
    )


def stacked_chunks(
    batches: Sequence[Batch], k: int, sharding: Any = None
) -> list[tuple[jax.Array, jax.Array]]:
    """The cycled batches as device-resident chunks of `k` stacked steps, `(k, batch, ...)`.

    As many chunks as one cycle through both the batches and the chunks takes (one for 16
    batches and k=32), placed once, up front; `sharding` (a batch-axis sharding) places each
    chunk's batch axis (axis 1) the same way.
    """
    count = math.lcm(len(batches), k) // k
    chunks = []
    for chunk in range(count):
        order = [batches[(chunk * k + i) % len(batches)] for i in range(k)]
        xs = np.stack([np.asarray(batch[1][0]) for batch in order])
        ys = np.stack([np.asarray(batch[2][0]) for batch in order])
        where = jax.devices()[0]
        if sharding is not None:
            from jax.sharding import NamedSharding, PartitionSpec  # noqa: PLC0415

            where = NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))
        chunks.append((jax.device_put(xs, where), jax.device_put(ys, where)))
    return chunks


def _cycle_chunks(call: Callable, chunks: list, steps: int, k: int) -> Run:
    """Times `steps // k` calls of `call(xs, ys) -> something to wait for` over the chunks."""
    if steps % k:
        raise ValueError(f"{steps} steps is not a whole number of {k}-step executions")
    jax.block_until_ready(call(*chunks[0]))  # compile

    def run() -> None:
        out = None
        for index in range(steps // k):
            out = call(*chunks[index % len(chunks)])
        jax.block_until_ready(out)

    return run


def hand_written_scan(workload: Workload, batches: Sequence[Batch], steps: int, k: int = K) -> Run:
    """`k` steps a dispatch as a user writes them: `jax.jit(lax.scan(step))`, donated state.

    The step is `_common.hand_written`'s (same network, adam, mean cross-entropy); the data
    is pre-stacked on the device (`stacked_chunks`), so a dispatch gathers nothing. It
    returns the k losses (as the fused Loop returns every step's metrics) and never waits
    before the end of a round.
    """
    step, init = _hand_written_step(workload, None)

    def steps_fn(state, xs, ys):
        return jax.lax.scan(lambda state, xy: step(state, *xy), state, (xs, ys))

    compiled = jax.jit(steps_fn, donate_argnums=0)
    chunks = stacked_chunks(batches, k)
    state = init(chunks[0][0][0])

    def call(xs, ys):
        nonlocal state
        state, losses = compiled(state, xs, ys)
        return losses

    return _cycle_chunks(call, chunks, steps, k)


def _trainer(workload: Workload, devices: Sequence[Any] | None) -> loopax.Trainer:
    return loopax.Trainer(
        workload.model_fn,
        loss_fn,
        workload.optimizer(),
        devices=list(devices) if devices is not None else jax.devices()[:1],
        parallel="shard_map",
    )


def train_steps_direct(
    workload: Workload,
    batches: Sequence[Batch],
    steps: int,
    k: int = K,
    devices: Sequence[Any] | None = None,
    sharding: Any = None,
) -> Run:
    """`trainer.train_steps(None, xs, ys)` on the pre-stacked chunks: loopax's scan alone."""
    trainer = _trainer(workload, devices)
    chunks = stacked_chunks(batches, k, sharding)

    def call(xs, ys):
        return trainer.train_steps(None, [xs], [ys])[1]["loss"]

    return _cycle_chunks(call, chunks, steps, k)


def fused_loop(
    workload: Workload,
    batches: Sequence[Batch],
    steps: int,
    attach: Callable[[Any], Any] | None = None,
    k: int = K,
    devices: Sequence[Any] | None = None,
) -> tuple[Run | None, str]:
    """The fused Loop, `k` steps a dispatch, on `fused_dataset`.

    With `attach` (the README's hooks), a round is timed up to the first OnEnd hook and
    whole, as the README-hooks rows of `run_all.py` are. Returns the run, or None and why
    it cannot run.
    """
    if not FEATURES["steps_per_execution"]:
        return None, "n/a (not on this loopax yet: Loop(steps_per_execution=))"
    if steps % k:
        raise ValueError(f"{steps} steps is not a whole number of {k}-step executions")
    loop = loopax.Loop(_trainer(workload, devices), steps_per_execution=k)
    if attach is not None:
        attach(loop)
    dataset = fused_dataset(workload, batches, k, devices)
    loop.run_steps(dataset, k)  # compiles the k-step execution

    def run() -> None:
        metrics = loop.run_steps(dataset, steps)
        metrics["loss"].block_until_ready()

    if attach is None:
        return run, ""
    return split_end_of_run(run, loop), ""


def compile_seconds(
    workload: Workload, batches: Sequence[Batch], ks: Sequence[int], repeats: int
) -> tuple[dict[int, float], str]:
    """Median over `repeats` fresh trainers of the seconds compiling each `k`-step program.

    Read from `trainer.on_exec_creation` (`ExecInfo.compile_seconds`: tracing, lowering and
    compiling; the state's initialization is not in it). Through the fused Loop when it
    exists (its first `run_steps` of k steps, on the timed rows' `fused_dataset`), else
    `train_step` (k=1) / `train_steps`. The ks alternate within a repeat, after one untimed
    repeat (the process's first compilation pays for warming JAX up). Returns
    `{k: seconds}` and how they were taken.
    """
    fused = FEATURES["steps_per_execution"]

    def seconds(k: int) -> float:
        trainer = _trainer(workload, None)
        infos: list = []
        trainer.on_exec_creation(infos.append)
        if fused:  # the timed rows' data: an on-device gather is part of the program
            dataset = fused_dataset(workload, batches, k)
            loopax.Loop(trainer, steps_per_execution=k).run_steps(dataset, k)
        elif k == 1:
            _, inputs, labels = batches[0]
            trainer.train_step(None, inputs, labels)
        else:
            xs, ys = stacked_chunks(batches, k)[0]
            trainer.train_steps(None, [xs], [ys])
        # A fresh trainer running k steps compiles its training program(s) only.
        return sum(info.compile_seconds for info in infos)

    samples: dict[int, list[float]] = {k: [] for k in ks}
    for repeat in range(-1, repeats):
        for k in ks:
            taken = seconds(k)
            if repeat >= 0:
                samples[k].append(taken)
    how = "Loop(steps_per_execution=k).run_steps" if fused else "train_step / train_steps"
    return {k: statistics.median(taken) for k, taken in samples.items()}, how


if __name__ == "__main__":
    import run_all

    sys.argv[1:1] = ["--only", "fused"]
    run_all.main()
