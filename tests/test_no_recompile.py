"""After the first step of a spec and shape, nothing compiles again: every built-in loss,
metric and hook, and a learning-rate change at run time."""

import io

import flax.linen as nn
import jax
import numpy as np
import pytest

import loopax
from loopax import hooks, losses, metrics, optimizers

ONE_DEVICE = jax.devices()[:1]


def _count_compilations(trainer):
    compiled = []
    trainer.on_exec_creation(compiled.append)
    return compiled


def _classification_data(name="train", loop_forever=True, batches=4):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16 * batches, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    return loopax.ArrayDataset(x, y, 16, name=name, loop_forever=loop_forever)


def classifier(ctx, spec, inputs):
    x = nn.Dropout(0.1, deterministic=not ctx.training)(nn.relu(nn.Dense(8)(inputs[0])))
    return nn.Dense(2)(x)


# Each loss with labels/predictions it accepts: (loss_fn, make_labels(y), head).
def _regression_labels(y):
    return [y[:, None].astype(np.float32)]


LOSS_CASES = {
    "mean_squared_error": (losses.mean_squared_error, _regression_labels, 1, None),
    "mean_absolute_error": (losses.mean_absolute_error, _regression_labels, 1, None),
    "huber": (losses.huber(1.0), _regression_labels, 1, None),
    "binary_crossentropy": (losses.binary_crossentropy, _regression_labels, 1, nn.sigmoid),
    "binary_crossentropy_logits": (losses.binary_crossentropy_logits, _regression_labels, 1, None),
    "categorical_crossentropy": (
        losses.categorical_crossentropy,
        lambda y: [np.eye(2, dtype=np.float32)[y]],
        2,
        lambda z: nn.softmax(z),
    ),
    "categorical_crossentropy_logits": (
        losses.categorical_crossentropy_logits,
        lambda y: [np.eye(2, dtype=np.float32)[y]],
        2,
        None,
    ),
    "sparse_categorical_crossentropy_logits": (
        losses.sparse_categorical_crossentropy_logits,
        lambda y: [y],
        2,
        None,
    ),
}


@pytest.mark.parametrize("name", sorted(LOSS_CASES))
def test_each_loss_compiles_once(name):
    loss_fn, make_labels, width, head = LOSS_CASES[name]

    def model_fn(ctx, spec, inputs):
        out = nn.Dense(width)(inputs[0])
        return head(out) if head is not None else out

    trainer = loopax.Trainer(model_fn, loss_fn, optimizers.sgd(0.1), devices=ONE_DEVICE)
    compiled = _count_compilations(trainer)
    rng = np.random.default_rng(1)
    for _ in range(3):
        x = rng.normal(size=(8, 4)).astype(np.float32)
        y = (x[:, 0] > 0).astype(np.int32)
        result = trainer.train_step(None, [x], make_labels(y))
    assert np.isfinite(float(result["loss"]))
    assert len(compiled) == 1


