"""A real model (issue 25 item 4): the character transformer LM of `examples/transformer_lm.py`.

2 pre-norm decoder blocks, width 128, 4 heads, context 64, batch 32 windows of the standard
library's source (the example's model and data), AdamW, mean cross-entropy over every
position. Two parts:

Rates, side by side in one process (interleaved rounds, as every section of `run_all.py`),
from the same device-resident batches, against a hand-written `jax.jit` step of the same
Flax module with donated state (the reference):
- a hand-written `jax.jit(lax.scan)` of 8 steps a dispatch over pre-stacked device data;
- loopax's bare Loop, per step, and with `steps_per_execution=8` reading an on-device
  `ArrayDataset` of the same batches;
- bfloat16: a hand-written step that casts the parameters and computes in bfloat16
  (float32 parameters, optimizer and loss) beside loopax's `compute_dtype=bfloat16`.
Figures are tokens/s (steps/s x 32 x 64) and ratios to the reference.

Compile seconds and peak host memory, one fresh process per candidate with every
compilation cache off (`LOOPAX_COMPILATION_CACHE=off`, no `JAX_COMPILATION_CACHE_DIR`): a
run of 45 steps, timed from before the first program is built to its last step's loss,
less the same 45 steps run again (compiled): the seconds the run spent compiling (and
creating its state) that it waited for. The fused candidate has a hook every 15 steps, so
its groups run 8, 4, 2 and 1 steps (four programs, as a schedule that cuts groups asks
for). Also the programs' own compile seconds as loopax reports them
(`ExecInfo.compile_seconds`, all threads) and the process's peak resident memory
(`ru_maxrss`).

Run: python benchmarks/bench_lm.py [--quick] [--rounds N]   (= run_all.py --only lm)
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import Batch, CyclingDataset, Run, _cycle, interleave

import loopax
from loopax import hooks, losses

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import transformer_lm  # noqa: E402  (the example's model and data)


@dataclasses.dataclass(frozen=True)
class Shape:
    """The model's and batches' size: `layers` blocks of `width` with `heads`, `context`, `batch`.

    The default is the example's (and `run_all.py --only lm`'s); `run_all.py --device` trains a
    GPU-sized one (`bench_device.py`).
    """

    layers: int = 2
    width: int = 128
    heads: int = 4
    context: int = 64
    batch: int = 32

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.context

    def describe(self) -> str:
        return (
            f"{self.layers} layers, width {self.width}, {self.heads} heads, context "
            f"{self.context}, batch {self.batch}"
        )


DEFAULT = Shape()
BATCH, CONTEXT, K = DEFAULT.batch, DEFAULT.context, 8
TOKENS_PER_STEP = BATCH * CONTEXT
LEARNING_RATE = 1e-3
STEPS = (64, 16)  # per round: full run / --quick; multiples of K
COMPILE_STEPS, COMPILE_HOOK_EVERY = 45, 15  # groups of 8, 4, 2, 1 steps

REFERENCE = "hand-written jax.jit step"
SCAN = f"hand-written lax.scan, {K} steps a dispatch"
PER_STEP = "loopax Loop, per step, bare"
FUSED = f"loopax Loop, K={K}, on-device data"
REFERENCE_BF16 = "hand-written jax.jit step, bfloat16"
LOOPAX_BF16 = "loopax Loop, per step, compute_dtype=bfloat16"
CANDIDATES = (REFERENCE, SCAN, PER_STEP, FUSED, REFERENCE_BF16, LOOPAX_BF16)
# The fresh-process candidates: name -> what the worker runs.
COMPILE_CANDIDATES = {
    REFERENCE: "hand",
    SCAN: "scan",
    PER_STEP: "loopax",
    f"loopax Loop, K={K}, hook every {COMPILE_HOOK_EVERY} steps": "fused",
}
# The same with bfloat16 on both sides (run_all.py --device).
COMPILE_CANDIDATES_BF16 = {
    **COMPILE_CANDIDATES,
    REFERENCE_BF16: "hand_bf16",
    LOOPAX_BF16: "loopax_bf16",
}


def model(shape: Shape = DEFAULT) -> transformer_lm.CharTransformer:
    return transformer_lm.CharTransformer(
        width=shape.width, layers=shape.layers, heads=shape.heads, context=shape.context
    )


def optimizer() -> optax.GradientTransformation:
    return optax.adamw(LEARNING_RATE)


def make_batches(count: int = 16, seed: int = 0, shape: Shape = DEFAULT) -> list[Batch]:
    """`count` batches of random windows of the standard library's source, on the device."""
    tokens = transformer_lm.encode(transformer_lm.standard_library_text(2_000_000))
    inputs, targets = transformer_lm.windows(tokens, shape.context)
    if len(inputs) < count * shape.batch:
        raise ValueError(
            f"{len(inputs)} windows of {shape.context} characters are too few for {count} "
            f"batches of {shape.batch}: use a smaller --size"
        )
    order = np.random.default_rng(seed).permutation(len(inputs))[: count * shape.batch]
    device = jax.devices()[0]
    return [
        (
            None,
            [jax.device_put(inputs[part], device)],
            [jax.device_put(targets[part], device)],
        )
        for part in np.split(order, count)
    ]


