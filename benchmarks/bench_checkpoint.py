"""How long the training loop is blocked per checkpoint save: asynchronous vs synchronous.

For a small state and a ~100 MB one (a 5000x5000 float32 Dense kernel, plain SGD so the
optimizer adds no state), trains with `loopax.hooks.checkpoint` saving every few steps and
times the `save` calls made from the loop (the time the loop cannot train). With `gap`
seconds of (simulated) training before each save, an asynchronous save has finished before
the next one; with no gap, saves come back to back and a save also waits for the previous
one. Run: `python benchmarks/bench_checkpoint.py`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import flax.linen as nn
import jax
import numpy as np
import optax

import loopax
from loopax import hooks


def make_model(width: int):
    def model_fn(ctx, spec, inputs):
        return nn.Dense(width)(inputs[0])

    return model_fn


def measure(width: int, async_save: bool, saves: int, every: int, gap: float) -> dict:
    trainer = loopax.Trainer(
        make_model(width),
        loopax.losses.mean_squared_error,
        optax.sgd(1e-3),
        devices=jax.devices()[:1],
    )
    data = loopax.ArrayDataset(
        np.ones((8, width), np.float32),
        np.ones((8, width), np.float32),
        batch_size=8,
        loop_forever=True,
    )
    loop = loopax.Loop(trainer)
    loop.run_steps(data, 1)  # compile outside the measurement
    state_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(trainer.state))
    with tempfile.TemporaryDirectory() as directory:
        checkpointer = hooks.checkpoint(loop, directory, keep=2, async_save=async_save)
        blocked = []

        def timed_save(loop, metrics):
            jax.block_until_ready(metrics["loss"])  # time the save, not the step before it
            time.sleep(gap)  # stands for the training time between saves in a real run
            started = time.perf_counter()
            checkpointer.save(metrics)
            blocked.append(time.perf_counter() - started)

        hooks.every_n_steps(
            loop, every, "timed save", timed_save, priority=loopax.Priority.CHECKPOINT
        )
        loop.run_steps(data, saves * every - 1)  # the last save is the end-of-run one
        checkpointer.close()
    return {
        "state_mb": state_bytes / 1e6,
        "mode": "async" if async_save else "sync",
        "blocked_ms": 1e3 * statistics.median(blocked),
        "max_blocked_ms": 1e3 * max(blocked),
        "gap_s": gap,
        "saves": len(blocked),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument(
        "--gap", type=float, default=1.0, help="seconds of (simulated) training before each save"
    )
    args = parser.parse_args()
    rows = []
    for width in (4, 5000):
        for gap in (args.gap, 0.0):
            for async_save in (True, False):
                rows.append(measure(width, async_save, args.saves, args.every, gap))
    print(
        f"device: {jax.devices()[0].device_kind}; a save every {args.every} steps, "
        f"{args.saves} saves; 'gap' = seconds of training before each save"
    )
    print(f"{'state':>10} {'gap':>5} {'mode':>6} {'blocked/save (median)':>22} {'max':>10}")
    for row in rows:
        print(
            f"{row['state_mb']:>8.2f}MB {row['gap_s']:>4.1f}s {row['mode']:>6} "
            f"{row['blocked_ms']:>19.1f} ms {row['max_blocked_ms']:>7.1f} ms"
        )


if __name__ == "__main__":
    main()
