"""NNX models: loopax training an `nnx.Module` against the `nnx.jit` step of Flax's docs.

Issue 12's target: an NNX model's steps/s through loopax's Loop (bare) >= 0.97x the same
model's hand-written `nnx.jit` train step, on the tiny and medium workloads. Both train the
same `nnx.Module` MLP (`nnx.Linear` + `nnx.relu`) with adam from the same device-resident
batches, and neither waits for a step before the end of a round. The `nnx.jit` step is the
one Flax's docs show: `nnx.Optimizer(model, tx, wrt=nnx.Param)`, `nnx.value_and_grad`,
`optimizer.update(model, grads)`, no donation; `nnx.jit` splits the module and optimizer
into graph and state on every call and merges them back, where loopax splits the module
once and steps on its arrays. A hand-written `jax.jit` step (Linen, donated state) is the
reference row. `run_all.py` runs this comparison in its tiny and medium sections.

Run: python benchmarks/bench_nnx.py [--workload tiny] [--steps 4096] [--rounds 7]
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Sequence
from typing import Any

import optax
from _common import (
    WORKLOADS,
    Batch,
    Run,
    Workload,
    _cycle,
    hand_written,
    interleave,
    loopax_loop,
    make_batches,
)
from flax import nnx

NNX_JIT = "hand-written nnx.jit step (Flax docs), NNX"
NNX_LOOPAX = "loopax Loop, bare, NNX module"


class Mlp(nnx.Module):
    """The workload's MLP as an NNX module: `nnx.Linear` layers, `nnx.relu` between them."""

    def __init__(self, dims: Sequence[int], *, rngs: nnx.Rngs):
        self.layers = nnx.List(
            [
                nnx.Linear(features_in, features_out, rngs=rngs)
                for features_in, features_out in itertools.pairwise(dims)
            ]
        )

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = nnx.relu(layer(x))
        return self.layers[-1](x)


def nnx_mlp(workload: Workload) -> Mlp:
    return Mlp(workload.dims, rngs=nnx.Rngs(0))


def nnx_jit(workload: Workload, batches: Sequence[Batch], steps: int) -> Run:
    """The train step of Flax's NNX docs, `nnx.jit` over the module and its optimizer.

    It is cycled over `batches` like the hand-written `jax.jit` baseline (no wait before the round's
    end).
    """
    model = nnx_mlp(workload)
    optimizer = nnx.Optimizer(model, workload.optimizer(), wrt=nnx.Param)

    def loss_fn(model, x, y):
        logits = model(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @nnx.jit
    def train_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, grads)
        return loss

    def step(state: None, x: Any, y: Any) -> tuple[None, Any]:
        # _cycle's step interface; the model and optimizer are updated in place.
        return state, train_step(model, optimizer, x, y)

    return _cycle(step, None, batches, steps, None)


def loopax_nnx(workload: Workload, batches: Sequence[Batch], steps: int) -> Run:
    """Loopax's bare Loop training the same NNX module (`loopax.Trainer(module, ...)`)."""
    return loopax_loop(workload, batches, steps, model=nnx_mlp(workload))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="tiny")
    parser.add_argument(
        "--steps", type=int, default=None, help="steps per round (default: 4096 tiny, 512 medium)"
    )
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    workload = WORKLOADS[args.workload]
    steps = args.steps or {"tiny": 4096, "medium": 512}[workload.name]
    batches = make_batches(workload)
    reference = "hand-written jax.jit loop (Linen)"
    candidates = {
        reference: hand_written(workload, batches, steps),
        NNX_JIT: nnx_jit(workload, batches, steps),
        NNX_LOOPAX: loopax_nnx(workload, batches, steps),
    }
    timings = interleave(candidates, steps, args.rounds)
    print(f"{workload.name}: {workload.description}, {steps} steps x {args.rounds} rounds")
    for name in candidates:
        print(
            f"  {name:44} {timings.rate(name):9.0f} steps/s  "
            f"{timings.ratio(name, reference):.3f} ± {timings.spread(name, reference):.3f}"
        )
    ratio = timings.ratio(NNX_LOOPAX, NNX_JIT)
    print(
        f"  NNX through loopax vs hand-written nnx.jit   {ratio:.3f} ± "
        f"{timings.spread(NNX_LOOPAX, NNX_JIT):.3f}  target >= 0.97  "
        f"{'PASS' if ratio >= 0.97 else 'FAIL'}"
    )


if __name__ == "__main__":
    main()
