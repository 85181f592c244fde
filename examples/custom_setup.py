"""A custom training set-up: a user-written metric, a spec that switches shapes, a custom hook.

    python examples/custom_setup.py

The task: regress the sum of a variable-length sequence. The dataset alternates between
two specs, "short" (length 8) and "long" (length 32), so the Trainer compiles exactly one
executable per spec and shape, reported through `on_exec_creation`. A `Metric` written
from scratch (the fraction of predictions within 0.5 of the target) runs inside the
compiled step, and a custom hook logs it on an exponential schedule.
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

import loopax
from loopax import hooks, losses, optimizers
from loopax.metrics import Metric, format_percent


class WithinTolerance(Metric):
    """The fraction of predictions within `tolerance` of the label."""

    short_name = "tol"
    metric_type = "accuracy"

    def __init__(self, tolerance: float = 0.5):
        self.tolerance = tolerance
        self.name = f"Within {tolerance}"

    def init(self):
        return {"hits": jnp.zeros(()), "count": jnp.zeros(())}

    def update(self, labels, predictions):
        close = jnp.abs(labels[0] - predictions[0]) < self.tolerance
        return {"hits": close.sum().astype(jnp.float32), "count": jnp.float32(close.size)}

    def merge(self, a, b):
        return {"hits": a["hits"] + b["hits"], "count": a["count"] + b["count"]}

    def compute(self, state):
        return state["hits"] / jnp.maximum(state["count"], 1.0)

    def pretty_print(self, value):
        return format_percent(value)


LENGTHS = {"short": 8, "long": 32}


class AlternatingLengths:
    """Yields batches of sequences, alternating between the two specs."""

    name = "sequences"

    def __init__(self, batch_size: int = 32, seed: int = 0):
        self.batch_size = batch_size
        self.seed = seed
        self.reset()

    def reset(self):
        self.rng = np.random.default_rng(self.seed)
        self.count = 0

    def yield_batch(self):
        spec = "short" if self.count % 2 == 0 else "long"
        self.count += 1
        x = self.rng.uniform(-1, 1, size=(self.batch_size, LENGTHS[spec], 1)).astype(np.float32)
        return spec, [x], [x.sum(axis=(1, 2))[:, None]]


def model_fn(ctx, spec, inputs):
    """A per-position MLP, summed over the sequence: works for any length."""
    x = nn.tanh(nn.Dense(16)(inputs[0]))
    per_position = nn.Dense(1)(x)
    return per_position.sum(axis=1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args(argv)

    trainer = loopax.Trainer(
        model_fn,
        losses.mean_squared_error,
        optimizers.adam(learning_rate=1e-2),
        train_metrics=[WithinTolerance()],
        devices=None,
    )
    trainer.on_exec_creation(
        lambda info: print(
            f"compiled {info.graph_type} step for spec {info.spec!r}, "
            f"inputs {info.input_shapes}, in {info.compile_seconds:.2f}s"
        )
    )
    loop = loopax.Loop(trainer)

    def report(loop, metrics):
        metric = trainer.train_metrics[0]
        print(
            f"step {loop.loop_step:4d}: loss {float(metrics['loss']):.4f}, "
            f"{metric.name} {metric.pretty_print(metrics[metric.name])}"
        )

    hooks.exponential_callback(loop, 10, 2.0, "report", report, call_on_end=True)
    loop.run_steps(AlternatingLengths(), args.steps)
    for executor in trainer.executors():
        print(f"{executor.info.spec!r}: {executor.hits} cache hits")


if __name__ == "__main__":
    main()
