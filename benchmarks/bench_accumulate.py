"""Gradient accumulation and bfloat16 compute on the medium workload (issue 14).

Accumulation: loopax's bare Loop with `Trainer(..., accumulate_steps=8)` reading micro-
batches of 32 (the Loop stacks 8 consecutive batches into one optimizer step) against a
hand-written `jax.jit` step that `jax.lax.scan`s over 8 micro-batches of 32, sums the
gradients, divides by 8 and makes one adam update (donated state, the 8 micro-batches
pre-stacked on the device). Both see the same micro-batches in the same order; neither
waits for a step before the end of a round. Target: loopax >= 0.95x the hand-written
step's examples/s. A diagnostic row steps the same Trainer by hand on the pre-stacked
groups (no Loop, no stacking): the difference to the Loop row is what the Loop adds.

Precision: loopax's bare Loop on the medium workload (batch 128) with
`compute_dtype=jnp.bfloat16` against the same Loop in float32, side by side (no target:
on a CPU without native bfloat16 matrix units, bfloat16 may well be slower).

Rounds are interleaved, the order rotating; a ratio is the median of the per-round paired
ratios, "±" half their interquartile range. `run_all.py --only accumulate` runs the same
comparisons as a section of the suite.

Run: python benchmarks/bench_accumulate.py [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from _common import (
    MEDIUM,
    Batch,
    CyclingDataset,
    Run,
    Workload,
    _cycle,
    interleave,
    loss_fn,
    make_batches,
)

import loopax

ACCUMULATE_STEPS = 8
MICRO_BATCH = 32
# Optimizer steps per round (full run, --quick): 8 x 32 = 256 examples a step, twice the
# medium workload's batch, so half its steps.
STEPS_PER_ROUND = (256, 32)
PRECISION_STEPS = (512, 64)  # steps of batch 128, as run_all.py's medium section
ROUNDS = (9, 3)
WARMUP_ROUNDS = (1, 0)
ACCUMULATE_TARGET = 0.95

HAND_WRITTEN = f"hand-written jit step, scan over {ACCUMULATE_STEPS} micro-batches"
LOOPAX_ACCUMULATE = f"loopax Loop, accumulate_steps={ACCUMULATE_STEPS}"
# Diagnostic: the same Trainer stepped by hand on the pre-stacked groups (no Loop, no
# stacking of the micro-batches), to tell the compiled step's cost from the Loop's.
PRE_STACKED = "  same Trainer, train_step on pre-stacked groups"
FLOAT32 = "loopax Loop, float32"
BFLOAT16 = "loopax Loop, compute_dtype=bfloat16"


def micro_workload() -> Workload:
    return dataclasses.replace(MEDIUM, batch_size=MICRO_BATCH)


def stacked(micro_batches: Sequence[Batch], accumulate_steps: int) -> list[Batch]:
    """The hand-written step's input: groups of `accumulate_steps` micro-batches.

    Consecutive micro-batches, stacked on the device into arrays of shape
    (accumulate_steps, micro batch, ...).
    """
    groups = []
    for start in range(0, len(micro_batches) - accumulate_steps + 1, accumulate_steps):
        group = micro_batches[start : start + accumulate_steps]
        groups.append(
            (
                None,
                [jnp.stack([batch[1][0] for batch in group])],
                [jnp.stack([batch[2][0] for batch in group])],
            )
        )
    jax.block_until_ready(groups)
    return groups


def hand_written_accumulate(workload: Workload, groups: Sequence[Batch], steps: int) -> Run:
    """A careful user's accumulation step, cycled over `groups`.

    `lax.scan` over the micro-batches summing the gradients, their mean, one optimizer
    update; jitted with the state donated.
    """
    model = workload.module()
    optimizer = workload.optimizer()

    def step(state, xs, ys):
        params, opt_state = state

        def micro_step(grad_sum, batch):
            x, y = batch

            def loss_of(p):
                logits = model.apply(p, x)
                return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

            loss, grads = jax.value_and_grad(loss_of)(params)
            return jax.tree.map(jnp.add, grad_sum, grads), loss

        zeros = jax.tree.map(jnp.zeros_like, params)
        grad_sum, losses = jax.lax.scan(micro_step, zeros, (xs, ys))
        grads = jax.tree.map(lambda g: g / xs.shape[0], grad_sum)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), losses.mean()

    params = model.init(jax.random.PRNGKey(0), groups[0][1][0][0])
    state = (params, optimizer.init(params))
    return _cycle(jax.jit(step, donate_argnums=0), state, groups, steps, None)


def loopax_run(workload: Workload, batches: Sequence[Batch], steps: int, **options: Any):
    """Loopax's bare Loop over the cycling device-resident batches.

    The Trainer is built with `options` (e.g. `accumulate_steps`, `compute_dtype`).
    Returns the run and "", or None and why this loopax cannot build it.
    """
    try:
        trainer = loopax.Trainer(
            workload.model_fn,
            loss_fn,
            workload.optimizer(),
            devices=jax.devices()[:1],
            **options,
        )
    except TypeError as err:
        return None, f"n/a (Trainer does not take {', '.join(options)}: {type(err).__name__})"
    loop = loopax.Loop(trainer)
    dataset = CyclingDataset(batches)
    loop.run_steps(dataset, 2)  # compile

    def run() -> None:
        metrics = loop.run_steps(dataset, steps)
        metrics["loss"].block_until_ready()

    return run, ""


def loopax_pre_stacked(workload: Workload, groups: Sequence[Batch], steps: int) -> Run:
    """`Trainer.train_step` called in a plain loop on the pre-stacked groups."""
    trainer = loopax.Trainer(
        workload.model_fn,
        loss_fn,
        workload.optimizer(),
        devices=jax.devices()[:1],
        accumulate_steps=ACCUMULATE_STEPS,
    )
    trainer.train_step(*groups[0])["loss"].block_until_ready()  # compile

    def run() -> None:
        metrics = None
        for index in range(steps):
            metrics = trainer.train_step(*groups[index % len(groups)])
        metrics["loss"].block_until_ready()

    return run


def _rows(timings: Any, reference: str, names: Sequence[str], scale: float) -> list[tuple]:
    """Table rows `(label, examples/s, ratio, ±)`; the reference's ratio is 1."""
    rows = [(reference, timings.rate(reference) * scale, 1.0, 0.0)]
    for name in names:
        if name != reference and name in timings.seconds:
            rows.append(
                (
                    name,
                    timings.rate(name) * scale,
                    timings.ratio(name, reference),
                    timings.spread(name, reference),
                )
            )
    return rows


