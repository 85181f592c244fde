"""The device benchmark (issue 33): loopax against hand-written loops on whatever backend JAX has.

`python benchmarks/run_all.py --device` runs it on JAX's default backend (`JAX_PLATFORMS` is
respected): a GPU or TPU when there is one, else the CPU. `--size full` is the size the issue
asks for on an accelerator, `--size small` a smoke run that finishes in a few minutes on
2 CPU cores; `--size auto` (the default) takes `full` on an accelerator and `small` on the
CPU. `benchmarks/device_run.sh OUTDIR` runs it (and the accelerator-safe tests) in one go on
a GPU machine. Sections, in the order they run (each printed as soon as it is measured, so
a run stopped at its time limit keeps what it measured):

- tiny: the MLP 64-128-10, batch 64, adam, per step: a hand-written `jax.jit` step with
  donated state over device batches (the reference), the same step also keeping the loss's
  moving average (what loopax's step computes), loopax's bare Loop and the Loop with the
  README's hooks (progress bar, TensorBoard, checkpoint every 60 s).
- fused: the same network, K=32 steps a dispatch: the hand-written `lax.scan` of 32 over
  pre-stacked device batches (the reference), loopax's fused Loop reading an on-device
  `ArrayDataset` that reshuffles every epoch (bare and with the README hooks), and the
  per-step hand-written step (what fusing gains).
- enqueue: recommendation 7 of `gpu-notes.md`: N steps dispatched without waiting, then
  `block_until_ready`. The steps still queued when the host is done (the wait, in
  dispatches) classify the loop: about 1 means the device waited for the host (host-bound:
  every microsecond of Python or kernel launching counts), many (up to the backend's
  in-flight cap, 32 on XLA:GPU) means the host waited for the device (device-bound).
  loopax's `run_steps` waits for its last steps itself (it checks their losses), so its row
  gives the wall time only.
- sweep: recommendations 8, 9 and 11 of `gpu-notes.md` (`bench_sweep.py`): the tiny
  per-step workloads (hand-written, hand-written keeping the loss's moving average, the bare
  Loop) and the fused pair (loopax K=32 against the hand-written scan of 32), each set of XLA
  flags in a fresh process: the default (and 8, 16, 64 cycled batches), command buffers off,
  regions of any size graphed, a trace cache of 64, the fused loop graphed; with each variant's
  command-buffer updates per step and thunk kinds on a GPU; a verdict per workload. A fixed
  share of the run (90 s at `full`).
- digits: `examples/digits.py` as README command 1 runs it (fresh run directory and
  compilation cache): its own throughput line (examples/s), wall seconds, time to first
  step and test accuracy.
- lm-compile: the transformer LM of `examples/transformer_lm.py` at `--size` (full: 6 layers,
  width 1024, 16 heads, context 512, batch 32); every variant in a fresh process, so no
  variant reuses another's compilations or autotuning results: the seconds a 45-step run
  waited for compiling, the time to its first dispatch's loss (from before the state and
  programs are built, and from the process's launch), peak host memory. Each worker keeps
  its programs in a cache of its own; the lm section loads them from there.
- lm: tokens/s side by side, against the hand-written `jax.jit` step: the hand-written scan
  of 8, loopax per step and fused K=8 (on-device data), bfloat16 on both sides. Then the MFU
  `hooks.throughput` reports for loopax's bfloat16 step beside the analytic figure
  `6 * params * tokens/s / peak` over the same run (peak: the one `hooks.throughput` knows for
  the device kind; a nominal 1 TFLOP/s where it knows none, e.g. on a CPU), and how many
  FLOPs XLA's cost analysis counts against the analytic `6 * params * tokens` a step.
- first-step: time to first step of a fused run (K=8 and K=32) against a per-step run's
  (issue 33 item 4, target <= 1.2x), the tiny MLP on on-device data, a 256-step run with a
  hook every 100 steps; every run a fresh process with the compilation caches off, rounds
  rotated; beside each, the programs compiled before its first step and in the whole run
  (`bench_first_step.py`). It runs last, taking no time from the sections above within
  `device_run.sh`'s budget; `DEVICE_RUN_ARGS="--only first-step"` runs it alone.

Hygiene (recommendations 7 and 11 of `gpu-notes.md`): candidates run side by side in
rounds whose order rotates (ratios are medians of per-round ratios); every program runs in
untimed warm-up rounds after the last compilation (each at least 3 times) and the timed
rounds count the programs built during them (a new executable evicts the others' CUDA
graphs on XLA:GPU: the count should be 0); the tiny sections cycle 16 device batches (the
size of XLA:GPU's command-buffer trace cache), printed in each title.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common
import bench_first_step
import bench_fused
import bench_lm
import bench_sweep
import jax
import jax.numpy as jnp

import loopax
from loopax import hooks
from loopax.testing import count_compilations

DIGITS = Path(__file__).resolve().parent.parent / "examples" / "digits.py"
BATCHES = 16  # cycled device batches (XLA:GPU's command-buffer trace cache holds 16)
XLA_CACHES = "none"  # jax_persistent_cache_enable_xla_caches; see start_cache
NOMINAL_PEAK = 1e12  # FLOP/s, for MFU where hooks.throughput knows no peak
SECTIONS = ("tiny", "fused", "enqueue", "sweep", "digits", "lm-compile", "lm", "first-step")


@dataclasses.dataclass(frozen=True)
class Size:
    """How much each section runs: steps per round, rounds, the LM's shape."""

    name: str
    tiny_steps: int  # per round, tiny and fused (a multiple of 32 and of the 512-step epoch)
    rounds: int
    warmup_rounds: int
    enqueue_steps: int
    digits_steps: int | None  # None: the README's 2000
    lm: bench_lm.Shape
    lm_steps: int  # per round, a multiple of bench_lm.K
    mfu_window: int  # steps between hooks.throughput's logs (well over the 32 in flight)
    worker_timeout: float  # seconds, each fresh LM process
    compile_kinds: tuple[str, ...]  # the LM variants compiled in fresh processes
    first_step_rounds: int  # fresh processes per candidate in the first-step section


