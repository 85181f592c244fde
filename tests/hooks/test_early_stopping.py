"""`early_stopping` with real Loops, Trainers, evaluations and Orbax checkpoints.

The model's loss is scripted: its value is the mean of the batch's second label (its
gradient the squared error's), so every evaluation (and every train step) reports exactly
the value the test chose, while the parameters and BatchNorm statistics really train.
"""

import math

import flax.linen as nn
import jax
import numpy as np
import pytest
from monitor_helpers import ScriptedEpochs, ScriptedEval, scripted_loss, train_data

import loopax
from loopax import hooks

ONE_DEVICE = jax.devices()[:1]
MONITOR = "eval/test/mean_loss"


def model_fn(ctx, spec, inputs):
    hidden = nn.Dense(4)(inputs[0])
    hidden = nn.BatchNorm(use_running_average=not ctx.training, momentum=0.5)(hidden)
    return nn.Dense(1)(hidden)


def scripted_metric(name, metric_type):
    return loopax.metrics.Mean(name, lambda labels, predictions: labels[1], metric_type=metric_type)


def new_trainer():
    return loopax.Trainer(
        model_fn,
        scripted_loss,
        loopax.optimizers.sgd(0.1),
        eval_metrics=[scripted_metric("Score", "accuracy"), scripted_metric("Spread", "")],
        devices=ONE_DEVICE,
    )


@pytest.fixture(scope="module")
def compiled():
    # Compiling costs a second, a step microseconds: one trainer for the module's tests.
    trainer = new_trainer()
    initial = []
    trainer.add_state_initializer(lambda state: initial.append(jax.device_get(state)) or state)
    loopax.Loop(trainer).run_steps(train_data(), 1)
    trainer.evaluate(ScriptedEval([0.0]))
    compilations = []
    trainer.on_exec_creation(compilations.append)
    return trainer, initial[0], compilations


@pytest.fixture
def trainer(compiled):
    """The shared trainer back at its initial state (step 0); compiling again fails the test."""
    trainer, initial, compilations = compiled
    trainer.state = jax.tree.map(np.array, initial)
    compilations.clear()
    yield trainer
    assert compilations == [], "a test compiled a step again"


def record_states(loop):
    """{global step: host copy of the train state after that step's OnStep hooks}."""
    states = {}

    def record(loop, metrics):
        state = jax.device_get(loop.trainer.state)
        states[loop.trainer.global_step] = jax.tree.map(np.array, state)

    loop.on_step("record states", record, loopax.Priority.UI)
    return states


def assert_trees_equal(expected, actual):
    expected, actual = jax.device_get(expected), jax.device_get(actual)
    assert jax.tree.structure(expected) == jax.tree.structure(actual)
    for want, got in zip(jax.tree.leaves(expected), jax.tree.leaves(actual), strict=True):
        np.testing.assert_array_equal(np.asarray(want), np.asarray(got))


def trees_equal(a, b):
    return all(
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def scripted_run(trainer, values, steps=20, *, every=2, **kwargs):
    """Evaluates `values` every `every` steps under an early_stopping(MONITOR, **kwargs)."""
    loop = loopax.Loop(trainer)
    hooks.evaluate(loop, ScriptedEval(values), every_n_steps=every)
    stopper = hooks.early_stopping(loop, kwargs.pop("monitor", MONITOR), **kwargs)
    states = record_states(loop)
    loop.run_steps(train_data(), steps)
    return loop, stopper, states


# -- stopping --------------------------------------------------------------------------------


def test_stops_after_patience_checks_without_improvement_and_restores_the_best(trainer):
    loop, stopper, states = scripted_run(trainer, [1.0, 0.5, 0.75, 0.5, 0.625, 0.25], patience=3)
    # Checks at global steps 2, 4, 6, 8, 10: the best is 0.5 at step 4, and the three
    # checks after it (0.75, an equal 0.5, 0.625) do not improve on it.
    assert loop.history[MONITOR] == [(2, 1.0), (4, 0.5), (6, 0.75), (8, 0.5), (10, 0.625)]
    assert trainer.global_step == loop.loop_step == 10
    assert (stopper.best, stopper.best_step, stopper.wait, stopper.checks) == (0.5, 4, 3, 5)
    assert stopper.stopped_step == 10 and stopper.restored_step == 4
    assert loop.stop_reason == stopper.stop_reason
    assert "eval/test/mean_loss did not improve on 0.5 (step 4) in 3 checks" in loop.stop_reason
    # The parameters and BatchNorm statistics of step 4; the optimizer state and the
    # step stay those of the training's last step.
    state = trainer.state
    assert_trees_equal(states[4].params, state.params)
    assert_trees_equal(states[4].model_state, state.model_state)
    assert not trees_equal(states[4].model_state, states[10].model_state)
    assert_trees_equal(states[10].opt_state, state.opt_state)
    assert int(state.step) == 10
    assert_trees_equal(states[4].params, stopper.best_params)


def test_the_stop_and_the_restore_print_one_line_each_unless_quiet(trainer, capsys):
    scripted_run(trainer, [1.0, 0.5, 0.75, 0.5, 0.625], patience=3)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "early stopping: eval/test/mean_loss did not improve on 0.5 (step 4) in 3 checks; "
        "stopped at step 10",
        "early_stopping(eval/test/mean_loss): restored the parameters of step 4",
    ]
    scripted_run(trainer, [1.0, 0.5, 0.75, 0.5, 0.625], patience=3, verbose=False)
    assert capsys.readouterr().out == ""
    with pytest.raises(ValueError, match="verbose must be True or False, got 1"):
        scripted_run(trainer, [1.0], verbose=1)


