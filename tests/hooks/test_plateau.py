"""`reduce_lr_on_plateau` with real Loops, Trainers, evaluations, TensorBoard event files and
Orbax checkpoints.

The model's loss is scripted: its value is the mean of the batch's second label (its
gradient the squared error's), so every evaluation reports exactly the value the test chose.
"""

import math

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from monitor_helpers import ScriptedEpochs, ScriptedEval, scripted_loss, train_data
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import loopax
from loopax import hooks

ONE_DEVICE = jax.devices()[:1]
MONITOR = "eval/test/mean_loss"
RATE = 0.1


def model_fn(ctx, spec, inputs):
    return nn.Dense(1)(nn.Dense(4)(inputs[0]))


def new_trainer(optimizer=None):
    return loopax.Trainer(
        model_fn,
        scripted_loss,
        loopax.optimizers.sgd(RATE) if optimizer is None else optimizer,
        eval_metrics=[loopax.metrics.Mean("Spread", lambda labels, predictions: labels[1])],
        devices=ONE_DEVICE,
    )


def warm_up(trainer):
    loopax.Loop(trainer).run_steps(train_data(), 1)
    trainer.evaluate(ScriptedEval([0.0]))


@pytest.fixture(scope="module")
def compiled():
    # Compiling costs a second, a step microseconds: one trainer for the module's tests.
    trainer = new_trainer()
    initial = []
    trainer.add_state_initializer(lambda state: initial.append(jax.device_get(state)) or state)
    warm_up(trainer)
    compilations = []
    trainer.on_exec_creation(compilations.append)
    return trainer, initial[0], compilations


@pytest.fixture
def trainer(compiled):
    """The shared trainer back at its initial state (step 0, rate 0.1); compiling again
    fails the test."""
    trainer, initial, compilations = compiled
    trainer.state = jax.tree.map(np.array, initial)
    compilations.clear()
    yield trainer
    assert compilations == [], "changing the learning rate compiled a step again"


def record_rates(loop):
    """[(global step, learning rate after the step's evaluation hooks)] per evaluation."""
    rates = []
    loop.on_evaluation(
        "record rates",
        lambda loop, evaluation: rates.append((evaluation.step, loop.trainer.learning_rate)),
        loopax.Priority.LOG,
    )
    return rates


def scripted_run(trainer, values, steps, *, every=2, **kwargs):
    loop = loopax.Loop(trainer)
    hooks.evaluate(loop, ScriptedEval(values), every_n_steps=every)
    plateau = hooks.reduce_lr_on_plateau(loop, kwargs.pop("monitor", MONITOR), **kwargs)
    rates = record_rates(loop)
    loop.run_steps(train_data(), steps)
    return loop, plateau, rates


def approx_pairs(pairs):
    return [(step, pytest.approx(rate)) for step, rate in pairs]


# -- the rules -------------------------------------------------------------------------------


def test_every_group_of_a_multi_transform_keeps_its_proportion():
    def group_rates(trainer):
        groups = trainer.state.opt_state.inner_states
        return [float(loopax.optimizers.get_learning_rate(groups[g])) for g in ("fast", "slow")]

    both = optax.multi_transform(
        {"fast": loopax.optimizers.sgd(RATE), "slow": loopax.optimizers.sgd(RATE / 10)},
        lambda params: jax.tree_util.tree_map_with_path(
            lambda path, _: "fast" if "Dense_0" in jax.tree_util.keystr(path) else "slow", params
        ),
    )
    trainer = new_trainer(both)
    warm_up(trainer)
    _, plateau, _ = scripted_run(trainer, [1.0, 1.0, 1.0], 6, patience=2, factor=0.5)
    assert [step for step, _ in plateau.reductions] == [6]
    # Each group halved; set_learning_rate would have given both the first group's rate.
    assert group_rates(trainer) == pytest.approx([RATE / 2, RATE / 20])


