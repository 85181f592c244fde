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

The shuffled case (issue 25; `run_all.py --only shuffled`) trains on shuffled rows, as every
user's data is: the fused Loop on an `ArrayDataset(..., on_device=True)` that reshuffles each
epoch (each group of K steps reads its rows by one gather per array, through the epoch's
permutation, on the devices), against the loop a user writes by hand for the same batches: each
epoch's permutation (the one the dataset draws) applied to the arrays on the device by one
gather, then `lax.scan`s of K steps slicing contiguous batches of the permuted arrays. Beside
them: the scan over those batches pre-stacked (no permutation in the timed loop: the ceiling),
the fused Loop with `shuffled_copy=False`, the bare fused Loop on the same on-device arrays in
order (`shuffle=False`: what shuffling itself costs the Loop is the gap to it), and Keras
`fit(shuffle=True, steps_per_execution=K)` on the same rows.

Until the fused Loop and `on_device=` exist, `fused_loop` answers why not and the
`train_steps` row stands in for it (see `FEATURES`).

Run: python benchmarks/bench_fused.py [--quick] [--rounds N]   (= run_all.py --only fused,shuffled)
"""

from __future__ import annotations

import inspect
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _common import (
    Batch,
    CyclingDataset,
    Run,
    Workload,
    _hand_written_step,
    host_arrays,
    loss_fn,
    readme_hooks,
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

# The shuffled case: an epoch of SHUFFLED_BATCHES batches (32768 examples on tiny, 8 MiB),
# drawn once from SHUFFLE_SEED, reshuffled every epoch.
SHUFFLED_BATCHES = 512
SHUFFLE_SEED = 0
SHUFFLED_SCAN = f"hand-written scan, K={K}, permuted per epoch"
SHUFFLED = f"loopax Loop, K={K}, README hooks, on-device"
SHUFFLED_WHOLE = "  same, whole run_steps (incl. end-of-run save)"
SHUFFLED_BARE = f"loopax Loop, K={K}, bare, on-device"
SHUFFLED_GATHER = f"loopax Loop, K={K}, README hooks, no shuffled copy"
SHUFFLED_IN_ORDER = f"loopax Loop, K={K}, bare, on-device, shuffle=False"
PRESTACKED_SCAN = f"hand-written scan, K={K}, pre-stacked batches"


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


def shuffled_candidates(
    workload: Workload,
    arrays: tuple[np.ndarray, np.ndarray],
    steps: int,
    rows: Sequence[tuple[str, str | None, bool] | tuple[str, str | None, bool, bool]],
    directory: Any,
) -> tuple[dict[str, Run], dict[str, str]]:
    """The fused Loop on reshuffled on-device data, one run per row, and the rows it can't run.

    Each row is `(name, hooks or None, shuffled_copy)`, or with a fourth item, `shuffle`
    (default True; False: the same arrays in order): with `hooks`, the README's hooks
    write under `directory / hooks`.
    """
    candidates: dict[str, Run] = {}
    unavailable: dict[str, str] = {}
    for row, hooked, shuffled_copy, *shuffle in rows:
        dataset = shuffled_dataset(workload, arrays, shuffled_copy, *shuffle)
        attach, why = readme_hooks(directory / hooked) if hooked else (None, "")
        if dataset is None or (hooked and attach is None):
            unavailable[row] = why or "n/a (not on this loopax: shuffled_copy=)"
            continue
        run, why = fused_loop(workload, [], steps, attach=attach, dataset=dataset)
        if run is None:
            unavailable[row] = why
        else:
            candidates[row] = run
    return candidates, unavailable


def fused_loop(
    workload: Workload,
    batches: Sequence[Batch],
    steps: int,
    attach: Callable[[Any], Any] | None = None,
    k: int = K,
    devices: Sequence[Any] | None = None,
    dataset: Any = None,
) -> tuple[Run | None, str]:
    """The fused Loop, `k` steps a dispatch, on `dataset` (default: `fused_dataset`).

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
    if dataset is None:
        dataset = fused_dataset(workload, batches, k, devices)
    loop.run_steps(dataset, k)  # compiles the k-step execution

    def run() -> None:
        metrics = loop.run_steps(dataset, steps)
        metrics["loss"].block_until_ready()

    if attach is None:
        return run, ""
    return split_end_of_run(run, loop), ""