# -- the hand-written baselines -----------------------------------------------------------


def _step(compute_dtype: Any = None, shape: Shape = DEFAULT) -> tuple[Callable, Callable]:
    """A train step `(state, x, y) -> (state, loss)` of the LM, and `init(x) -> state`.

    With `compute_dtype`, the parameters are cast to it for the forward and backward pass
    (as `Trainer(compute_dtype=...)` does) and the logits back to float32 for the loss.
    """
    module, tx = model(shape), optimizer()

    def step(state, x, y):
        params, opt_state = state

        def loss_of(p):
            if compute_dtype is not None:
                p = jax.tree.map(lambda a: a.astype(compute_dtype), p)
            logits = module.apply({"params": p}, x).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    def init(x):
        params = jax.jit(module.init)(jax.random.PRNGKey(0), x)["params"]
        return params, tx.init(params)

    return step, init


def hand_written(
    batches: Sequence[Batch], steps: int, compute_dtype: Any = None, shape: Shape = DEFAULT
) -> Run:
    step, init = _step(compute_dtype, shape)
    return _cycle(jax.jit(step, donate_argnums=0), init(batches[0][1][0]), batches, steps, None)


def stacked(batches: Sequence[Batch]) -> list[tuple[jax.Array, jax.Array]]:
    """The batches as device-resident chunks of K stacked steps."""
    chunks = []
    for start in range(0, len(batches) - K + 1, K):
        part = batches[start : start + K]
        chunks.append((jnp.stack([b[1][0] for b in part]), jnp.stack([b[2][0] for b in part])))
    return chunks