def test_restore_best_false_keeps_the_last_parameters(trainer):
    loop, stopper, states = scripted_run(
        trainer, [1.0, 0.5, 0.75, 0.5, 0.625], patience=3, restore_best=False
    )
    assert stopper.stopped_step == 10 and stopper.restored_step is None
    assert stopper.best_params is None
    assert_trees_equal(states[10].params, trainer.params)
    assert_trees_equal(states[10].model_state, trainer.state.model_state)


def test_a_run_that_does_not_stop_early_still_ends_with_the_best_parameters(trainer):
    # Keras before 3 restored only after an early stop (keras-team/keras#12511).
    loop, stopper, states = scripted_run(trainer, [1.0, 0.25, 0.5, 0.75], steps=8, patience=5)
    assert stopper.stopped_step is None and loop.stop_reason is None
    assert trainer.global_step == 8 and stopper.wait == 2
    assert stopper.restored_step == 4
    assert_trees_equal(states[4].params, trainer.params)
    assert_trees_equal(states[4].model_state, trainer.state.model_state)


def test_the_best_at_the_last_check_leaves_the_trainer_as_it_is(trainer):
    loop, stopper, states = scripted_run(trainer, [1.0, 0.75, 0.5], steps=6, patience=2)
    assert stopper.best_step == 6 and stopper.restored_step is None
    assert_trees_equal(states[6].params, trainer.params)


@pytest.mark.parametrize(
    ("min_delta", "stopped_step", "best_step"),
    [
        (0.0, None, 8),  # every check improves
        (0.1, 8, 6),  # 0.5625 is not below 0.625 - 0.1
        (0.2, 6, 4),  # 0.625 is not below 0.75 - 0.2
        (0.25, 4, 2),  # 0.75 is not *more* than 0.25 below 1.0
    ],
)
def test_min_delta(trainer, min_delta, stopped_step, best_step):
    loop, stopper, _ = scripted_run(
        trainer, [1.0, 0.75, 0.625, 0.5625], steps=8, patience=1, min_delta=min_delta
    )
    assert stopper.stopped_step == stopped_step
    assert stopper.best_step == best_step
    assert trainer.global_step == (stopped_step or 8)


def test_baseline_not_beaten_stops_after_patience_checks_even_while_improving(trainer):
    loop, stopper, states = scripted_run(
        trainer, [0.9, 0.8, 0.7, 0.6, 0.4], patience=3, baseline=0.5
    )
    assert stopper.stopped_step == 6
    assert "did not improve on baseline 0.5" in stopper.stop_reason
    # The best of the checks that ran, as Keras documents.
    assert (stopper.best, stopper.best_step) == (pytest.approx(0.7), 6)


def test_baseline_beaten_resets_the_wait(trainer):
    loop, stopper, states = scripted_run(
        trainer, [0.9, 0.4, 0.45, 0.45, 0.45], patience=2, baseline=0.5
    )
    assert stopper.stopped_step == 8
    assert (stopper.best, stopper.best_step) == (pytest.approx(0.4), 4)
    assert_trees_equal(states[4].params, trainer.params)


