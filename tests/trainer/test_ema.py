"""`Trainer(ema_decay=...)`: the parameters' exponential moving average, kept in the compiled
step, checkpointed, and used by evaluation and prediction."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import loopax
from loopax import hooks

RNG = np.random.default_rng(0)
X = RNG.normal(size=(256, 6)).astype(np.float32)
Y = (X @ RNG.normal(size=(6, 1)) + 0.1 * RNG.normal(size=(256, 1))).astype(np.float32)
DECAY = 0.8


def model_fn(ctx, spec, inputs):
    return nn.Dense(1)(nn.relu(nn.Dense(8)(inputs[0])))


def make_trainer(devices=1, ema_decay=DECAY, **kwargs):
    return loopax.Trainer(
        model_fn,
        loopax.losses.mean_squared_error,
        optax.adam(0.05),
        devices=jax.devices()[:devices],
        ema_decay=ema_decay,
        **kwargs,
    )


def data(**kwargs):
    return loopax.ArrayDataset(X, Y, 32, loop_forever=True, **kwargs)


def eval_data():
    return loopax.ArrayDataset(X, Y, 48, shuffle=False, drop_remainder=False, name="eval")


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def assert_trees(want, got, exact=True):
    assert jax.tree.structure(want) == jax.tree.structure(got)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        if exact:
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def initial_params():
    trainer = make_trainer(ema_decay=None)
    trainer.train_step(None, [X[:32]], [Y[:32]])
    return host(trainer.params)  # any parameters of the model's shapes


def test_the_average_follows_the_formula_from_each_steps_parameters():
    start = initial_params()
    trainer = make_trainer(init_params=start)
    expected = start  # it starts at the initial parameters
    for step in range(6):
        batch = slice(32 * step, 32 * (step + 1))
        trainer.train_step(None, [X[batch]], [Y[batch]])
        params = host(trainer.params)
        expected = jax.tree.map(lambda e, p: DECAY * e + (1 - DECAY) * p, expected, params)
        assert_trees(expected, host(trainer.ema_params), exact=False)
    assert trainer.state_dict()["ema_params"].keys() == start.keys()
    assert make_trainer(ema_decay=None, init_params=start).ema_params is None


def test_evaluation_and_prediction_use_the_average():
    trainer = make_trainer()
    loopax.Loop(trainer).run_steps(data(), 10)
    by_hand = make_trainer(ema_decay=None, init_params=host(trainer.ema_params))
    raw = make_trainer(ema_decay=None, init_params=host(trainer.params))
    assert trainer.evaluate(eval_data()) == by_hand.evaluate(eval_data())
    assert trainer.evaluate(eval_data()) != raw.evaluate(eval_data())
    np.testing.assert_array_equal(trainer.predict(X), by_hand.predict(X))
    assert trainer.params is not None and not np.array_equal(
        host(trainer.params)["Dense_0"]["kernel"], host(trainer.ema_params)["Dense_0"]["kernel"]
    )


@pytest.mark.parametrize(("devices", "steps_per_execution"), [(1, 32), (4, 1), (4, 32)])
def test_devices_and_fused_steps_keep_the_same_average(devices, steps_per_execution):
    reference = make_trainer()
    loopax.Loop(reference).run_steps(data(), 40)
    trainer = make_trainer(devices)
    loopax.Loop(trainer, steps_per_execution=steps_per_execution).run_steps(data(), 40)
    assert_trees(host(reference.ema_params), host(trainer.ema_params), exact=devices == 1)


def test_a_resume_continues_the_average_bit_for_bit(tmp_path):
    uninterrupted = make_trainer()
    loopax.Loop(uninterrupted).run_steps(data(), 12)

    first = make_trainer()
    loop = loopax.Loop(first)
    hooks.checkpoint(loop, tmp_path)
    loop.run_to_step(data(), 5)
    resumed = make_trainer()
    loop = loopax.Loop(resumed)
    hooks.checkpoint(loop, tmp_path).wait()
    assert resumed.global_step == 5
    assert_trees(host(first.ema_params), host(resumed.ema_params))
    loop.run_to_step(data(), 12)
    assert_trees(host(uninterrupted.ema_params), host(resumed.ema_params))
    assert_trees(host(uninterrupted.params), host(resumed.params))


def test_checkpoints_with_and_without_the_average_restore_into_either(tmp_path):
    plain, averaged = tmp_path / "plain", tmp_path / "averaged"
    for directory, decay in ((plain, None), (averaged, DECAY)):
        trainer = make_trainer(ema_decay=decay)
        loop = loopax.Loop(trainer)
        hooks.checkpoint(loop, directory)
        loop.run_steps(data(), 4)
    # Saved without: the average starts at the restored parameters.
    restored = make_trainer()
    hooks.checkpoint(loopax.Loop(restored), plain)
    assert_trees(host(restored.params), host(restored.ema_params))
    # Saved with, restored without: the raw parameters, no average.
    without = make_trainer(ema_decay=None)
    hooks.checkpoint(loopax.Loop(without), averaged)
    assert without.ema_params is None and without.global_step == 4


def test_accumulation_updates_the_average_once_per_optimizer_step():
    start = initial_params()
    trainer = make_trainer(init_params=start, accumulate_steps=2)
    expected = start
    for step in range(3):
        micro = slice(64 * step, 64 * (step + 1))
        inputs, labels = X[micro].reshape(2, 32, 6), Y[micro].reshape(2, 32, 1)
        trainer.train_step(None, [inputs], [labels])
        params = host(trainer.params)
        expected = jax.tree.map(lambda e, p: DECAY * e + (1 - DECAY) * p, expected, params)
    assert trainer.global_step == 3
    assert_trees(expected, host(trainer.ema_params), exact=False)


def test_a_skipped_non_finite_step_leaves_the_average():
    trainer = make_trainer()
    trainer.skip_non_finite_steps()
    trainer.train_step(None, [X[:32]], [Y[:32]])
    before = host(trainer.ema_params)
    bad = X[:32].copy()
    bad[3, 2] = np.nan
    trainer.train_step(None, [bad], [Y[:32]])
    assert_trees(before, host(trainer.ema_params))
    trainer.train_step(None, [X[32:64]], [Y[32:64]])
    assert not np.array_equal(
        before["Dense_0"]["kernel"], host(trainer.ema_params)["Dense_0"]["kernel"]
    )


def test_bad_decays_are_refused():
    for bad in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=rf"ema_decay must be in \[0, 1\).*got {bad}"):
            make_trainer(ema_decay=bad)
    for bad in ("0.9", True):
        with pytest.raises(TypeError, match="ema_decay must be a number"):
            make_trainer(ema_decay=bad)


@pytest.mark.cpu_devices  # a mesh over 4 devices
def test_on_a_mesh_the_average_is_sharded_like_the_parameters():
    def wide(ctx, spec, inputs):
        return nn.Dense(1)(nn.relu(nn.Dense(16)(inputs[0])))

    trainer = loopax.Trainer(
        wide, loopax.losses.mean_squared_error, optax.adam(0.05), mesh={"data": 4},
        fsdp=True, ema_decay=DECAY,
    )  # fmt: skip
    reference = loopax.Trainer(
        wide, loopax.losses.mean_squared_error, optax.adam(0.05), devices=jax.devices()[:1],
        ema_decay=DECAY,
    )  # fmt: skip
    loopax.Loop(trainer).run_steps(data(), 6)
    loopax.Loop(reference).run_steps(data(), 6)
    shardings = trainer.state_shardings()
    assert shardings["ema_params"] == shardings["params"]
    assert any(s.spec != jax.sharding.PartitionSpec() for s in jax.tree.leaves(shardings["params"]))
    assert_trees(host(reference.ema_params), host(trainer.ema_params), exact=False)


def test_load_variables_offers_the_average(tmp_path):
    trainer = make_trainer()
    loop = loopax.Loop(trainer)
    hooks.checkpoint(loop, tmp_path)
    loop.run_steps(data(), 5)
    assert_trees(host(trainer.ema_params), loopax.load_variables(tmp_path)["params"])
    assert_trees(host(trainer.ema_params), loopax.load_variables(tmp_path, ema=True)["params"])
    assert_trees(host(trainer.params), loopax.load_variables(tmp_path, ema=False)["params"])
    assert_trees(host(trainer.params), loopax.load_params(tmp_path))
    plain = tmp_path / "plain"
    without = make_trainer(ema_decay=None)
    loop = loopax.Loop(without)
    hooks.checkpoint(loop, plain)
    loop.run_steps(data(), 2)
    with pytest.raises(ValueError, match="holds no EMA weights"):
        loopax.load_variables(plain, ema=True)


def test_early_stopping_restores_the_average_of_the_best_check():
    trainer = make_trainer()
    loop = loopax.Loop(trainer)
    averages = {}
    hooks.evaluate(loop, eval_data(), every_n_steps=4)
    stopper = hooks.early_stopping(loop, "eval/eval/mean_loss", patience=100, verbose=False)
    loop.on_evaluation(
        "remember", lambda loop, evaluation: averages.update({loop.trainer.global_step: host(
            loop.trainer.ema_params)})
    )  # fmt: skip
    loop.run_steps(data(), 40)
    assert stopper.best_step is not None
    assert_trees(averages[stopper.best_step], host(trainer.ema_params))


def step_arguments(trainer):
    """How many arguments the compiled train step takes (its state leaves and the batch)."""
    (executor,) = [e for e in trainer.executors() if e.info.graph_type == "train"]
    text = executor.run.as_text()
    return text[text.index("ENTRY") :].count(" parameter(")


@pytest.mark.parametrize("devices", [1, 4])
def test_a_replicated_average_is_one_argument_of_the_step_not_one_per_parameter(devices):
    # Each state leaf costs the runtime about a microsecond a step (an argument in, a donated
    # buffer out, a kernel): the average is packed into one vector per dtype on the devices.
    counts = []
    for decay in (None, DECAY):
        trainer = make_trainer(devices, ema_decay=decay)
        trainer.train_step(None, [X[:32]], [Y[:32]])
        counts.append(step_arguments(trainer))
    assert len(jax.tree.leaves(trainer.ema_params)) == 4  # read back as a tree
    assert counts[1] == counts[0] + 1