SIZES = {
    "full": Size(
        "full",
        tiny_steps=2048,
        rounds=5,
        warmup_rounds=1,
        enqueue_steps=2000,
        digits_steps=None,
        lm=bench_lm.Shape(layers=6, width=1024, heads=16, context=512, batch=32),
        lm_steps=16,
        mfu_window=128,
        worker_timeout=90,
        compile_kinds=tuple(bench_lm.COMPILE_CANDIDATES_BF16.values()),
        first_step_rounds=2,
    ),
    "small": Size(
        "small",
        tiny_steps=512,
        rounds=3,
        warmup_rounds=1,
        enqueue_steps=512,
        digits_steps=200,
        lm=bench_lm.Shape(layers=1, width=32, heads=2, context=32, batch=8),
        lm_steps=16,
        mfu_window=64,
        worker_timeout=120,
        compile_kinds=("hand", "loopax", "fused"),  # the other three share their code
        first_step_rounds=3,
    ),
}

# Row names.
REFERENCE = "hand-written jit step, donated, device batches"
REFERENCE_AVERAGE = "  same + the loss's moving average (as loopax)"
BARE = "loopax Loop, bare"
README = "loopax Loop + README hooks"
README_WHOLE = "  same, whole run_steps (incl. end-of-run save)"
PER_STEP = "hand-written jit step, per step"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # jax.monitoring: a program loaded

# The targets (measured on an accelerator; on a CPU they are printed as they fall).
TARGETS = {
    "bare_vs_average": 0.95,
    "bare_vs_plain": 0.85,
    "readme_vs_bare": 0.95,
    "fused_vs_scan": 0.9,
    "lm_per_step": 0.98,
    "lm_bf16": 0.98,
    "lm_fused_vs_scan": 1.0,
    "mfu": 0.10,  # within 10% of the analytic figure
    "first_step": 1.2,  # fused time to first step <= 1.2x the per-step run's
}


def resolve_size(name: str) -> Size:
    """`auto`: `full` on an accelerator, `small` on the CPU."""
    if name == "auto":
        name = "small" if jax.default_backend() == "cpu" else "full"
    return SIZES[name]


def describe_device() -> str:
    devices = jax.devices()
    return f"{jax.default_backend()}: {len(devices)} x {devices[0].device_kind}"