def hand_written_scan(batches: Sequence[Batch], steps: int, shape: Shape = DEFAULT) -> Run:
    """K steps a dispatch: `jax.jit(lax.scan(step))`, donated state, pre-stacked data."""
    step, init = _step(shape=shape)

    def steps_fn(state, xs, ys):
        return jax.lax.scan(lambda state, xy: step(state, *xy), state, (xs, ys))

    compiled = jax.jit(steps_fn, donate_argnums=0)
    chunks = stacked(batches)
    state = init(batches[0][1][0])
    state, losses_ = compiled(state, *chunks[0])
    jax.block_until_ready(losses_)

    def run() -> None:
        nonlocal state
        out = None
        for index in range(steps // K):
            state, out = compiled(state, *chunks[index % len(chunks)])
        jax.block_until_ready(out)

    return run


# -- loopax -------------------------------------------------------------------------------


def trainer(compute_dtype: Any = None, shape: Shape = DEFAULT) -> loopax.Trainer:
    return loopax.Trainer(
        model(shape),
        losses.sparse_categorical_crossentropy_logits,
        optimizer(),
        devices=jax.devices()[:1],
        compute_dtype=compute_dtype,
    )


def on_device(batches: Sequence[Batch]) -> loopax.ArrayDataset:
    """The batches, in order, as an on-device `ArrayDataset` that loops."""
    x = np.concatenate([np.asarray(b[1][0]) for b in batches])
    y = np.concatenate([np.asarray(b[2][0]) for b in batches])
    batch = len(batches[0][1][0])
    return loopax.ArrayDataset(x, y, batch, shuffle=False, loop_forever=True, on_device=True)


def loopax_loop(
    batches: Sequence[Batch],
    steps: int,
    k: int = 1,
    compute_dtype: Any = None,
    shape: Shape = DEFAULT,
) -> Run:
    """The Loop over the batches, per step or `k` steps fused (on-device data)."""
    loop = loopax.Loop(trainer(compute_dtype, shape), steps_per_execution=k)
    dataset = CyclingDataset(batches) if k == 1 else on_device(batches)
    loop.run_steps(dataset, k)  # compiles

    def run() -> None:
        loop.run_steps(dataset, steps)["loss"].block_until_ready()

    return run


def rate_section(quick: int, rounds: int, on_round: Callable[[int], None] | None) -> dict:
    """The interleaved comparison; the section `run_all.print_table` prints."""
    steps = STEPS[quick]
    batches = make_batches()
    candidates: dict[str, Run] = {
        REFERENCE: hand_written(batches, steps),
        SCAN: hand_written_scan(batches, steps),
        PER_STEP: loopax_loop(batches, steps),
        FUSED: loopax_loop(batches, steps, k=K),
        REFERENCE_BF16: hand_written(batches, steps, jnp.bfloat16),
        LOOPAX_BF16: loopax_loop(batches, steps, compute_dtype=jnp.bfloat16),
    }
    timings = interleave(candidates, steps, rounds, warmup=0 if quick else 1, on_round=on_round)
    rows = [(REFERENCE, timings.rate(REFERENCE) * TOKENS_PER_STEP, 1.0, 0.0)]
    for name in CANDIDATES[1:]:
        rows.append(
            (
                name,
                timings.rate(name) * TOKENS_PER_STEP,
                timings.ratio(name, REFERENCE),
                timings.spread(name, REFERENCE),
            )
        )
    pairs = [
        ("fused Loop vs hand-written lax.scan", FUSED, SCAN, None),
        ("loopax bfloat16 vs hand-written bfloat16", LOOPAX_BF16, REFERENCE_BF16, None),
    ]
    return {
        "title": f"lm: character transformer (2 layers, width 128, context {CONTEXT}, batch "
        f"{BATCH}, adamw), stdlib source; {steps} steps x {rounds} rounds",
        "unit": "tokens/s",
        "rows": rows,
        "pairs": [
            (label, timings.ratio(own, other), timings.spread(own, other), target)
            for label, own, other, target in pairs
        ],
    }


# -- compile seconds and memory, one fresh process per candidate ---------------------------


def peak_memory_mb() -> float:
    """This process's peak resident memory, MB.

    Linux's `VmHWM` (of this program alone: `ru_maxrss` keeps the parent's peak across the
    fork and exec that started it), else `ru_maxrss`.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def compile_worker(kind: str, shape: Shape = DEFAULT, launched: float | None = None) -> dict:
    """Runs candidate `kind` twice over `COMPILE_STEPS` steps; its compile figures.

    The first run's first dispatch (one step; K steps fused or scanned) is timed on its own
    as the time to first step: from before the state and the first program are built to
    that dispatch's loss, and from `launched` (the parent's `time.time()` before it started
    this process: imports and backend start included) when given.
    """
    batches = make_batches(shape=shape)
    infos: list[Any] = []
    bf16 = kind.endswith("_bf16")
    compute_dtype = jnp.bfloat16 if bf16 else None
    kind = kind.removesuffix("_bf16")
    first_count = K if kind in ("scan", "fused") else 1

    parts: dict[str, float] = {}
    started = time.perf_counter()
    if kind in ("hand", "scan"):
        step, init = _step(compute_dtype, shape)
        state = jax.block_until_ready(init(batches[0][1][0]))
        parts["init"] = time.perf_counter() - started
        if kind == "hand":
            stepping = jax.jit(step, donate_argnums=0)
            chunks = [(b[1][0], b[2][0]) for b in batches]
            count = COMPILE_STEPS
        else:
            stepping = jax.jit(
                lambda s, xs, ys: jax.lax.scan(lambda s, xy: step(s, *xy), s, (xs, ys)),
                donate_argnums=0,
            )
            chunks, count = stacked(batches), -(-COMPILE_STEPS // K)
        compiling = time.perf_counter()
        stepping = stepping.lower(state, *chunks[0]).compile()
        parts["step"] = time.perf_counter() - compiling
        position = 0  # the next dispatch's chunk

        def dispatch(count: int) -> None:
            nonlocal state, position
            out = None
            for _ in range(count):
                state, out = stepping(state, *chunks[position % len(chunks)])
                position += 1
            jax.block_until_ready(out)

        def first_run() -> None:
            dispatch(1)

        def rest() -> None:
            dispatch(count - 1)

        def run() -> None:
            dispatch(count)
    else:
        fused = kind == "fused"
        loop = loopax.Loop(trainer(compute_dtype, shape), steps_per_execution=K if fused else 1)
        loop.trainer.on_exec_creation(infos.append)
        if fused:
            hooks.every_n_steps(loop, COMPILE_HOOK_EVERY, "cut", lambda loop, metrics: None)
        dataset = on_device(batches) if fused else CyclingDataset(batches)

        def first_run() -> None:
            loop.run_steps(dataset, first_count)["loss"].block_until_ready()

        def rest() -> None:
            loop.run_steps(dataset, COMPILE_STEPS - first_count)["loss"].block_until_ready()

        def run() -> None:
            loop.run_steps(dataset, COMPILE_STEPS)["loss"].block_until_ready()

    first_run()
    first_step = time.perf_counter() - started
    from_launch = None if launched is None else time.time() - launched
    rest()
    first = time.perf_counter() - started
    started = time.perf_counter()
    run()
    again = time.perf_counter() - started
    return {
        "waited": first - again,
        "first_step": first_step,
        "first_steps": first_count,
        "from_launch": from_launch,
        "programs": len(infos),
        "compile_seconds": sum(info.compile_seconds for info in infos),
        "peak_mb": peak_memory_mb(),
        "parts": parts,
    }


def run_compile_worker(
    kind: str, shape: Shape, env: dict[str, str], timeout: float | None = None
) -> tuple[dict | None, str]:
    """`compile_worker(kind, shape)` in a fresh process; its figures, or None and why not."""
    command = [sys.executable, __file__, "--compile-worker", kind]
    command += [json.dumps(dataclasses.asdict(shape)), repr(time.time())]
    try:
        result = subprocess.run(
            command, env=env, stdout=subprocess.PIPE, text=True, check=False, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return None, f"n/a (worker timed out after {timeout:.0f} s)"
    lines = [line for line in result.stdout.splitlines() if line.startswith("LM-JSON ")]
    if not lines:
        return None, f"n/a (worker failed with exit code {result.returncode})"
    return json.loads(lines[-1][len("LM-JSON ") :]), ""


def describe_compile(figures: dict) -> str:
    """One compile row's text: waited, programs or parts, first step, peak memory."""
    if figures["programs"]:
        programs, seconds = figures["programs"], figures["compile_seconds"]
        reported = f"; programs: {programs}, {seconds:.2f} s compiling"
    else:  # hand-written: the init and the step, each compiled and run once
        reported = "; init {init:.2f} s, step compile {step:.2f} s".format(**figures["parts"])
    first = figures.get("first_step")
    if first is not None:
        reported += f"; first {figures['first_steps']}-step dispatch at {first:.2f} s"
        if figures.get("from_launch") is not None:
            reported += f" ({figures['from_launch']:.2f} s after launch)"
    return f"{figures['waited']:.2f} s waited{reported}; peak {figures['peak_mb']:.0f} MB"


