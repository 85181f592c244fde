"""Hooks that watch a loss's auxiliary output (`train/<aux name>`), named before it is known.

A loss returning `(loss, {name: value})` shows its names only when the first train step is
traced; `early_stopping`, `reduce_lr_on_plateau` and `checkpoint(best_metric=...)` accept such
a key at attach and check it after the first step. The loss is scripted (`monitor_helpers`):
its value is the mean of the batch's second label, and its aux output `doubled` twice that,
so every value below is exact.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from monitor_helpers import ScriptedEpochs, scripted_loss, train_data

import loopax
from loopax import hooks

ONE_DEVICE = jax.devices()[:1]
HOOKS = ("early_stopping", "reduce_lr_on_plateau", "checkpoint")


def model_fn(ctx, spec, inputs):
    return nn.Dense(1)(nn.Dense(4)(inputs[0]))


def loss_with_aux(labels, predictions):
    loss = scripted_loss(labels, predictions)
    return loss, {"doubled": 2 * jnp.mean(labels[1])}


def new_trainer(loss_fn=loss_with_aux, **options):
    return loopax.Trainer(
        model_fn, loss_fn, loopax.optimizers.sgd(0.1), devices=ONE_DEVICE, **options
    )


def record_params(loop):
    """{global step: host copy of the parameters after that step}."""
    params = {}
    loop.on_step(
        "record",
        lambda lp, m: params.update({lp.trainer.global_step: jax.device_get(lp.trainer.params)}),
        loopax.Priority.UI,
    )
    return params


def assert_trees_equal(expected, actual):
    expected, actual = jax.device_get(expected), jax.device_get(actual)
    assert jax.tree.structure(expected) == jax.tree.structure(actual)
    for want, got in zip(jax.tree.leaves(expected), jax.tree.leaves(actual), strict=True):
        np.testing.assert_array_equal(np.asarray(want), np.asarray(got))


def attach(name, loop, key, tmp_path):
    if name == "early_stopping":
        return hooks.early_stopping(loop, key, mode="min", patience=2)
    if name == "reduce_lr_on_plateau":
        return hooks.reduce_lr_on_plateau(loop, key, mode="min", patience=1, factor=0.5)
    return hooks.checkpoint(loop, tmp_path, every_n_steps=2, best_metric=key, best_mode="min")


# -- the trainer tells when the names are known ----------------------------------------------


def test_loss_aux_names_are_known_once_a_train_step_is_compiled_and_stay_known():
    trainer = new_trainer()
    assert trainer.loss_aux_names is None
    assert trainer.train_metric_names == ("loss", "moving_average_loss")
    loopax.Loop(trainer).run_steps(train_data(), 1)
    assert trainer.loss_aux_names == ("doubled",)
    # Rebuilding the step bodies (nan_guard's skipping, a per-step update) keeps them.
    trainer.skip_non_finite_steps(True)
    trainer.add_per_step_update(lambda params: params)
    assert trainer.loss_aux_names == ("doubled",)
    assert trainer.train_metric_names == ("loss", "moving_average_loss", "skipped_steps", "doubled")


def test_a_trainer_whose_loss_cannot_return_aux_knows_at_once_that_there_are_none():
    assert new_trainer(loopax.losses.mean_squared_error).loss_aux_names == ()
    assert new_trainer(loopax.losses.huber(delta=2.0)).loss_aux_names == ()
    assert new_trainer(None).loss_aux_names == ()
    trainer = new_trainer(lambda labels, predictions: scripted_loss(labels, predictions))
    assert trainer.loss_aux_names is None
    loopax.Loop(trainer).run_steps(train_data(), 1)
    assert trainer.loss_aux_names == ()


# -- the hooks work end to end on an aux metric named before the first step -------------------


def test_early_stopping_on_an_aux_metric_stops_and_restores_the_best():
    loop = loopax.Loop(new_trainer())
    stopper = hooks.early_stopping(loop, "train/doubled", patience=2)
    params = record_params(loop)
    loop.run_epochs(ScriptedEpochs([1.0, 0.5, 0.75, 0.5, 0.25]), 10)
    # Epochs of 2 steps end at global steps 2, 4, 6, 8: no improvement at 6 and 8 stops.
    assert loop.history["train/doubled"] == [(2, 2.0), (4, 1.0), (6, 1.5), (8, 1.0)]
    assert loop.trainer.global_step == 8 and stopper.stopped_step == 8
    assert (stopper.best, stopper.best_step, stopper.mode) == (1.0, 4, "min")
    assert_trees_equal(params[4], loop.trainer.params)


def test_early_stopping_on_an_aux_metric_in_fused_steps():
    loop = loopax.Loop(new_trainer(), steps_per_execution=2)
    stopper = hooks.early_stopping(loop, "train/doubled", patience=2)
    loop.run_epochs(ScriptedEpochs([1.0, 0.5, 0.75, 0.5, 0.25]), 10)
    assert loop.history["train/doubled"] == [(2, 2.0), (4, 1.0), (6, 1.5), (8, 1.0)]
    assert (stopper.stopped_step, stopper.best_step) == (8, 4)


def test_reduce_lr_on_plateau_on_an_aux_metric_lowers_the_rate():
    loop = loopax.Loop(new_trainer())
    plateau = hooks.reduce_lr_on_plateau(loop, "train/doubled", patience=1, factor=0.5)
    loop.run_epochs(ScriptedEpochs([1.0, 1.0, 0.5, 0.5]), 4)
    assert loop.history["train/doubled"] == [(2, 2.0), (4, 2.0), (6, 1.0), (8, 1.0)]
    assert [step for step, _ in plateau.reductions] == [4, 8]
    assert [rate for _, rate in plateau.reductions] == pytest.approx([0.05, 0.025])


def test_checkpoint_keeps_the_best_by_an_aux_metric(tmp_path):
    loop = loopax.Loop(new_trainer())
    params = record_params(loop)
    checkpointer = hooks.checkpoint(
        loop, tmp_path, every_n_steps=2, keep=1, best_metric="train/doubled", best_mode="min"
    )
    loop.run_epochs(ScriptedEpochs([1.0, 0.25, 0.75, 0.5]), 4)
    checkpointer.wait()
    assert checkpointer.best_step() == 4 and checkpointer.all_steps() == [4, 8]
    fresh = loopax.Loop(new_trainer())
    restored = hooks.checkpoint(fresh, tmp_path, best_metric="train/doubled", restore=False)
    restored.restore_best()
    assert fresh.trainer.global_step == 4
    assert_trees_equal(params[4], fresh.trainer.params)


# -- a misspelled aux name fails at the first step, naming the metrics there are ---------------


@pytest.mark.parametrize("name", HOOKS)
def test_a_misspelled_aux_name_fails_at_the_first_step_listing_the_metrics(name, tmp_path):
    loop = loopax.Loop(new_trainer())
    attach(name, loop, "train/dubled", tmp_path)  # accepted: the names are not known yet
    listed = (
        r"\['train/loss', 'train/moving_average_loss', 'train/doubled'\]"
        if name != "checkpoint"
        else r"\['loss', 'moving_average_loss', 'doubled'\]"
    )
    with pytest.raises(loopax.HookError, match=rf"failed at step 0 \(global step 1\).*{listed}"):
        loop.run_epochs(ScriptedEpochs([1.0]), 3)
    assert loop.trainer.global_step == 1


@pytest.mark.parametrize("name", HOOKS)
def test_where_the_names_are_known_a_misspelled_one_fails_at_attach(name, tmp_path):
    compiled = new_trainer()
    loopax.Loop(compiled).run_steps(train_data(), 1)
    # After a compile, for a loss of loopax.losses, and without a loss function.
    for trainer in (compiled, new_trainer(loopax.losses.mean_squared_error), new_trainer(None)):
        loop = loopax.Loop(trainer)
        with pytest.raises(ValueError, match="train/dubled"):
            attach(name, loop, "train/dubled", tmp_path)
        assert loop.hooks("OnStep") == []


@pytest.mark.parametrize("name", HOOKS)
def test_the_gradient_norms_are_known_at_attach_with_log_grad_norm(name, tmp_path):
    for key in ("train/grad_norm", "train/update_norm"):
        loop = loopax.Loop(new_trainer(log_grad_norm=True))
        attach(name, loop, key, tmp_path / key.replace("/", "_"))
        assert not any("metric check" in hook for _, hook in loop.hooks("OnStep"))
    # Without log_grad_norm, a loss of loopax.losses has no such metric: refused at once.
    trainer = new_trainer(loopax.losses.mean_squared_error)
    with pytest.raises(ValueError, match="train/grad_norm"):
        attach(name, loopax.Loop(trainer), "train/grad_norm", tmp_path)
