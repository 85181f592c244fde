"""Scripted metrics shared by the early-stopping and plateau tests (not a test file).

The model's loss is scripted: its value is the mean of the batch's second label (its
gradient the squared error's), so every evaluation (and every train step) reports exactly
the value a test chose, while the parameters really train.
"""

import jax
import jax.numpy as jnp
import numpy as np

import loopax

BATCH_SIZE = 8


def scripted_loss(labels, predictions):
    """Its value is the mean of labels[1]; its gradient is the squared error's."""
    error = jnp.mean((labels[0] - predictions[0]) ** 2)
    return error - jax.lax.stop_gradient(error) + jnp.mean(labels[1])


def batch(rng_seed, value):
    rng = np.random.default_rng(rng_seed)
    inputs = rng.normal(size=(BATCH_SIZE, 3)).astype(np.float32)
    targets = inputs.sum(1, keepdims=True)
    return None, [inputs], [targets, np.full((BATCH_SIZE,), value, np.float32)]


class ScriptedEval:
    """An eval dataset of one batch whose n-th evaluation reports `values[n]` (the last
    value again after the end): `trainer.evaluate` resets it once per evaluation."""

    def __init__(self, values, name="test"):
        self.name = name
        self.values = list(values)
        self.evaluations = -1
        self._done = True

    def reset(self):
        self.evaluations += 1
        self._done = False

    def yield_batch(self):
        if self._done:
            raise StopIteration
        self._done = True
        return batch(99, self.values[min(self.evaluations, len(self.values) - 1)])


class ScriptedEpochs:
    """A train dataset whose train loss is `values[epoch]` (2 batches an epoch)."""

    name = "train"

    def __init__(self, values, batches=2):
        self.values = list(values)
        self.batches = batches
        self.epoch = 0
        self._yielded = 0

    def reset(self):
        self.epoch += 1
        self._yielded = 0

    def yield_batch(self):
        if self._yielded == self.batches:
            raise StopIteration
        self._yielded += 1
        return batch(self._yielded, self.values[min(self.epoch, len(self.values) - 1)])


def train_data():
    rng = np.random.default_rng(0)
    inputs = rng.normal(size=(4 * BATCH_SIZE, 3)).astype(np.float32)
    return loopax.ArrayDataset(
        inputs,
        [inputs.sum(1, keepdims=True), np.zeros((4 * BATCH_SIZE,), np.float32)],
        BATCH_SIZE,
        shuffle=False,
        loop_forever=True,
    )