def start_cache() -> Path:
    """A fresh persistent compilation cache for this run (the LM workers' programs land in it).

    Set before anything compiles, so loopax leaves it as it is (and the user's own cache is
    neither read nor filled by the benchmark). XLA's own caches stay out of it (`XLA_CACHES`):
    by default JAX passes XLA a per-fusion autotuning cache inside the cache directory, and
    that path is part of every program's cache key, so the workers' programs (each worker
    has a directory of its own) would never be found here.
    """
    directory = Path(tempfile.mkdtemp(prefix="loopax-device-cache-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", str(directory / "run"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_enable_xla_caches", XLA_CACHES)
    return directory


# -- timing with the hygiene ----------------------------------------------------------------


def timed_rounds(
    candidates: dict[str, Callable],
    steps: int,
    rounds: int,
    warmup: int,
    on_round: Callable[[int], None] | None,
) -> tuple[_common.Timings, list[str]]:
    """Untimed warm-up rounds, then `rounds` timed ones; the names of programs built in them."""
    if warmup:
        _common.interleave(candidates, steps, warmup, warmup=0)
    with count_compilations() as built:
        timings = _common.interleave(candidates, steps, rounds, warmup=0, on_round=on_round)
    return timings, built.names


def hygiene_row(built: list[str]) -> tuple[str, str]:
    if not built:
        return ("programs built during the timed rounds", "0 (as it should be)")
    names = ", ".join(sorted(set(built)))
    return (
        "programs built during the timed rounds",
        f"{len(built)}: {names} (each evicts the others' CUDA graphs on a GPU)",
    )


def ratio_rows(timings: _common.Timings, reference: str, names: list[str], unit_scale=1.0):
    rows = [(reference, timings.rate(reference) * unit_scale, 1.0, 0.0)]
    for name in names:
        if name == reference or name not in timings.seconds:
            continue
        rows.append(
            (
                name,
                timings.rate(name) * unit_scale,
                timings.ratio(name, reference),
                timings.spread(name, reference),
            )
        )
    return rows


def pair(timings: _common.Timings, label: str, own: str, other: str, target: float | None):
    if own in timings.seconds and other in timings.seconds:
        return [(label, timings.ratio(own, other), timings.spread(own, other), target)]
    return []


def readme_loop(
    run_directory: Path, steps: int, batches: list, workload: _common.Workload
) -> tuple[Callable | None, str]:
    """The Loop with the README's hooks, timed up to its first OnEnd hook and whole."""
    attach, why = _common.readme_hooks(run_directory)
    if attach is None:
        return None, why
    captured: dict[str, Any] = {}

    def attach_and_keep(loop: Any) -> None:
        attach(loop)
        captured["loop"] = loop

    run = _common.loopax_loop(workload, batches, steps, attach=attach_and_keep)
    return _common.split_end_of_run(run, captured["loop"]), ""


# -- sections -------------------------------------------------------------------------------


def tiny_section(size: Size, rounds: int, directory: Path, on_round) -> dict:
    workload = _common.TINY
    steps = size.tiny_steps
    batches = _common.make_batches(workload, count=BATCHES)
    candidates: dict[str, Callable] = {
        REFERENCE: _common.hand_written(workload, batches, steps),
        REFERENCE_AVERAGE: _common.hand_written(workload, batches, steps, moving_average=True),
        BARE: _common.loopax_loop(workload, batches, steps),
    }
    run, why = readme_loop(directory / "tiny", steps, batches, workload)
    if run is not None:
        candidates[README] = run
    timings, built = timed_rounds(candidates, steps, rounds, size.warmup_rounds, on_round)
    rows: list[tuple] = ratio_rows(timings, REFERENCE, [REFERENCE_AVERAGE, BARE, README])
    if README + "whole" in timings.seconds:
        whole = README + "whole"
        rows.append(
            (
                README_WHOLE,
                timings.rate(whole),
                timings.ratio(whole, REFERENCE),
                timings.spread(whole, REFERENCE),
            )
        )
    if run is None:
        rows.append((README, why))
    rows.append(hygiene_row(built))
    pairs = [
        *pair(
            timings,
            "bare Loop vs hand-written, same outputs",
            BARE,
            REFERENCE_AVERAGE,
            TARGETS["bare_vs_average"],
        ),
        *pair(timings, "bare Loop vs hand-written", BARE, REFERENCE, TARGETS["bare_vs_plain"]),
        *pair(timings, "README hooks vs bare Loop", README, BARE, TARGETS["readme_vs_bare"]),
    ]
    return {
        "title": f"device tiny: {workload.description}; {steps} steps x {rounds} rounds, "
        f"{BATCHES} cycled device batches",
        "rows": rows,
        "pairs": pairs,
        "reference": REFERENCE,
    }


def fused_section(size: Size, rounds: int, directory: Path, on_round) -> dict:
    workload = _common.TINY
    steps = size.tiny_steps
    arrays = bench_fused.shuffled_arrays(workload)
    batches = _common.make_batches(workload, count=BATCHES)
    reference = bench_fused.PRESTACKED_SCAN
    candidates: dict[str, Callable] = {
        reference: bench_fused.prestacked_scan(workload, arrays, steps),
        PER_STEP: _common.hand_written(workload, batches, steps),
    }
    rows = ((bench_fused.SHUFFLED_BARE, None, True), (bench_fused.SHUFFLED, "fused-hooks", True))
    fused, unavailable = bench_fused.shuffled_candidates(workload, arrays, steps, rows, directory)
    candidates.update(fused)
    timings, built = timed_rounds(candidates, steps, rounds, size.warmup_rounds, on_round)
    rows: list[tuple] = ratio_rows(timings, reference, list(candidates))
    rows += [(row, why) for row, why in unavailable.items()]
    rows.append(hygiene_row(built))
    bare, hooked = bench_fused.SHUFFLED_BARE, bench_fused.SHUFFLED
    pairs = [
        *pair(
            timings,
            "fused Loop (bare) vs hand-written scan",
            bare,
            reference,
            TARGETS["fused_vs_scan"],
        ),
        *pair(timings, "fused Loop (README hooks) vs hand-written scan", hooked, reference, None),
        *pair(timings, "hand-written scan vs per-step jit", reference, PER_STEP, None),
        *pair(timings, "fused Loop (bare) vs per-step jit", bare, PER_STEP, None),
    ]
    return {
        "title": f"device fused: {workload.description}, K={bench_fused.K}, on-device data "
        f"reshuffled every epoch of {bench_fused.SHUFFLED_BATCHES} batches (the scan: the "
        f"first epoch's batches pre-stacked); {steps} steps x {rounds} rounds",
        "rows": rows,
        "pairs": pairs,
        "reference": reference,
    }


def _enqueue_wall(call: Callable[[int], Any], calls: int, repeats: int = 3) -> tuple[float, float]:
    """Median seconds to dispatch `calls` calls without waiting, and until the last is done."""
    jax.block_until_ready(call(0))  # compiled and run once more before timing
    enqueued, walls = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        out = None
        for index in range(calls):
            out = call(index)
        dispatched = time.perf_counter()
        jax.block_until_ready(out)
        done = time.perf_counter()
        enqueued.append(dispatched - started)
        walls.append(done - started)
    return statistics.median(enqueued), statistics.median(walls)


def classify(enqueue: float, wall: float, calls: int) -> tuple[float, str]:
    """Dispatches still queued when the host finished, and what that says."""
    per_call = wall / calls
    queued = (wall - enqueue) / per_call
    if queued < 2:
        verdict = "host-bound (the device waits for the host)"
    elif queued >= 8:
        verdict = "device-bound (the host waits for the device)"
    else:
        verdict = "mixed"
    return queued, verdict


def enqueue_section(size: Size) -> dict:
    workload = _common.TINY
    steps = size.enqueue_steps
    batches = _common.make_batches(workload, count=BATCHES)
    rows: list[tuple] = []
    for label, average in ((REFERENCE, False), (REFERENCE_AVERAGE.strip(), True)):
        step, init = _common._hand_written_step(workload, None, moving_average=average)
        stepping = jax.jit(step, donate_argnums=0)
        state = init(batches[0][1][0])

        def call(index: int, stepping=stepping) -> Any:
            nonlocal state
            _, inputs, labels = batches[index % len(batches)]
            state, out = stepping(state, inputs[0], labels[0])
            return out

        enqueue, wall = _enqueue_wall(call, steps)
        queued, verdict = classify(enqueue, wall, steps)
        rows.append(
            (
                label,
                f"enqueue {enqueue / steps * 1e6:.1f} µs/step, wall {wall / steps * 1e6:.1f} "
                f"µs/step, {queued:.1f} dispatches queued at the end: {verdict}",
            )
        )
    k = bench_fused.K
    step, init = _common._hand_written_step(workload, None)
    scan = jax.jit(
        lambda s, xs, ys: jax.lax.scan(lambda s, xy: step(s, *xy), s, (xs, ys)), donate_argnums=0
    )
    chunks = bench_fused.stacked_chunks(batches, k)
    scan_state = init(chunks[0][0][0])

    def scan_call(index: int) -> Any:
        nonlocal scan_state
        scan_state, losses = scan(scan_state, *chunks[index % len(chunks)])
        return losses

    calls = max(1, steps // k)
    enqueue, wall = _enqueue_wall(scan_call, calls)
    queued, verdict = classify(enqueue, wall, calls)
    rows.append(
        (
            bench_fused.SCAN,
            f"enqueue {enqueue / (calls * k) * 1e6:.1f} µs/step, wall "
            f"{wall / (calls * k) * 1e6:.1f} µs/step, {queued:.1f} dispatches queued at the "
            f"end: {verdict}",
        )
    )
    run = _common.loopax_loop(workload, batches, steps)
    walls = [_common.timed(run) for _ in range(3)]
    rows.append(
        (
            BARE,
            f"wall {statistics.median(walls) / steps * 1e6:.1f} µs/step (run_steps waits for "
            "its last steps: no separate enqueue time)",
        )
    )
    return {
        "title": f"device enqueue vs wall (gpu-notes recommendation 7): {workload.description}, "
        f"{steps} steps, {BATCHES} cycled device batches, median of 3",
        "rows": rows,
        "header": False,
    }


THROUGHPUT_LINE = re.compile(r"throughput: ([0-9,]+) examples/s")
FIRST_STEP_LINE = re.compile(r"first step ([0-9.]+) s after start \(([0-9.]+) s of it compiling\)")
ACCURACY_LINE = re.compile(r"test accuracy: ([0-9.]+)")


def digits_section(size: Size, directory: Path) -> dict:
    """README command 1, `python examples/digits.py`, in a fresh process, directory and cache."""
    command = [sys.executable, str(DIGITS), "--dir", str(directory / "digits")]
    if size.digits_steps is not None:
        command += ["--steps", str(size.digits_steps)]
    env = dict(os.environ, XDG_CACHE_HOME=str(directory / "digits-cache"))
    for variable in ("LOOPAX_COMPILATION_CACHE", "JAX_COMPILATION_CACHE_DIR"):
        env.pop(variable, None)  # as a user runs it: loopax's default cache, fresh here
    started = time.perf_counter()
    try:
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, check=False, timeout=300
        )
    except subprocess.TimeoutExpired:
        return {
            "title": "device digits (README command 1)",
            "rows": [("examples/digits.py", "n/a (timed out after 300 s)")],
            "header": False,
        }
    wall = time.perf_counter() - started
    steps = size.digits_steps or 2000
    title = f"device digits: python examples/digits.py (README command 1, {steps} steps)"
    found = THROUGHPUT_LINE.search(done.stdout)
    if done.returncode != 0 or found is None:
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        why = f"n/a (exit code {done.returncode}; {' | '.join(tail)[:300]})"
        return {"title": title, "rows": [("examples/digits.py", why)], "header": False}
    first = FIRST_STEP_LINE.search(done.stdout)
    accuracy = ACCURACY_LINE.search(done.stdout)
    rows = [
        ("examples/s (its own throughput line)", found.group(1)),
        ("wall seconds (process start to exit)", f"{wall:.1f}"),
    ]
    if first is not None:
        rows.append(
            ("first step after start", f"{first.group(1)} s ({first.group(2)} s compiling)")
        )
    if accuracy is not None:
        rows.append(("test accuracy", accuracy.group(1)))
    return {"title": title, "rows": rows, "header": False}


def lm_compile_section(size: Size, cache_root: Path) -> dict:
    """Each LM variant in a fresh process with a cache of its own; then merged into the run's."""
    shape = size.lm
    rows: list[tuple] = []
    first_steps: dict[str, float] = {}
    for name, kind in bench_lm.COMPILE_CANDIDATES_BF16.items():
        if kind not in size.compile_kinds:
            continue
        own_cache = cache_root / f"worker-{kind}"
        env = dict(
            os.environ,
            JAX_COMPILATION_CACHE_DIR=str(own_cache),
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
            JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES=XLA_CACHES,
        )
        figures, why = bench_lm.run_compile_worker(kind, shape, env, size.worker_timeout)
        if figures is None:
            rows.append((name, why))
            continue
        rows.append((name, bench_lm.describe_compile(figures)))
        first_steps[kind] = figures["first_step"]
        if own_cache.is_dir():  # the lm section loads these programs instead of compiling
            shutil.copytree(own_cache, cache_root / "run", dirs_exist_ok=True)
    if "loopax" in first_steps and "fused" in first_steps:
        ratio = first_steps["fused"] / first_steps["loopax"]
        passed = "PASS" if ratio <= TARGETS["first_step"] else "FAIL"
        rows.append(
            (
                "time to first step, fused / per step",
                f"{ratio:.2f}x  target <= {TARGETS['first_step']}  {passed}",
            )
        )
    return {
        "title": f"device lm-compile: transformer LM ({shape.describe()}), each variant in a "
        f"fresh process with an empty compilation cache: seconds a {bench_lm.COMPILE_STEPS}-step "
        "run waited for compiling and creating state, time to its first dispatch's loss",
        "rows": rows,
        "header": False,
    }


def parameter_count(shape: bench_lm.Shape) -> int:
    tokens = jax.ShapeDtypeStruct((shape.batch, shape.context), jnp.int32)
    variables = jax.eval_shape(bench_lm.model(shape).init, jax.random.PRNGKey(0), tokens)
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(variables))


def mfu_row(batches: list, size: Size, params: int) -> tuple[str, str]:
    """`hooks.throughput`'s MFU of loopax's bfloat16 step beside the analytic figure.

    The hook logs every `size.mfu_window` steps; a run of three windows is timed whole (the
    analytic rate: steps over wall seconds, the last step's loss waited for), and the hook's
    last log covers the third window, when the queue of steps in flight is full, so its
    dispatch-to-dispatch rate is the device's (the first window starts on an empty queue).
    """
    shape, window = size.lm, size.mfu_window
    loop = loopax.Loop(bench_lm.trainer(jnp.bfloat16, shape))
    meter = hooks.throughput(loop, every_n_steps=window)
    if meter.peak_flops is None:
        meter.peak_flops = NOMINAL_PEAK
    dataset = _common.CyclingDataset(batches)
    loop.run_steps(dataset, window)["loss"].block_until_ready()  # compiles; logs at its end
    started = time.perf_counter()
    loop.run_steps(dataset, 2 * window)["loss"].block_until_ready()
    wall = time.perf_counter() - started
    label = f"{bench_lm.LOOPAX_BF16}: MFU"
    mfu, flops, peak = meter.last.get("train/mfu"), meter.flops_per_step, meter.peak_flops
    if mfu is None or flops is None or peak is None:
        return (label, "n/a (hooks.throughput logged no MFU)")
    tokens = shape.tokens_per_step
    analytic = 6 * params * tokens * (2 * window / wall) / peak
    off = mfu / analytic - 1
    passed = "PASS" if abs(off) <= TARGETS["mfu"] else "FAIL"
    peak_text = f"{peak / 1e12:.0f} TFLOP/s" + (
        " nominal" if peak == NOMINAL_PEAK else " (hooks.throughput's, dense bf16)"
    )
    return (
        label,
        f"hooks.throughput {mfu:.4f}, analytic 6*params*tokens "
        f"{analytic:.4f} ({off:+.1%}; target within 10%: {passed}); XLA counts "
        f"{flops / (6 * params * tokens):.3f}x the analytic FLOPs a step; windows of {window} "
        f"steps; peak {peak_text}",
    )


def lm_candidates(batches: list, steps: int, shape: bench_lm.Shape) -> dict[str, Callable]:
    """The LM's rate candidates, each compiled (or loaded from the cache) and run once."""
    k = bench_lm.K
    return {
        bench_lm.REFERENCE: bench_lm.hand_written(batches, steps, shape=shape),
        bench_lm.SCAN: bench_lm.hand_written_scan(batches, steps, shape=shape),
        bench_lm.PER_STEP: bench_lm.loopax_loop(batches, steps, shape=shape),
        bench_lm.FUSED: bench_lm.loopax_loop(batches, steps, k=k, shape=shape),
        bench_lm.REFERENCE_BF16: bench_lm.hand_written(batches, steps, jnp.bfloat16, shape),
        bench_lm.LOOPAX_BF16: bench_lm.loopax_loop(
            batches, steps, compute_dtype=jnp.bfloat16, shape=shape
        ),
    }


def lm_section(size: Size, rounds: int, on_round, progress: Callable[[str], None]) -> dict:
    shape, steps, k = size.lm, size.lm_steps, bench_lm.K
    batches = bench_lm.make_batches(shape=shape)
    hits: list[str] = []

    def on_event(event: str, **kwargs: Any) -> None:
        if event == CACHE_HIT_EVENT:
            hits.append(event)

    jax.monitoring.register_event_listener(on_event)
    try:
        with count_compilations() as loaded:
            candidates = lm_candidates(batches, steps, shape)
    finally:
        jax.monitoring.unregister_event_listener(on_event)
    timings, built = timed_rounds(candidates, steps, rounds, size.warmup_rounds, on_round)
    params = parameter_count(shape)
    tokens = shape.tokens_per_step
    rows: list[tuple] = ratio_rows(timings, bench_lm.REFERENCE, list(candidates), tokens)
    rows.append(hygiene_row(built))
    rows.append(
        (
            "programs built for the candidates",
            f"{loaded.count}, {len(hits)} of them loaded from the run's cache (the "
            "lm-compile workers' programs, or one built earlier in this run)",
        )
    )
    progress(f"  lm: MFU, 3 windows of {size.mfu_window} steps")
    rows.append(mfu_row(batches, size, params))
    pairs = [
        *pair(
            timings,
            "loopax per step vs hand-written",
            bench_lm.PER_STEP,
            bench_lm.REFERENCE,
            TARGETS["lm_per_step"],
        ),
        *pair(
            timings,
            "loopax bfloat16 vs hand-written bfloat16",
            bench_lm.LOOPAX_BF16,
            bench_lm.REFERENCE_BF16,
            TARGETS["lm_bf16"],
        ),
        *pair(
            timings,
            f"fused Loop K={k} vs hand-written scan of {k}",
            bench_lm.FUSED,
            bench_lm.SCAN,
            TARGETS["lm_fused_vs_scan"],
        ),
    ]
    return {
        "title": f"device lm: transformer LM ({shape.describe()}, adamw), {params:,} parameters, "
        f"stdlib source; {steps} steps x {rounds} rounds, {BATCHES} cycled batches",
        "unit": "tokens/s",
        "rows": rows,
        "pairs": pairs,
        "reference": bench_lm.REFERENCE,
    }


def sections(
    args: argparse.Namespace,
    only: set[str],
    emit: Callable[[str, dict], None],
    progress: Callable[[str], None],
) -> None:
    """Runs the device sections in `only`, handing each to `emit(key, section)` when measured."""
    size = resolve_size(args.size)
    rounds = args.rounds or size.rounds
    directory = Path(tempfile.mkdtemp(prefix="loopax-device-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    cache_root = start_cache()

    def on_round(name: str) -> Callable[[int], None]:
        return lambda index: progress(f"  {name}: round {index + 1} done")

    progress(f"device: {describe_device()}, size {size.name}, {rounds} timed rounds")
    for key in SECTIONS:
        if key not in only:
            continue
        progress(f"{key}: starting")
        if key == "tiny":
            section = tiny_section(size, rounds, directory, on_round(key))
        elif key == "fused":
            section = fused_section(size, rounds, directory, on_round(key))
        elif key == "sweep":
            section = bench_sweep.section(size.name, jax.default_backend(), progress)
            if section.pop("interrupted", False):
                emit(key, section)  # what the sweep measured before the run's time limit
                raise KeyboardInterrupt
        elif key == "enqueue":
            section = enqueue_section(size)
        elif key == "digits":
            section = digits_section(size, directory)
        elif key == "lm-compile":
            section = lm_compile_section(size, cache_root)
        elif key == "first-step":
            section = bench_first_step.section(size.first_step_rounds, size.worker_timeout)
        else:
            section = lm_section(size, rounds, on_round(key), progress)
        emit(key, section)
