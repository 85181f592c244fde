"""Loop overhead: loopax's Loop with no-op hooks against a hand-written `jax.jit` loop.

Workload: a tiny MLP (64 -> 128 -> 10, batch 64, adam), small enough that per-step
Python overhead shows. Both sides train from the same device-resident batches with
donated state and no per-step host sync. Rounds are interleaved (A, B, A, B, ...) and
the reported figure is the median of the per-round ratios, which cancels slow drifts
of a shared machine.

Run: python benchmarks/bench_loop.py [--steps 2000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import loopax
from loopax import hooks


class CyclingDataset:
    """Yields the same device-resident batches over and over (no host work)."""

    name = "cycling"

    def __init__(self, batches):
        self.batches = batches
        self.position = 0

    def yield_batch(self):
        batch = self.batches[self.position]
        self.position = (self.position + 1) % len(self.batches)
        return batch

    def reset(self):
        self.position = 0


def mlp(ctx, spec, inputs):
    x = nn.relu(nn.Dense(128)(inputs[0]))
    return nn.Dense(10)(x)


def loss_fn(labels, predictions):
    return optax.softmax_cross_entropy_with_integer_labels(predictions[0], labels[0])


def make_batches(count=16, batch_size=64, seed=0):
    rng = np.random.default_rng(seed)
    device = jax.devices()[0]
    batches = []
    for _ in range(count):
        x = jax.device_put(rng.normal(size=(batch_size, 64)).astype(np.float32), device)
        y = jax.device_put(rng.integers(0, 10, size=(batch_size,)).astype(np.int32), device)
        batches.append((None, [x], [y]))
    return batches


def hand_written(batches, steps):
    """The baseline: a jitted step with donated state, as a careful user writes it."""
    model = nn.Sequential([nn.Dense(128), nn.relu, nn.Dense(10)])
    optimizer = optax.adam(1e-3)
    params = model.init(jax.random.PRNGKey(0), batches[0][1][0])
    state = (params, optimizer.init(params))

    @jax.jit
    def step(state, x, y):
        params, opt_state = state

        def loss_of(p):
            logits = model.apply(p, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    step = jax.jit(step.__wrapped__, donate_argnums=0)
    state, loss = step(state, batches[0][1][0], batches[0][2][0])  # compile
    loss.block_until_ready()

    def run():
        nonlocal state
        count = len(batches)
        loss = None
        for index in range(steps):
            _, inputs, labels = batches[index % count]
            state, loss = step(state, inputs[0], labels[0])
        loss.block_until_ready()

    return run


def loopax_loop(batches, steps, num_hooks):
    trainer = loopax.Trainer(mlp, loss_fn, optax.adam(1e-3), devices=jax.devices()[:1])
    loop = loopax.Loop(trainer)
    for index in range(num_hooks):
        hooks.every_n_steps(loop, 1000, f"noop{index}", lambda loop, metrics: None)
    dataset = CyclingDataset(batches)
    loop.run_steps(dataset, 2)  # compile

    def run():
        metrics = loop.run_steps(dataset, steps)
        metrics["loss"].block_until_ready()

    return run


def timed(run) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--hooks", type=int, default=5)
    args = parser.parse_args()
    batches = make_batches()
    baseline = hand_written(batches, args.steps)
    candidate = loopax_loop(batches, args.steps, args.hooks)
    baseline()
    candidate()  # warm-up
    ratios, base_times, loop_times = [], [], []
    for _ in range(args.rounds):
        base = timed(baseline)
        ours = timed(candidate)
        base_times.append(base)
        loop_times.append(ours)
        ratios.append(base / ours)  # > 1 means loopax is faster
    base_rate = args.steps / statistics.median(base_times)
    loop_rate = args.steps / statistics.median(loop_times)
    print(f"workload: MLP 64-128-10, batch 64, adam, {args.steps} steps x {args.rounds} rounds")
    print(f"hand-written jax.jit loop : {base_rate:9.0f} steps/s")
    print(f"loopax Loop + {args.hooks} hooks    : {loop_rate:9.0f} steps/s")
    print(f"ratio (loopax / hand-written, median of paired rounds): {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