def test_nan_and_infinity_never_improve(trainer):
    loop, stopper, _ = scripted_run(trainer, [1.0, math.nan, -math.inf, 0.5], patience=2)
    assert stopper.stopped_step == 6 and (stopper.best, stopper.best_step) == (1.0, 2)


@pytest.mark.parametrize("baseline", [None, 0.5])
def test_a_monitor_that_is_never_finite_stops_with_a_reason(trainer, baseline):
    _, stopper, _ = scripted_run(trainer, [math.nan] * 5, patience=2, baseline=baseline)
    assert stopper.stopped_step == 4 and stopper.best is None
    assert f"{MONITOR} had no finite value in 2 checks" in stopper.stop_reason


def test_patience_zero_acts_as_one(trainer):
    loop, stopper, _ = scripted_run(trainer, [1.0, 0.5, 0.5, 0.25], patience=0)
    assert stopper.stopped_step == 6


# -- mode ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("monitor", "mode", "stopped_step", "best"),
    [
        (MONITOR, "auto", 6, (0.5, 2)),  # a loss: lower is better
        (MONITOR, "min", 6, (0.5, 2)),
        (MONITOR, "max", 8, (0.75, 4)),
        ("eval/test/Score", "auto", 8, (0.75, 4)),  # an accuracy: higher is better
        ("eval/test/Spread", "max", 8, (0.75, 4)),  # no known type: the mode is given
    ],
)
def test_modes(trainer, monitor, mode, stopped_step, best):
    loop, stopper, _ = scripted_run(
        trainer, [0.5, 0.75, 0.625, 0.75, 0.7], patience=2, monitor=monitor, mode=mode
    )
    assert stopper.stopped_step == stopped_step
    assert (stopper.best, stopper.best_step) == best


def test_auto_mode_of_the_trainers_own_metrics():
    # Registration alone compiles nothing.
    trainer = loopax.Trainer(
        model_fn,
        loopax.losses.sparse_categorical_crossentropy_logits,
        loopax.optimizers.sgd(0.1),
        train_metrics=[loopax.metrics.MovingAverageSparseCategoricalAccuracy()],
        eval_metrics=[loopax.metrics.SparseCategoricalAccuracy()],
        devices=ONE_DEVICE,
    )
    loop = loopax.Loop(trainer)
    modes = {
        key: hooks.early_stopping(loop, key).mode
        for key in (
            "eval/test/mean_loss",
            "eval/my/data/Accuracy",
            "train/loss",
            "train/moving_average_loss",
            "train/Moving Average Accuracy",
        )
    }
    assert modes == {
        "eval/test/mean_loss": "min",
        "eval/my/data/Accuracy": "max",
        "train/loss": "min",
        "train/moving_average_loss": "min",
        "train/Moving Average Accuracy": "max",
    }


def test_auto_mode_refuses_a_metric_of_unknown_type(compiled):
    loop = loopax.Loop(compiled[0])
    with pytest.raises(
        ValueError,
        match=r"mode='auto' cannot tell whether 'eval/test/Spread' "
        r"\(metric type 'Spread'\).*Pass mode='min' or mode='max'",
    ):
        hooks.early_stopping(loop, "eval/test/Spread")
    assert hooks.early_stopping(loop, "eval/test/Spread", mode="min").mode == "min"


# -- registration errors ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"monitor": "val_loss"},
            r"monitor='val_loss' is not one of this trainer's metric keys.*"
            r"\['train/loss', 'train/moving_average_loss'\].*'eval/<dataset>/"
            r"<metric>' with <metric> in \['mean_loss', 'Score', 'Spread'\]",
        ),
        ({"monitor": "eval/test/Accuracy"}, "not one of this trainer's metric keys"),
        ({"monitor": "eval/mean_loss"}, "not one of this trainer's metric keys"),
        ({"monitor": "train/mean_loss"}, "not one of this trainer's metric keys"),
        ({"monitor": "train/learning_rate"}, "not one of this trainer's metric keys"),
        ({"monitor": None}, "not one of this trainer's metric keys"),
        ({"mode": "lower"}, r"mode must be one of \['auto', 'min', 'max'\], got mode='lower'"),
        ({"patience": -1}, "patience must be an int >= 0, got patience=-1"),
        ({"patience": 2.5}, "patience must be an int >= 0"),
        ({"patience": True}, "patience must be an int >= 0"),
        ({"min_delta": -0.1}, "min_delta must be >= 0.0, got min_delta=-0.1"),
        ({"min_delta": math.nan}, "min_delta must be a finite number"),
        ({"baseline": math.inf}, "baseline must be a finite number"),
        ({"baseline": "0.5"}, "baseline must be a finite number"),
        ({"restore_best": "yes"}, "restore_best must be True or False"),
    ],
)
def test_bad_arguments_raise_at_registration(compiled, kwargs, message):
    loop = loopax.Loop(compiled[0])
    monitor = kwargs.pop("monitor", MONITOR)
    with pytest.raises(ValueError, match=message):
        hooks.early_stopping(loop, monitor, **kwargs)
    assert loop.hooks("OnEvaluation") == [] and loop.get_state()["hooks"] == {}


