"""Any model in: a model function, a Flax Linen module or a Flax NNX module, trained alike on
1 and 4 simulated devices, checkpointed and resumed exactly; init_params; no parameters."""

import functools
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import loopax
from loopax import hooks

DIGITS = pytest.importorskip("sklearn.datasets").load_digits()
X = (DIGITS.data / 16.0).astype(np.float32)
Y = DIGITS.target.astype(np.int32)
ORDER = np.random.default_rng(0).permutation(len(Y))
TRAIN, TEST = ORDER[:1400], ORDER[1400:]
WORKER = Path(__file__).parent.parent / "hooks" / "checkpoint_worker.py"


class NnxMLP(nnx.Module):
    """An MLP with BatchNorm and dropout, as Flax's NNX guide writes one."""

    def __init__(self, rngs):
        self.hidden = nnx.Linear(64, 128, rngs=rngs)
        self.norm = nnx.BatchNorm(128, rngs=rngs)
        self.dropout = nnx.Dropout(0.2, rngs=rngs)
        self.out = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(self.dropout(nnx.relu(self.norm(self.hidden(x)))))


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Dense(128)(x)))
        return nn.Dense(10)(nn.Dropout(0.2, deterministic=not train)(x))


def model_fn(ctx, spec, inputs):
    x = nn.relu(nn.BatchNorm(use_running_average=not ctx.training)(nn.Dense(128)(inputs[0])))
    return nn.Dense(10)(nn.Dropout(0.2, deterministic=not ctx.training)(x))


def make_trainer(model, devices=1, **kwargs):
    return loopax.Trainer(
        model,
        loopax.losses.sparse_categorical_crossentropy_logits,
        loopax.optimizers.adam(1e-3),
        eval_metrics=[loopax.metrics.SparseCategoricalAccuracy()],
        devices=jax.devices()[:devices],
        **kwargs,
    )


def train_data(seed=0):
    return loopax.ArrayDataset(X[TRAIN], Y[TRAIN], 64, loop_forever=True, seed=seed)


def eval_data():
    return loopax.ArrayDataset(
        X[TEST], Y[TEST], 64, name="test", shuffle=False, drop_remainder=False
    )


@pytest.mark.parametrize("devices", [1, 4])
def test_the_three_kinds_of_model_train_to_the_same_band(devices):
    accuracies = {}
    for name, model in (
        ("function", model_fn),
        ("linen", LinenMLP()),
        ("nnx", NnxMLP(nnx.Rngs(0))),
    ):
        trainer = make_trainer(model, devices)
        loopax.Loop(trainer).run_steps(train_data(), 400)
        accuracies[name] = trainer.evaluate(eval_data())["Accuracy"]
        assert jax.tree.leaves(trainer.state.model_state), name  # the batch statistics
    assert all(accuracy > 0.93 for accuracy in accuracies.values()), accuracies
    assert max(accuracies.values()) - min(accuracies.values()) < 0.04, accuracies


def test_nnx_parameters_state_and_dropout():
    module = NnxMLP(nnx.Rngs(0))
    initial_kernel = np.array(module.hidden.kernel[...])
    trainer = make_trainer(module)
    trainer.train_step(None, [X[TRAIN[:64]]], [Y[TRAIN[:64]]])
    state = jax.device_get(trainer.state)
    # The module's Params are what is trained, from its own initial values...
    assert sorted(state.params) == ["hidden", "norm", "out"]
    assert not np.array_equal(state.params["hidden"]["kernel"], initial_kernel)
    # ...its BatchStats are model state, updated in the train step...
    assert sorted(state.model_state["nnx"]["norm"]) == ["mean", "var"]
    assert np.abs(state.model_state["nnx"]["norm"]["mean"]).sum() > 0
    # ...and dropout differs from step to step (fresh keys per step), not in eval mode.
    losses = {
        float(trainer.train_step(None, [X[TRAIN[:64]]], [Y[TRAIN[:64]]])["loss"]) for _ in range(3)
    }
    assert len(losses) == 3
    first, second = (trainer.evaluate(eval_data())["mean_loss"] for _ in range(2))
    assert first == second


@pytest.mark.parametrize("devices", [1, 4])
def test_nnx_module_gives_the_trained_module_back(devices):
    module = NnxMLP(nnx.Rngs(0))
    trainer = make_trainer(module, devices)
    loopax.Loop(trainer).run_steps(train_data(), 50)
    same = trainer.nnx_module()
    assert same is module
    module.eval()
    logits = np.asarray(module(jnp.asarray(X[TEST])))
    accuracy = float((logits.argmax(-1) == Y[TEST]).mean())
    assert accuracy == pytest.approx(trainer.evaluate(eval_data())["Accuracy"], abs=1e-6)
    np.testing.assert_allclose(logits, trainer.predict(X[TEST]), rtol=1e-5, atol=1e-5)


def test_nnx_module_is_only_for_nnx_trainers():
    with pytest.raises(TypeError, match="nnx_module\\(\\) is for a Trainer of a flax.nnx.Module"):
        make_trainer(model_fn).nnx_module()


