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


def recording_run(trainer):
    """Wraps `trainer.run`: returns the list of `(kind, count)` of each dispatch it runs."""
    seen = []
    run = type(trainer).run.__get__(trainer)

    def wrapped(dispatch):
        seen.append((type(dispatch).__name__, dispatch.count))
        return run(dispatch)

    trainer.run = wrapped
    return seen


def test_a_wrapper_of_run_sees_every_step_by_hand_and_the_loops():
    x, y = batches(4)
    trainer, _ = new_trainer()
    seen = recording_run(trainer)
    trainer.train_step(None, [x[0]], [y[0]])
    trainer.train_steps(None, [x[:2]], [y[:2]])
    loopax.Loop(trainer).run_steps([(x[i], y[i]) for i in range(2)], 2)
    loopax.Loop(trainer, steps_per_execution=4).run_steps([(x[i], y[i]) for i in range(4)], 4)
    assert seen == [("OneStep", 1), ("Stacked", 2), ("OneStep", 1), ("OneStep", 1), ("Stacked", 4)]
    assert trainer.global_step == sum(count for _, count in seen) == 9


def test_train_steps_keeps_its_stacked_then_last_order_and_counts_its_steps():
    x, y = batches(3)
    trainer, _ = new_trainer()
    stacked, last = trainer.train_steps(None, [x], [y])  # the documented order
    assert np.shape(stacked["loss"]) == (3,) and np.shape(last["loss"]) == ()
    assert list(stacked) == list(last) == list(trainer.train_metric_names)
    assert trainer.global_step == 3
    one, _ = new_trainer()
    stacked, last = one.train_steps(None, [x[:1]], [y[:1]])  # n = 1 is n steps too
    assert np.shape(stacked["loss"]) == (1,) and one.global_step == 1


@pytest.mark.parametrize(
    ("inputs", "error", "match"),
    [
        ([], ValueError, "at least one input is required"),
        (["not an array"], TypeError, "inputs.0. for spec None is a str, not an array"),
        ([np.float32(1)], ValueError, r"shape \(steps, batch, ...\)"),
        (
            [np.ones((3, 4, 3), np.float32)],
            ValueError,
            r"mixes leading steps sizes \[\(2,\), \(3,\)\]",
        ),
    ],
)
def test_train_steps_refuses_a_bad_batch_before_taking_a_step(inputs, error, match):
    trainer, compiled = new_trainer()
    _, y = batches(2)
    with pytest.raises(error, match=match):
        trainer.train_steps(None, inputs, [y])
    assert trainer.global_step == 0 and compiled == []