def test_patience_and_factor(trainer):
    loop, plateau, rates = scripted_run(
        trainer, [1.0, 0.5, 0.5, 0.75, 0.5, 0.25, 0.5, 0.5], 16, patience=2, factor=0.5
    )
    # Checks at 2, 4, ..., 16: the best 0.5 (step 4) is not beaten at 6 and 8 (an equal
    # value is no improvement): the rate halves after the check of step 8; 0.25 at 12 is
    # a new best, not beaten at 14 and 16: halved again.
    assert plateau.reductions == approx_pairs([(8, 0.05), (16, 0.025)])
    assert rates == approx_pairs(
        [(2, 0.1), (4, 0.1), (6, 0.1), (8, 0.05), (10, 0.05), (12, 0.05), (14, 0.05), (16, 0.025)]
    )
    assert plateau.learning_rate == pytest.approx(0.025) == trainer.learning_rate
    assert (plateau.best, plateau.best_step, plateau.wait, plateau.checks) == (0.25, 12, 0, 8)


def test_min_delta(trainer):
    # 0.875 is not more than 0.2 below 1.0: two checks without improvement.
    _, plateau, _ = scripted_run(
        trainer, [1.0, 0.875, 0.875, 0.5], 8, patience=2, factor=0.5, min_delta=0.2
    )
    assert plateau.reductions == approx_pairs([(6, 0.05)])
    assert (plateau.best, plateau.best_step) == (0.5, 8)
    trainer.state = trainer.state.replace(step=np.zeros((), np.int32))
    _, plateau, _ = scripted_run(trainer, [1.0, 0.875, 0.875, 0.5], 8, patience=2, factor=0.5)
    assert plateau.reductions == []


@pytest.mark.parametrize(
    ("cooldown", "reduced_at"),
    [
        (0, [4, 6, 8, 10, 12]),
        (1, [4, 6, 8, 10, 12]),  # Keras's counting: the check that ends a cooldown counts
        (2, [4, 8, 12]),
        (3, [4, 10]),
    ],
)
def test_cooldown(trainer, cooldown, reduced_at):
    _, plateau, _ = scripted_run(trainer, [1.0], 12, patience=1, factor=0.5, cooldown=cooldown)
    assert [step for step, _ in plateau.reductions] == reduced_at
    assert trainer.learning_rate == pytest.approx(RATE * 0.5 ** len(reduced_at))


def test_min_lr_bounds_the_rate(trainer):
    _, plateau, rates = scripted_run(trainer, [1.0], 12, patience=1, factor=0.5, min_lr=0.03)
    assert plateau.reductions == approx_pairs([(4, 0.05), (6, 0.03)])
    assert [rate for _, rate in rates] == pytest.approx([0.1, 0.05, 0.03, 0.03, 0.03, 0.03])
    # At the floor nothing more happens (as in Keras, the wait keeps counting).
    assert plateau.wait == 3


def test_mode_max_and_auto(trainer):
    _, plateau, _ = scripted_run(
        trainer,
        [0.5, 0.75, 0.75, 0.5],
        8,
        patience=2,
        factor=0.5,
        monitor="eval/test/Spread",
        mode="max",
    )
    assert plateau.mode == "max" and plateau.reductions == approx_pairs([(8, 0.05)])
    with pytest.raises(ValueError, match="mode='auto' cannot tell whether 'eval/test/Spread'"):
        hooks.reduce_lr_on_plateau(loopax.Loop(trainer), "eval/test/Spread")


def test_a_train_metric_is_checked_at_each_epoch_end(trainer):
    loop = loopax.Loop(trainer)
    plateau = hooks.reduce_lr_on_plateau(loop, "train/loss", patience=1, factor=0.5)
    loop.run_epochs(ScriptedEpochs([1.0, 1.0, 0.5, 0.5]), 4)
    assert loop.history["train/loss"] == [(2, 1.0), (4, 1.0), (6, 0.5), (8, 0.5)]
    assert plateau.reductions == approx_pairs([(4, 0.05), (8, 0.025)])


def test_changing_the_rate_never_compiles(trainer, compiled):
    _, plateau, _ = scripted_run(trainer, [1.0], 20, patience=1, factor=0.5)
    assert len(plateau.reductions) == 9 and trainer.global_step == 20
    assert compiled[2] == []  # nothing compiled since the warm-up