@pytest.mark.parametrize("devices", [1, 4])
def test_nnx_resume_is_bit_identical(tmp_path, devices):
    uninterrupted = make_trainer(NnxMLP(nnx.Rngs(0)), devices)
    loopax.Loop(uninterrupted).run_steps(train_data(), 30)

    first = make_trainer(NnxMLP(nnx.Rngs(0)), devices)
    loop = loopax.Loop(first)
    hooks.checkpoint(loop, tmp_path)
    loop.on_step("interrupt", lambda loop, m: loop.loop_step == 11 and loop.request_stop("test"))
    loop.run_to_step(train_data(), 30)  # stopped at 12, saved there
    resumed = make_trainer(
        NnxMLP(nnx.Rngs(1)), devices
    )  # other initial values: the checkpoint wins
    loop = loopax.Loop(resumed)
    hooks.checkpoint(loop, tmp_path)
    assert resumed.global_step == 12
    loop.run_to_step(train_data(), 30)
    for want, got in zip(
        jax.tree.leaves(jax.device_get(uninterrupted.state)),
        jax.tree.leaves(jax.device_get(resumed.state)),
        strict=True,
    ):
        np.testing.assert_array_equal(want, got)


def test_nnx_kill_and_resume_in_real_processes_is_bit_identical(zygote_server, tmp_path):
    # Real processes, forked from one pre-imported interpreter (tests/zygote.py); they share
    # the run's JAX compilation cache (conftest.py).
    def run(directory, out, *flags):
        argv = [WORKER, directory, "15", out, "--nnx", *flags]
        return zygote_server.run(argv, timeout=180)

    reference = run(tmp_path / "reference", tmp_path / "reference.npz")
    assert reference.returncode == 0, reference.stderr[-3000:]
    killed = run(tmp_path / "killed", tmp_path / "out.npz", "--kill-after-save", "6")
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = run(tmp_path / "killed", tmp_path / "out.npz")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # Killed with the save of step 6 in flight: it may or may not have committed.
    assert "resumed from step 6" in resumed.stdout or "resumed from step 3" in resumed.stdout
    with np.load(tmp_path / "reference.npz") as want, np.load(tmp_path / "out.npz") as got:
        assert sorted(want.files) == sorted(got.files)
        for name in want.files:
            np.testing.assert_array_equal(want[name], got[name])