def accumulate_comparison(quick: int, rounds: int, on_round=None) -> dict:
    """The accumulation comparison; returns a run_all.py section (rates in examples/s)."""
    workload = micro_workload()
    steps = STEPS_PER_ROUND[quick]
    micro_batches = make_batches(workload, count=4 * ACCUMULATE_STEPS)
    groups = stacked(micro_batches, ACCUMULATE_STEPS)
    candidates: dict[str, Run] = {HAND_WRITTEN: hand_written_accumulate(workload, groups, steps)}
    run, why = loopax_run(workload, micro_batches, steps, accumulate_steps=ACCUMULATE_STEPS)
    if run is not None:
        candidates[LOOPAX_ACCUMULATE] = run
        candidates[PRE_STACKED] = loopax_pre_stacked(workload, groups, steps)
    timings = interleave(candidates, steps, rounds, WARMUP_ROUNDS[quick], on_round=on_round)
    examples = ACCUMULATE_STEPS * MICRO_BATCH
    rows = _rows(timings, HAND_WRITTEN, list(candidates), examples)
    if run is None:
        rows.append((LOOPAX_ACCUMULATE, why))
    return {
        "title": f"accumulate: MLP {'-'.join(map(str, workload.dims))}, adam, "
        f"{ACCUMULATE_STEPS} micro-batches of {MICRO_BATCH} a step, {steps} steps x "
        f"{rounds} rounds",
        "unit": "examples/s",
        "rows": rows,
        "targets": {LOOPAX_ACCUMULATE: ACCUMULATE_TARGET},
    }


def precision_comparison(quick: int, rounds: int, on_round=None) -> dict:
    """bfloat16 compute vs float32, both through loopax; a run_all.py section."""
    steps = PRECISION_STEPS[quick]
    batches = make_batches(MEDIUM)
    candidates: dict[str, Run] = {}
    unavailable = {}
    for name, options in ((FLOAT32, {}), (BFLOAT16, {"compute_dtype": jnp.bfloat16})):
        run, why = loopax_run(MEDIUM, batches, steps, **options)
        if run is None:
            unavailable[name] = why
        else:
            candidates[name] = run
    rows: list[tuple] = []
    if FLOAT32 in candidates:
        timings = interleave(candidates, steps, rounds, WARMUP_ROUNDS[quick], on_round=on_round)
        rows = _rows(timings, FLOAT32, list(candidates), MEDIUM.batch_size)
    rows += [(name, why) for name, why in unavailable.items()]
    return {
        "title": f"precision: {MEDIUM.description}, {steps} steps x {rounds} rounds",
        "unit": "examples/s",
        "rows": rows,
        "targets": {},
    }


def print_section(section: dict) -> None:
    print(section["title"])
    rows = section["rows"]
    reference = rows[0][0] if rows and len(rows[0]) == 4 else None
    for row in rows:
        if len(row) == 2:
            print(f"  {row[0]:56} {row[1]}")
            continue
        label, rate, ratio, spread = row
        ratio_text = "1 (reference)" if label == reference else f"{ratio:.3f} ± {spread:.3f}"
        target = section["targets"].get(label)
        goal = (
            ""
            if target is None
            else f"  target >= {target}  " + ("PASS" if ratio >= target else "FAIL")
        )
        print(f"  {label:56} {rate:9.0f} {section['unit']}  {ratio_text:>13}{goal}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument(
        "--only", default="accumulate,precision", help="accumulate, precision or both"
    )
    args = parser.parse_args()
    quick = int(args.quick)
    rounds = args.rounds or ROUNDS[quick]
    only = {part.strip() for part in args.only.split(",")}
    if "accumulate" in only:
        print_section(accumulate_comparison(quick, rounds))
    if "precision" in only:
        print_section(precision_comparison(quick, rounds))


if __name__ == "__main__":
    main()