def test_the_live_rate_in_tensorboard(trainer, tmp_path):
    loop = loopax.Loop(trainer)
    hooks.evaluate(loop, ScriptedEval([1.0, 1.0, 0.5, 0.5]), every_n_steps=2)
    hooks.reduce_lr_on_plateau(loop, MONITOR, patience=1, factor=0.5)
    hooks.tensorboard(loop, tmp_path, every_n_steps=1)
    loop.run_steps(train_data(), 8)
    events = EventAccumulator(str(tmp_path / "train"), size_guidance={"scalars": 0})
    events.Reload()
    written = [(s.step, s.value) for s in events.Scalars("learning_rate")]
    # The value at global step g is the rate of the steps after g: the reductions decided
    # at the evaluations of steps 4 and 8 show there.
    assert written == approx_pairs(
        [(1, 0.1), (2, 0.1), (3, 0.1), (4, 0.05), (5, 0.05), (6, 0.05), (7, 0.05), (8, 0.025)]
    )
    assert loop.history["train/learning_rate"] == written


# -- which optimizers ------------------------------------------------------------------------


def schedule_labels():
    # multi_transform's labels follow the model's parameters: its init needs their structure.
    dense = {"kernel": "all", "bias": "all"}
    return {"Dense_0": dense, "Dense_1": dense}


@pytest.mark.parametrize(
    "optimizer",
    [
        loopax.optimizers.adam(0.01),
        loopax.optimizers.rmsprop(0.01, clip_global_norm=1.0),
        optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
        optax.chain(
            optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adam)(learning_rate=0.01)
        ),
    ],
)
def test_accepted_optimizers(optimizer):
    plateau = hooks.reduce_lr_on_plateau(loopax.Loop(new_trainer(optimizer)), MONITOR)
    assert plateau.learning_rate is None  # no state before the first step


NO_RATE = (
    r"reduce_lr_on_plateau\('eval/test/mean_loss'\) changes the optimizer's learning "
    r"rate while training, but this optimizer keeps no learning rate in its state.*"
    r"optax.inject_hyperparams\(optax.adam\)\(learning_rate=1e-3\).*"
    r"optax.contrib.reduce_on_plateau cannot be a Trainer's optimizer"
)
SCHEDULED = (
    r"a schedule drives this optimizer's learning rate and would overwrite every "
    r"change at the next step.*loopax.optimizers"
)


@pytest.mark.parametrize(
    ("optimizer", "message"),
    [
        (optax.sgd(0.1), NO_RATE),
        (optax.chain(optax.clip(1.0), optax.adam(0.01)), NO_RATE),
        (loopax.optimizers.sgd(optax.linear_schedule(0.1, 0.01, 100)), SCHEDULED),
        (loopax.optimizers.adam(loopax.optimizers.cosine_decay(0.1, 100)), SCHEDULED),
        (
            optax.inject_hyperparams(optax.sgd)(learning_rate=optax.constant_schedule(0.1)),
            SCHEDULED,
        ),
    ],
)
def test_refused_optimizers_raise_at_registration(optimizer, message):
    loop = loopax.Loop(new_trainer(optimizer))
    with pytest.raises(ValueError, match=message):
        hooks.reduce_lr_on_plateau(loop, MONITOR)
    assert loop.hooks("OnEvaluation") == []


def test_refused_when_the_trainer_has_a_state_too():
    trainer = new_trainer(optax.sgd(0.1))
    warm_up(trainer)
    with pytest.raises(ValueError, match=NO_RATE):
        hooks.reduce_lr_on_plateau(loopax.Loop(trainer), MONITOR)