def test_linen_module_takes_the_mode_keyword_it_declares():
    class Deterministic(nn.Module):
        @nn.compact
        def __call__(self, x, *, deterministic):
            return nn.Dropout(0.5, deterministic=deterministic)(nn.Dense(10)(x))

    class NoMode(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(10)(x)

    for module in (Deterministic(), NoMode()):
        trainer = make_trainer(module)
        loopax.Loop(trainer).run_steps(train_data(), 5)
        first, second = (trainer.evaluate(eval_data())["mean_loss"] for _ in range(2))
        assert first == second  # eval steps are deterministic
        assert sorted(trainer.params) == ["Dense_0"]


@pytest.mark.parametrize("devices", [1, 4])
def test_init_params_from_a_checkpoint_reproduce_its_evaluation(tmp_path, devices):
    trained = make_trainer(model_fn, devices)
    loop = loopax.Loop(trained)
    hooks.checkpoint(loop, tmp_path)
    loop.run_steps(train_data(), 60)
    expected = trained.evaluate(eval_data())
    params = loopax.load_params(tmp_path)
    for want, got in zip(
        jax.tree.leaves(jax.device_get(trained.params)), jax.tree.leaves(params), strict=True
    ):
        np.testing.assert_array_equal(want, got)

    # The batch statistics are model state, not parameters: a model without them instead.
    def no_batch_norm(ctx, spec, inputs):
        return nn.Dense(10)(nn.relu(nn.Dense(128)(inputs[0])))

    source = make_trainer(no_batch_norm, devices)
    loopax.Loop(source).run_steps(train_data(), 60)
    fresh = make_trainer(no_batch_norm, devices, init_params=jax.device_get(source.params))
    assert fresh.evaluate(eval_data()) == source.evaluate(eval_data())
    assert expected["Accuracy"] > 0.7  # it learned (0.86 on every CPU tried; chance is 0.1)


def test_init_params_that_do_not_fit_name_the_entry_and_both_shapes():
    wrong = {
        "Dense_0": {"kernel": np.zeros((64, 64), np.float32), "bias": np.zeros((128,), np.float32)},
        "BatchNorm_0": {"scale": np.ones((128,), np.float32), "bias": np.zeros((128,), np.float32)},
        "Dense_1": {"kernel": np.zeros((128, 10), np.float32), "bias": np.zeros((10,), np.float32)},
    }
    trainer = make_trainer(model_fn, init_params=wrong)
    with pytest.raises(
        ValueError,
        match=r"init_params holds 'Dense_0/kernel' with shape \(64, 64\) "
        r".*but the model has shape \(64, 128\).*load_params",
    ):
        trainer.train_step(None, [X[:8]], [Y[:8]])
    missing = {"Dense_0": wrong["Dense_0"]}
    with pytest.raises(ValueError, match=r"init_params has no 'BatchNorm_0/bias'"):
        make_trainer(model_fn, init_params=missing).train_step(None, [X[:8]], [Y[:8]])


def test_freezing_part_of_the_model_through_optax():
    import optax

    def labels(params):
        return {name: "frozen" if name == "Dense_0" else "trained" for name in params}

    trainer = loopax.Trainer(
        model_fn,
        loopax.losses.sparse_categorical_crossentropy_logits,
        optax.multi_transform({"trained": optax.adam(1e-3), "frozen": optax.set_to_zero()}, labels),
        devices=jax.devices()[:1],
    )
    trainer.train_step(None, [X[:64]], [Y[:64]])
    before = jax.device_get(trainer.params)
    loopax.Loop(trainer).run_steps(train_data(), 10)
    after = jax.device_get(trainer.params)
    np.testing.assert_array_equal(before["Dense_0"]["kernel"], after["Dense_0"]["kernel"])
    assert not np.array_equal(before["Dense_1"]["kernel"], after["Dense_1"]["kernel"])


def test_a_model_without_trainable_parameters_is_an_error_at_its_first_step():
    def nnx_inside(ctx, spec, inputs):
        return nnx.Linear(64, 10, rngs=nnx.Rngs(0))(inputs[0])

    trainer = make_trainer(nnx_inside)
    with pytest.raises(
        ValueError,
        match=r"model 'nnx_inside' has no trainable parameters.*"
        r"builds a flax.nnx.Module inside it.*"
        r"loopax.Trainer\(module, \.\.\.\)",
    ):
        trainer.train_step(None, [X[:8]], [Y[:8]])


def test_what_is_not_a_model_is_refused():
    with pytest.raises(TypeError, match="the model must be a model function .* got int"):
        make_trainer(3)


def test_a_keras_style_model_function_is_refused_at_construction_naming_the_signature():
    def model(inputs):  # Keras's habit: the inputs only
        return nn.Dense(10)(inputs)

    def two_arguments(ctx, inputs):
        return nn.Dense(10)(inputs[0])

    for wrong, shown in [(model, "model(inputs)"), (two_arguments, "two_arguments(ctx, inputs)")]:
        with pytest.raises(TypeError) as raised:
            make_trainer(wrong)
        message = str(raised.value)
        assert f"the model function {shown} cannot be called" in message, message
        assert "model_fn(ctx, spec, inputs)" in message and "too many positional" in message
        assert f"def {wrong.__name__}(ctx, spec, inputs): x = inputs[0]" in message
    # A module class where an instance belongs.
    with pytest.raises(TypeError, match=r"the flax.linen module class LinenMLP, not a module: "):
        make_trainer(LinenMLP)
    with pytest.raises(TypeError, match=r"loopax.Trainer\(NnxMLP\(...\), ...\)"):
        make_trainer(NnxMLP)


def test_model_functions_of_every_form_that_takes_three_arguments_still_train():
    class Unreadable:  # a callable whose signature Python cannot read: its first call tells
        __signature__ = "not a signature"

        def __call__(self, ctx, spec, inputs):
            return nn.Dense(10)(inputs[0])

    def with_extras(ctx, spec, inputs, scale=1.0, *rest, **options):
        return nn.Dense(10)(inputs[0] * scale)

    def positional(*args):
        return nn.Dense(10)(args[2][0])

    for model in (Unreadable(), with_extras, positional, functools.partial(with_extras, scale=2)):
        trainer = make_trainer(model)
        metrics = trainer.train_step(None, [X[:8]], [Y[:8]])
        assert np.isfinite(float(metrics["loss"])) and trainer.global_step == 1


def test_model_errors_name_the_model_and_shapes_and_the_nnx_rngs_fix():
    import optax
    from flax import nnx

    class TutorialStyle(nnx.Module):  # rngs at call time, Dropout built without them
        def __init__(self, rngs):
            self.linear = nnx.Linear(3, 2, rngs=rngs)
            self.dropout = nnx.Dropout(0.5)

        def __call__(self, x, rngs=None):
            return self.dropout(self.linear(x), rngs=rngs)

    class WrongWidth(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(5, 2, rngs=rngs)

        def __call__(self, x):
            return self.linear(x)

    x, y = np.ones((4, 3), np.float32), np.ones((4, 2), np.float32)
    for module, error, notes in [
        (TutorialStyle, ValueError, ["model TutorialStyle", "nnx.Dropout(rate, rngs=rngs)"]),
        (WrongWidth, TypeError, ["model WrongWidth while running a step", "[(4, 3)]"]),
    ]:
        trainer = loopax.Trainer(
            module(nnx.Rngs(0)),
            loopax.losses.mean_squared_error,
            optax.sgd(0.1),
            devices=jax.devices()[:1],
        )
        with pytest.raises(error) as raised:
            trainer.train_step(None, [x], [y])
        shown = "\n".join(getattr(raised.value, "__notes__", []))
        for note in notes:
            assert note in shown, shown