def compile_section() -> dict:
    """Each compile candidate in a fresh process, caches off."""
    env = dict(os.environ, LOOPAX_COMPILATION_CACHE="off")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env.pop("XLA_FLAGS", None)
    rows: list[tuple] = []
    for name, kind in COMPILE_CANDIDATES.items():
        figures, why = run_compile_worker(kind, DEFAULT, env)
        rows.append((name, why) if figures is None else (name, describe_compile(figures)))
    return {
        "title": f"lm, fresh processes, caches off: seconds a {COMPILE_STEPS}-step run spent "
        "compiling and creating state (less the same steps compiled), time to its first "
        "dispatch's loss, peak host memory",
        "rows": rows,
        "header": False,
    }


def sections(quick: int, rounds: int, on_round: Callable[[int], None] | None = None) -> list:
    return [rate_section(quick, rounds, on_round), compile_section()]


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--compile-worker":
        shape = Shape(**json.loads(sys.argv[3])) if len(sys.argv) > 3 else DEFAULT
        launched = float(sys.argv[4]) if len(sys.argv) > 4 else None
        print("LM-JSON " + json.dumps(compile_worker(sys.argv[2], shape, launched)), flush=True)
    else:
        import run_all

        sys.argv[1:1] = ["--only", "lm"]
        run_all.main()