def test_an_optimizer_built_for_the_parameters_is_checked_at_the_first_step():
    refused = new_trainer(optax.multi_transform({"all": optax.sgd(0.1)}, schedule_labels()))
    loop = loopax.Loop(refused)
    hooks.reduce_lr_on_plateau(loop, MONITOR)  # its init cannot run on stand-in parameters
    with pytest.raises(
        loopax.HookError,
        match="OnStep hook 'reduce_lr_on_plateau.*failed at "
        r"step 0 \(global step 1\): ValueError: .*keeps no learning rate in its state",
    ) as raised:
        loop.run_steps(train_data(), 3)
    assert isinstance(raised.value.__cause__, ValueError)
    assert refused.global_step == 1

    accepted = new_trainer(
        optax.multi_transform(
            {"all": optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)}, schedule_labels()
        )
    )
    loop = loopax.Loop(accepted)
    hooks.evaluate(loop, ScriptedEval([1.0]), every_n_steps=2)
    plateau = hooks.reduce_lr_on_plateau(loop, MONITOR, patience=1, factor=0.5)
    loop.run_steps(train_data(), 4)
    assert plateau.reductions == approx_pairs([(4, 0.05)])
    assert accepted.learning_rate == pytest.approx(0.05)


# -- registration errors ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"monitor": "val_loss"},
            r"monitor='val_loss' is not one of this trainer's metric keys.*"
            r"\['train/loss', 'train/moving_average_loss'\]",
        ),
        (
            {"factor": 1.0},
            r"factor must be between 0 and 1 \(new rate = rate \* factor\), got "
            r"factor=1.0",
        ),
        ({"factor": 0.0}, "factor must be between 0 and 1"),
        ({"factor": 2}, "factor must be between 0 and 1"),
        ({"factor": -0.5}, "factor must be >= 0.0"),
        ({"patience": -1}, "patience must be an int >= 0, got patience=-1"),
        ({"cooldown": 1.5}, "cooldown must be an int >= 0"),
        ({"min_lr": -1e-3}, "min_lr must be >= 0.0"),
        ({"min_lr": math.inf}, "min_lr must be a finite number"),
        ({"min_delta": -1e-4}, "min_delta must be >= 0.0"),
        ({"mode": "down"}, r"mode must be one of \['auto', 'min', 'max'\]"),
    ],
)
def test_bad_arguments_raise_at_registration(kwargs, message):
    loop = loopax.Loop(new_trainer())
    monitor = kwargs.pop("monitor", MONITOR)
    with pytest.raises(ValueError, match=message):
        hooks.reduce_lr_on_plateau(loop, monitor, **kwargs)


# -- checkpoints and resume ------------------------------------------------------------------


def test_a_resumed_run_continues_the_counters_and_the_rate(trainer, tmp_path):
    loop = loopax.Loop(trainer)
    hooks.checkpoint(loop, tmp_path)
    hooks.evaluate(loop, ScriptedEval([1.0, 1.0, 1.0, 0.5, 0.75]), every_n_steps=2)
    plateau = hooks.reduce_lr_on_plateau(loop, MONITOR, patience=2, factor=0.5, cooldown=1)
    loop.run_steps(train_data(), 10)
    assert plateau.reductions == approx_pairs([(6, 0.05)])
    assert (plateau.best, plateau.wait, plateau.cooldown_counter) == (0.5, 1, 0)

    # A new process: a new trainer and loop resume from the checkpoint of step 10.
    resumed_trainer = new_trainer()
    resumed = loopax.Loop(resumed_trainer)
    hooks.checkpoint(resumed, tmp_path)
    assert resumed_trainer.learning_rate == pytest.approx(0.05)  # in the optimizer state
    hooks.evaluate(resumed, ScriptedEval([0.75]), every_n_steps=2)
    restarted = hooks.reduce_lr_on_plateau(resumed, MONITOR, patience=2, factor=0.5, cooldown=1)
    assert (restarted.best, restarted.best_step, restarted.wait, restarted.checks) == (0.5, 8, 1, 5)
    assert restarted.reductions == plateau.reductions
    resumed.run_steps(train_data(), 4)
    # The second check without improvement comes at step 12, not the first.
    assert restarted.reductions == approx_pairs([(6, 0.05), (12, 0.025)])
    assert resumed_trainer.learning_rate == pytest.approx(0.025)