def shuffled_arrays(workload: Workload) -> tuple[np.ndarray, np.ndarray]:
    """The shuffled case's rows on the host: `SHUFFLED_BATCHES` batches' worth, random."""
    rng = np.random.default_rng(SHUFFLE_SEED)
    examples = SHUFFLED_BATCHES * workload.batch_size
    x = rng.normal(size=(examples, workload.dims[0])).astype(np.float32)
    y = rng.integers(0, workload.num_classes, size=(examples,)).astype(np.int32)
    return x, y


def epoch_permutation(examples: int, epoch: int) -> np.ndarray:
    """Epoch `epoch`'s order, as `ArrayDataset(seed=SHUFFLE_SEED)` draws it: the same batches."""
    return np.random.default_rng((SHUFFLE_SEED, epoch)).permutation(examples)


def shuffled_dataset(
    workload: Workload,
    arrays: tuple[np.ndarray, np.ndarray],
    shuffled_copy: bool = True,
    shuffle: bool = True,
) -> Any:
    """The fused Loop's shuffled data: an on-device `ArrayDataset` reshuffled every epoch.

    With `shuffle=False`, the same arrays in order (every epoch the same batches): the
    Loop's cost without the shuffle's. None where this loopax has no `shuffled_copy=`
    (the fused Loop then gathers each step's rows, which the `shuffled_copy=False` row
    times).
    """
    accepts = "shuffled_copy" in inspect.signature(loopax.ArrayDataset.__init__).parameters
    if shuffled_copy and not accepts:
        return None
    options = {"shuffled_copy": False} if accepts and not shuffled_copy else {}
    x, y = arrays
    return loopax.ArrayDataset(
        x,
        y,
        workload.batch_size,
        shuffle=shuffle,
        seed=SHUFFLE_SEED,
        loop_forever=True,
        on_device=True,
        devices=jax.devices()[:1],
        **options,
    )


def hand_written_shuffled_scan(
    workload: Workload, arrays: tuple[np.ndarray, np.ndarray], steps: int, k: int = K
) -> Run:
    """`k` steps a dispatch on shuffled rows, as a user writes it over device data.

    At each epoch's start the epoch's permutation (`epoch_permutation`: the same batches as
    the loopax rows') goes to the device and one jitted gather permutes the arrays into a
    copy in that order; each dispatch is `jax.jit(lax.scan)` of `k` steps (`_common.hand_written`'s
    step, donated state) slicing `k` contiguous batches of the copy. It returns the k
    losses and never waits before the end of a round.
    """
    step, init = _hand_written_step(workload, None)
    batch, device = workload.batch_size, jax.devices()[0]
    examples = len(arrays[0])
    steps_per_epoch = examples // batch
    if steps_per_epoch % k or steps % k:
        raise ValueError(f"epochs of {steps_per_epoch} steps and {steps} steps need whole {k}s")
    xs, ys = jax.device_put(arrays, device)
    permute = jax.jit(lambda xs, ys, order: (xs[order], ys[order]))

    def steps_fn(state, xs, ys, offset):
        def one_step(state, index):
            at = offset + index * batch
            x = jax.lax.dynamic_slice_in_dim(xs, at, batch)
            return step(state, x, jax.lax.dynamic_slice_in_dim(ys, at, batch))

        return jax.lax.scan(one_step, state, jnp.arange(k))

    compiled = jax.jit(steps_fn, donate_argnums=0)
    state = init(xs[:batch])
    epoch, epoch_step = 0, 0
    shuffled: tuple = ()

    def call() -> jax.Array:
        nonlocal state, shuffled, epoch, epoch_step
        if epoch_step == 0:  # a new epoch: one gather of the whole epoch
            order = jax.device_put(epoch_permutation(examples, epoch), device)
            shuffled = permute(xs, ys, order)
        state, losses = compiled(state, *shuffled, np.int32(epoch_step * batch))
        epoch_step += k
        if epoch_step == steps_per_epoch:
            epoch, epoch_step = epoch + 1, 0
        return losses

    jax.block_until_ready(call())  # compile

    def run() -> None:
        losses = None
        for _ in range(steps // k):
            losses = call()
        jax.block_until_ready(losses)

    return run


def prestacked_scan(workload: Workload, arrays: tuple[np.ndarray, np.ndarray], steps: int) -> Run:
    """`hand_written_scan` over the first epoch's shuffled batches, stacked before the run.

    No permutation in the timed loop: the ceiling of any loop that reshuffles each epoch.
    """
    x, y = arrays
    order = epoch_permutation(len(x), 0)
    size = workload.batch_size
    batches = [
        (None, [x[order[start : start + size]]], [y[order[start : start + size]]])
        for start in range(0, len(x), size)
    ]
    return hand_written_scan(workload, batches, steps)


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