def test_needs_a_loop(compiled):
    with pytest.raises(TypeError, match="early_stopping needs a loopax.Loop, got Trainer"):
        hooks.early_stopping(compiled[0], MONITOR)


def test_warns_when_the_monitor_is_never_checked(trainer):
    loop = loopax.Loop(trainer)
    hooks.early_stopping(loop, MONITOR)
    with pytest.warns(
        RuntimeWarning,
        match=r"never checked 'eval/test/mean_loss': no evaluation "
        r"of a dataset named 'test'.*hooks.evaluate",
    ):
        loop.run_steps(train_data(), 3)


# -- train metrics at epoch ends -------------------------------------------------------------


def test_a_train_metric_is_checked_at_each_epoch_end(trainer):
    loop = loopax.Loop(trainer)
    stopper = hooks.early_stopping(loop, "train/loss", patience=2)
    states = record_states(loop)
    data = ScriptedEpochs([1.0, 0.5, 0.75, 0.5, 0.25])
    loop.run_epochs(data, 10)
    # Epochs of 2 steps end at global steps 2, 4, 6, 8; the stop at the fourth's end
    # ends the run.
    assert loop.history["train/loss"] == [(2, 1.0), (4, 0.5), (6, 0.75), (8, 0.5)]
    assert trainer.global_step == 8 and stopper.stopped_step == 8 and loop.epoch == 4
    assert (stopper.best, stopper.best_step) == (0.5, 4)
    assert_trees_equal(states[4].params, trainer.params)


def test_flax_trainings_documented_example_stops_where_flax_does_at_one_more_patience(trainer):
    # flax.training.early_stopping's example: patience 2 and min_delta 1e-3 on these epoch
    # losses "break at epoch 7" (0-based). flax stops at the first check after `patience`
    # checks without improvement; loopax, as Keras, at the `patience`-th such check. So
    # flax's patience p is loopax's p + 1 (docs/guides/coming-from.md says so).
    from flax.training.early_stopping import EarlyStopping  # noqa: PLC0415

    losses = [4.0, 3.0, 3.0, 3.0, 2.0, 2.0, 2.0, 2.0, 1.0, 1.0]
    flax_stop = EarlyStopping(min_delta=1e-3, patience=2)
    flax_epochs = 0
    for loss in losses:
        flax_epochs += 1
        flax_stop = flax_stop.update(loss)
        if flax_stop.should_stop:
            break
    assert flax_epochs == 8  # epochs 0..7
    for patience, epochs in ((2, 4), (3, flax_epochs)):
        loop = loopax.Loop(trainer)
        stopper = hooks.early_stopping(loop, "train/loss", patience=patience, min_delta=1e-3)
        loop.run_epochs(ScriptedEpochs(losses), len(losses))
        assert loop.epoch == epochs, patience
        assert stopper.stopped_step is not None and stopper.wait == patience


def test_a_train_monitor_in_run_steps_warns(trainer):
    loop = loopax.Loop(trainer)
    hooks.early_stopping(loop, "train/moving_average_loss")
    with pytest.warns(RuntimeWarning) as warned:
        loop.run_steps(train_data(), 2)
    messages = [str(w.message) for w in warned]
    assert any("run at epoch ends, which only run_epochs has" in m for m in messages)
    assert any(
        "never checked 'train/moving_average_loss': train metrics are checked at the "
        "epoch ends of run_epochs" in m
        for m in messages
    )


# -- across runs -----------------------------------------------------------------------------