def test_every_built_in_metric_compiles_once():
    train_metrics = [
        metrics.MovingAverageSparseCategoricalAccuracy(),
        metrics.SparseCategoricalAccuracy(name="Train Accuracy"),
        metrics.Mean("Mean Max Logit", lambda labels, predictions: predictions[0].max(axis=-1)),
        metrics.MovingAverage("~Max Logit", lambda labels, predictions: predictions[0].max()),
    ]
    binary = [
        metrics.BinaryAccuracy(name="Binary"),
        metrics.BinaryLogitsAccuracy(name="Binary Logits"),
        metrics.MovingAverageBinaryAccuracy(name="~Binary"),
        metrics.MovingAverageBinaryLogitsAccuracy(name="~Binary Logits"),
    ]

    def two_heads(ctx, spec, inputs):
        return [nn.Dense(2)(inputs[0])]

    trainer = loopax.Trainer(
        two_heads,
        losses.sparse_categorical_crossentropy_logits,
        optimizers.adam(1e-2),
        train_metrics=train_metrics,
        eval_metrics=[metrics.SparseCategoricalAccuracy()],
        devices=ONE_DEVICE,
    )
    compiled = _count_compilations(trainer)
    data = _classification_data()
    loopax.Loop(trainer).run_steps(data, 5)
    for _ in range(2):
        trainer.evaluate(_classification_data("eval", loop_forever=False))
    assert [info.graph_type for info in compiled] == ["train", "eval"]

    # The binary accuracies on a one-logit head.
    def one_logit(ctx, spec, inputs):
        return nn.Dense(1)(inputs[0])

    binary_trainer = loopax.Trainer(
        one_logit,
        losses.binary_crossentropy_logits,
        optimizers.sgd(0.1),
        train_metrics=binary,
        devices=ONE_DEVICE,
    )
    compiled = _count_compilations(binary_trainer)
    x = np.random.default_rng(2).normal(size=(64, 4)).astype(np.float32)
    y = (x[:, :1] > 0).astype(np.float32)
    loopax.Loop(binary_trainer).run_steps(loopax.ArrayDataset(x, y, 16, loop_forever=True), 5)
    assert len(compiled) == 1


def test_every_ready_hook_attached_compiles_once(tmp_path):
    trainer = loopax.Trainer(
        classifier,
        losses.sparse_categorical_crossentropy_logits,
        optimizers.adam(1e-2),
        train_metrics=[metrics.MovingAverageSparseCategoricalAccuracy()],
        eval_metrics=[metrics.SparseCategoricalAccuracy()],
        devices=ONE_DEVICE,
    )
    compiled = _count_compilations(trainer)
    test = _classification_data("test", loop_forever=False)
    loop = loopax.Loop(trainer)
    hooks.checkpoint(loop, tmp_path / "ckpt", every_n_steps=5)
    hooks.progress_bar(loop, file=io.StringIO())
    hooks.evaluate(loop, [test], every_n_steps=5)
    hooks.tensorboard(loop, tmp_path / "tb", every_n_steps=2)
    hooks.plot(loop, tmp_path / "plots", eval_datasets=[test], render=False)
    hooks.metrics_log(loop, tmp_path / "log.csv", every_n_steps=2)
    hooks.every_n_steps(loop, 3, "noop", lambda loop, m: None)
    hooks.n_times_during_loop(loop, 3, "noop", lambda loop, m: None)
    hooks.exponential_callback(loop, 2, 1.5, "noop", lambda loop, m: None)
    hooks.periodic_callback(loop, 0.001, "noop", lambda loop, m: None)
    loop.run_steps(_classification_data(), 20)
    loop.run_steps(_classification_data(), 5)
    assert [info.graph_type for info in compiled] == ["train", "eval"]
    assert trainer.global_step == 25


def test_learning_rate_changes_between_steps_without_compiling():
    trainer = loopax.Trainer(
        classifier,
        losses.sparse_categorical_crossentropy_logits,
        optimizers.sgd(0.5),
        devices=ONE_DEVICE,
    )
    compiled = _count_compilations(trainer)
    loop = loopax.Loop(trainer)
    data = _classification_data()
    loop.run_steps(data, 2)
    assert float(optimizers.get_learning_rate(trainer.state.opt_state)) == pytest.approx(0.5)

    state = trainer.state
    trainer.state = state.replace(opt_state=optimizers.set_learning_rate(state.opt_state, 0.0))
    frozen = jax.device_get(trainer.params)
    loop.run_steps(data, 3)
    # A learning rate of 0 leaves the parameters where they were: the new rate is used.
    for before, after in zip(
        jax.tree.leaves(frozen), jax.tree.leaves(jax.device_get(trainer.params)), strict=True
    ):
        np.testing.assert_array_equal(before, after)
    assert float(optimizers.get_learning_rate(trainer.state.opt_state)) == 0.0
    assert len(compiled) == 1
