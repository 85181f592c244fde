"""A tiny classifier and datasets shared by the observability hooks' tests (not a test file)."""

import os
import sys

import jax
import numpy as np

import loopax

# The processes some tests start put only this folder on their path: `_tiny` is one up.
_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _TESTS not in sys.path:
    sys.path.append(_TESTS)

from _tiny import MODELS, tiny_arrays, tiny_trainer  # noqa: E402

ONE_DEVICE = jax.devices()[:1]
BATCH_SIZE = MODELS["classifier"].batch_size
LEARNING_RATE = 0.1  # the classifier's sgd(0.1)
model_fn = MODELS["classifier"].model_fn


_COMPILED = {}


def make_trainer():
    """A 2-class classifier with a train accuracy, an eval accuracy and a readable LR.

    Compiling costs seconds and a step microseconds, so one trainer per test process is
    compiled (train and eval) and handed out again with its state reset to global step 0.
    """
    if "trainer" not in _COMPILED:
        trainer = new_trainer()
        loopax.Loop(trainer).run_steps(make_data(loop_forever=True), 1)
        trainer.evaluate(make_data("warm-up", 1))
        # A host copy: the step donates the device buffers of the state it is given.
        _COMPILED["trainer"] = trainer, jax.device_get(trainer.state)
    trainer, state = _COMPILED["trainer"]
    state = jax.tree.map(np.array, state)
    trainer.state = state.replace(step=np.zeros_like(state.step))
    return trainer


def new_trainer(**kwargs):
    """A fresh, uncompiled trainer of the same model (`_tiny`'s classifier)."""
    kwargs.setdefault("devices", ONE_DEVICE)
    return tiny_trainer(
        model="classifier",
        metrics=[loopax.metrics.MovingAverageSparseCategoricalAccuracy()],
        eval_metrics=[loopax.metrics.SparseCategoricalAccuracy()],
        **kwargs,
    )


def make_data(name="train", batches=4, *, seed=0, loop_forever=False, shuffle=True):
    x, y = tiny_arrays(batches * BATCH_SIZE, model="classifier", seed=seed)
    return loopax.ArrayDataset(
        x, y, BATCH_SIZE, name=name, shuffle=shuffle, loop_forever=loop_forever
    )


class CountingDataset:
    """Wraps a dataset and counts `reset()` calls: `trainer.evaluate` resets once per run."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.name = dataset.name
        self.resets = 0

    def yield_batch(self):
        return self.dataset.yield_batch()

    def reset(self):
        self.resets += 1
        self.dataset.reset()


def record_compilations(trainer):
    """Returns a list that receives the graph type of every executable compiled from now on."""
    compiled = []
    trainer.on_exec_creation(lambda info: compiled.append(info.graph_type))
    return compiled