def test_chunked_runs_train_as_one_run_while_showing_the_best_between_them(trainer, compiled):
    values = [1.0, 0.5, 0.75, 0.75, 0.75, 0.75]
    loop = loopax.Loop(trainer)
    hooks.evaluate(loop, ScriptedEval(values), every_n_steps=2)
    stopper = hooks.early_stopping(loop, MONITOR, patience=10)
    chunked = record_states(loop)
    data = train_data()
    loop.run_steps(data, 6)
    assert stopper.restored_step == 4
    assert_trees_equal(chunked[4].params, trainer.params)
    loop.run_steps(data, 6)
    assert_trees_equal(chunked[4].params, trainer.params)

    trainer.state = jax.tree.map(np.array, compiled[1])
    _, _, single = scripted_run(trainer, values, steps=12, patience=10)
    # The second run trained on from the training's own parameters, not the best ones.
    for step in (6, 7, 12):
        assert_trees_equal(single[step].params, chunked[step].params)
        assert_trees_equal(single[step].model_state, chunked[step].model_state)


def test_after_a_stop_later_runs_stop_at_once_until_reset(trainer):
    loop, stopper, states = scripted_run(trainer, [1.0, 0.5, 0.75, 0.75, 0.75], patience=2)
    assert stopper.stopped_step == 8
    data = train_data()
    with pytest.warns(
        RuntimeWarning, match=r"stopped this training at step 8.*Call reset\(\)"
    ) as caught:
        loop.run_steps(data, 5)
    # The warning points at the user's line (the run_steps call), never into loopax.
    assert caught[0].filename == __file__, caught[0].filename
    assert trainer.global_step == 8
    assert_trees_equal(states[4].params, trainer.params)

    stopper.reset()
    assert (stopper.best, stopper.wait, stopper.stopped_step, stopper.best_params) == (
        None,
        0,
        None,
        None,
    )
    loop.run_steps(data, 4)
    assert trainer.global_step == 12
    # Trained on from step 8's own parameters: step 9 is no repetition of step 5.
    assert not trees_equal(states[5].params, states[9].params)
    assert stopper.checks == 6 and stopper.best_step == 10


def test_parameters_replaced_between_runs_are_not_overwritten(trainer, compiled):
    chosen = jax.tree.map(np.array, compiled[1]).replace(step=np.asarray(6, np.int32))
    trainer.state = chosen
    reference_loop = loopax.Loop(trainer)
    reference = record_states(reference_loop)
    reference_loop.run_steps(train_data(), 1)

    trainer.state = jax.tree.map(np.array, compiled[1])
    loop, stopper, states = scripted_run(trainer, [1.0, 0.5, 0.75], steps=6, patience=5)
    assert stopper.restored_step == 4
    trainer.state = chosen  # between the runs, by hand
    loop.run_steps(train_data(), 1)
    assert_trees_equal(reference[7].params, states[7].params)


# -- checkpoints and resume ------------------------------------------------------------------


def test_the_last_checkpoint_holds_the_training_state_not_the_best(trainer, tmp_path):
    loop = loopax.Loop(trainer)
    checkpointer = hooks.checkpoint(loop, tmp_path)
    hooks.evaluate(loop, ScriptedEval([1.0, 0.5, 0.75, 0.75]), every_n_steps=2)
    stopper = hooks.early_stopping(loop, MONITOR, patience=2)
    states = record_states(loop)
    loop.run_steps(train_data(), 20)
    assert stopper.stopped_step == 8 and checkpointer.all_steps() == [8]
    assert_trees_equal(states[4].params, trainer.params)

    reader = new_trainer()
    hooks.checkpoint(loopax.Loop(reader), tmp_path)
    assert reader.global_step == 8
    assert_trees_equal(states[8].params, reader.params)
    assert_trees_equal(states[8].model_state, reader.state.model_state)


@pytest.mark.parametrize("checkpoint_first", [True, False])
def test_a_resumed_run_continues_the_patience_count(trainer, tmp_path, checkpoint_first):
    loop = loopax.Loop(trainer)
    hooks.checkpoint(loop, tmp_path)
    hooks.evaluate(loop, ScriptedEval([1.0, 0.5, 0.75, 0.75]), every_n_steps=2)
    stopper = hooks.early_stopping(loop, MONITOR, patience=3)
    loop.run_steps(train_data(), 8)
    assert (stopper.wait, stopper.best_step, stopper.stopped_step) == (2, 4, None)

    # A new process: a new trainer and loop resume from the checkpoint of step 8.
    resumed_trainer = new_trainer()
    resumed = loopax.Loop(resumed_trainer)
    if checkpoint_first:
        hooks.checkpoint(resumed, tmp_path)
    hooks.evaluate(resumed, ScriptedEval([0.75]), every_n_steps=2)
    restarted = hooks.early_stopping(resumed, MONITOR, patience=3)
    if not checkpoint_first:
        hooks.checkpoint(resumed, tmp_path)
    assert (restarted.best, restarted.best_step, restarted.wait, restarted.checks) == (0.5, 4, 2, 4)
    # The best parameters (step 4) were in the first process's memory only: it says so.
    with pytest.warns(
        RuntimeWarning,
        match=r"best eval/test/mean_loss \(0.5\) was at step 4, "
        r"before the training last resumed from a checkpoint.*best_metric="
        r"'eval/test/mean_loss', best_mode='min'\) and call its restore_best",
    ):
        resumed.run_steps(train_data(), 20)
    # One more check without improvement: the third, not the first of three.
    assert restarted.stopped_step == 10 and resumed_trainer.global_step == 10
    assert restarted.wait == 3 and restarted.checks == 5
    assert restarted.restored_step is None


