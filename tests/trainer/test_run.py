"""`Trainer.run`: the one entry the Loop dispatches its steps through, one record per kind."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import loopax
from loopax.data._reader import OneStep, Stacked

ONE_DEVICE = jax.devices()[:1]


def dense_model(ctx, spec, inputs):
    return nn.Dense(1)(inputs[0])


def squared_error(labels, predictions):
    return (labels[0] - predictions[0]) ** 2


def new_trainer():
    trainer = loopax.Trainer(dense_model, squared_error, optax.sgd(0.1), devices=ONE_DEVICE)
    compiled = []
    trainer.on_exec_creation(lambda info: compiled.append(info.graph_type))
    return trainer, compiled


def batches(count):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(count, 4, 3)).astype(np.float32)
    return x, x.sum(axis=-1, keepdims=True)


def test_one_step_runs_as_train_step():
    x, y = batches(1)
    by_run, compiled = new_trainer()
    by_step, _ = new_trainer()
    result = by_run.run(OneStep(None, [x[0]], [y[0]]))
    expected = by_step.train_step(None, [x[0]], [y[0]])
    assert result.stacked is None
    assert list(result.last) == list(expected) == list(by_run.train_metric_names)
    assert float(result.last["loss"]) == float(expected["loss"])
    assert by_run.global_step == 1 and compiled == ["train"]


def test_stacked_steps_run_as_train_steps_and_count_every_step():
    x, y = batches(3)
    by_run, compiled = new_trainer()
    by_steps, _ = new_trainer()
    result = by_run.run(Stacked(3, None, [x], [y]))
    stacked, last = by_steps.train_steps(None, [x], [y])
    assert by_run.global_step == by_steps.global_step == 3
    assert compiled == ["train_steps"]
    assert np.shape(result.stacked["loss"]) == (3,)
    np.testing.assert_array_equal(result.stacked["loss"], stacked["loss"])
    assert float(result.last["loss"]) == float(last["loss"]) == float(stacked["loss"][-1])


def test_stacked_steps_equal_as_many_single_steps():
    x, y = batches(3)
    fused, _ = new_trainer()
    single, _ = new_trainer()
    result = fused.run(Stacked(3, None, [x], [y]))
    losses = [float(single.run(OneStep(None, [x[i]], [y[i]])).last["loss"]) for i in range(3)]
    np.testing.assert_allclose(result.stacked["loss"], losses, rtol=1e-6)
    assert fused.global_step == single.global_step == 3


def test_anything_else_is_refused_with_its_type():
    trainer, _ = new_trainer()
    x, y = batches(1)
    with pytest.raises(TypeError, match="OneStep, Stacked or OnDevice record, got tuple"):
        trainer.run((None, [x[0]], [y[0]]))
    assert trainer.global_step == 0