def test_a_resumed_process_after_a_stop_trains_no_further(trainer, tmp_path, compiled, capsys):
    loop = loopax.Loop(trainer)
    hooks.checkpoint(loop, tmp_path)
    hooks.evaluate(loop, ScriptedEval([1.0, 0.5, 0.75, 0.75]), every_n_steps=2)
    hooks.early_stopping(loop, MONITOR, patience=2)
    loop.run_to_step(train_data(), 20)
    assert trainer.global_step == 8

    trainer.state = jax.tree.map(np.array, compiled[1])  # as a fresh process would start
    resumed = loopax.Loop(trainer)
    hooks.checkpoint(resumed, tmp_path)
    hooks.evaluate(resumed, ScriptedEval([0.75]), every_n_steps=2)
    restarted = hooks.early_stopping(resumed, MONITOR, patience=2)
    capsys.readouterr()
    with pytest.warns(RuntimeWarning) as warned:
        resumed.run_to_step(train_data(), 20)
    assert trainer.global_step == 8 and restarted.stopped_step == 8
    # The training ended in the first process: said in one line, not as a warning.
    assert "this training already ended: stopped early at step 8 (" in capsys.readouterr().out
    # What is warned: no checkpoint keeps the best parameters, so they cannot come back.
    assert [str(w.message) for w in warned] == [
        f"early_stopping({MONITOR}): the best {MONITOR} (0.5) was at step 4, before the "
        "training last resumed from a checkpoint, so those parameters are not in memory and "
        "the trainer keeps those of step 8. To get them back, attach hooks.checkpoint(loop, "
        f"directory, best_metric='{MONITOR}', best_mode='min') and call its restore_best()"
    ]


def test_a_rerun_of_a_finished_run_says_it_ended_and_restores_the_best_from_the_checkpoint(
    trainer, tmp_path, compiled, capsys
):
    def attach(loop, values):
        hooks.checkpoint(loop, tmp_path, every_n_steps=2, best_metric=MONITOR)  # keeps the best
        hooks.evaluate(loop, ScriptedEval(values), every_n_steps=2)
        return hooks.early_stopping(loop, MONITOR, patience=2)

    loop = loopax.Loop(trainer)
    attach(loop, [1.0, 0.5, 0.75, 0.75])
    states = record_states(loop)
    loop.run_to_step(train_data(), 20)
    assert trainer.global_step == 8
    best = jax.device_get((trainer.params, trainer.state.model_state))
    assert_trees_equal(states[4].params, best[0])

    trainer.state = jax.tree.map(np.array, compiled[1])  # as a fresh process would start
    resumed = loopax.Loop(trainer)
    restarted = attach(resumed, [0.75])
    capsys.readouterr()
    resumed.run_to_step(train_data(), 20)  # no warning: any would fail the test
    # One plain line says the training ended (why, where, the best step); the best
    # parameters (step 4) come back from the checkpoint the hook kept: the rerun reports
    # what the first run reported.
    assert capsys.readouterr().out.splitlines() == [
        f"early_stopping({MONITOR}): this training already ended: stopped early at step 8 "
        f"({MONITOR} did not improve on 0.5 (step 4) in 2 checks); best step 4. Nothing is "
        "trained (reset() on the hook trains on)",
        f"early_stopping({MONITOR}): restored the parameters of step 4",
    ]
    assert restarted.restored_step == 4 and trainer.global_step == 8
    assert_trees_equal(best[0], trainer.params)
    assert_trees_equal(best[1], trainer.state.model_state)
