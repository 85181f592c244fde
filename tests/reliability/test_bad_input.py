"""Bad inputs: each gives a clear error (or warning) naming the culprit and the fix, and with a
checkpoint hook attached, no checkpointed work is lost: the directory still restores."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reliability_helpers import (
    BATCH_SIZE,
    all_finite,
    assert_restores,
    make_data,
    make_trainer,
    model_fn,
    new_trainer,
    remember_states,
)

import loopax
from loopax import hooks


@pytest.fixture
def checkpointed(tmp_path):
    """A trainer at global step 4 with checkpoints 2 and 4 in `tmp_path / "ckpt"`; returns
    (loop, checkpoint directory, the state saved at step 4)."""
    trainer = make_trainer()
    loop = loopax.Loop(trainer)
    directory = tmp_path / "ckpt"
    checkpointer = hooks.checkpoint(loop, directory, every_n_steps=2)
    loop.run_to_step(make_data(), 4)
    checkpointer.wait()
    return loop, directory, trainer.state_dict()


class Pairs:
    """A dataset whose yield_batch returns (inputs, labels), without the spec."""

    name = "pairs"

    def __init__(self, batches=3):
        self.batches = batches
        self.position = 0
        self.data = make_data(loop_forever=False)

    def yield_batch(self):
        if self.position >= self.batches:
            raise StopIteration
        self.position += 1
        _, inputs, labels = self.data.yield_batch()
        return inputs, labels

    def reset(self):
        self.position = 0
        self.data.reset()


def test_a_dataset_yielding_pairs_in_a_run(checkpointed):
    loop, directory, saved = checkpointed
    with pytest.raises(ValueError) as raised:
        loop.run_steps(Pairs(), 2)
    message = str(raised.value)
    assert "dataset 'pairs' yielded a tuple of 2 items" in message
    assert "must return (spec, inputs, labels)" in message
    assert "(None, inputs, labels)" in message and "loopax.IterableDataset" in message
    assert_restores(directory, 4, saved)


def test_a_dataset_yielding_pairs_in_an_evaluation():
    trainer = make_trainer()
    loopax.Loop(trainer).run_steps(make_data(), 1)
    with pytest.raises(
        ValueError,
        match=r"dataset 'pairs' yielded a tuple of 2 items.*"
        r"\(spec, inputs, labels\).*\(None, inputs, labels\)",
    ):
        trainer.evaluate(Pairs())


def test_a_dataset_yielding_pairs_in_a_scheduled_evaluation_loses_no_checkpointed_work(
    checkpointed,
):
    loop, directory, saved = checkpointed
    hooks.evaluate(loop, Pairs(), every_n_steps=1)
    with pytest.raises(loopax.HookError) as raised:
        loop.run_steps(make_data(), 4)
    assert raised.value.hook_name == "every_n_steps(1): evaluate(pairs)"
    assert raised.value.step == 4
    assert "dataset 'pairs' yielded a tuple of 2 items" in str(raised.value)
    assert_restores(directory, 4, saved)


def test_a_model_function_returning_none():
    def forgot_return(ctx, spec, inputs):
        model_fn(ctx, spec, inputs)  # the `return` is missing

    trainer = loopax.Trainer(
        forgot_return, loopax.losses.mean_squared_error, optax.sgd(0.1), devices=jax.devices()[:1]
    )
    with pytest.raises(
        TypeError,
        match=r"model 'forgot_return' returned None; it "
        r"must return its predictions .*is a `return` missing\?",
    ):
        loopax.Loop(trainer).run_steps(make_data(), 1)


def test_a_loss_function_returning_a_tuple_other_than_loss_and_aux():
    # `(loss, {name: value})` is a loss with auxiliary outputs (tests/trainer/
    # test_loss_aux_and_grad_norm.py); a pair whose second part is no dict is refused, naming
    # the forms a loss function may return.
    def loss_and_extras(labels, predictions):
        error = (labels[0] - predictions[0]) ** 2
        return error.mean(), error.max()

    trainer = new_trainer(loss_and_extras)
    with pytest.raises(
        TypeError,
        match=r"loss function 'loss_and_extras' returned a tuple; it must return one array: "
        r"the loss, or per-example losses \(they are averaged\), or a pair \(loss, \{name: value",
    ):
        loopax.Loop(trainer).run_steps(make_data(), 1)


def test_a_negative_target_step(checkpointed):
    loop, directory, saved = checkpointed
    with pytest.raises(ValueError, match=r"global_step must be an int >= 0, got global_step=-5"):
        loop.run_to_step(make_data(), -5)
    assert loop.trainer.global_step == 4
    assert_restores(directory, 4, saved)


def test_run_epochs_on_a_dataset_without_reset(checkpointed):
    loop, directory, saved = checkpointed

    class NoReset:
        name = "no-reset"

        def yield_batch(self):
            return make_data().yield_batch()

    with pytest.raises(
        TypeError,
        match=r"run_epochs needs a dataset with reset\(\).*'no-reset' "
        r"has none; add reset\(\), or use run_steps",
    ):
        loop.run_epochs(NoReset(), 2)
    assert_restores(directory, 4, saved)


def test_a_nan_loss_without_any_hook_stops_naming_the_first_bad_step():
    trainer = make_trainer()
    loop = loopax.Loop(trainer)
    # Batch 5 holds NaN: its loss is NaN, and every later one too (the parameters are NaN).
    with pytest.raises(loopax.NonFiniteLossError) as raised:
        loop.run_steps(make_data(nan_at_batch=5), 20)
    assert raised.value.step == 5
    message = str(raised.value)
    assert "the loss is nan at step 5 (global step 6), the first non-finite step" in message
    assert "check the data" in message


def test_a_nan_in_the_data_after_a_checkpoint_keeps_the_checkpoint_before_it(tmp_path):
    trainer = make_trainer()
    loop = loopax.Loop(trainer)
    directory = tmp_path / "ckpt"
    checkpointer = hooks.checkpoint(loop, directory, every_n_steps=2)
    states = remember_states(loop)
    with pytest.raises(loopax.NonFiniteLossError) as raised:
        loop.run_steps(make_data(nan_at_batch=5), 20)  # loop step 5 is global step 6
    assert raised.value.step == 5
    assert checkpointer.all_steps() == [2, 4]  # 6 would hold NaN: refused
    assert all_finite(states[4])
    assert_restores(directory, 4, states[4])


def test_one_infinite_loss_with_finite_gradients_stops_the_run_and_never_reaches_a_checkpoint(
    tmp_path,
):
    def loss_with_flag(labels, predictions):
        # The flag adds an infinite constant: the loss is inf, its gradient stays finite.
        flagged = jax.lax.stop_gradient(jnp.where(jnp.any(labels[1] > 0), jnp.inf, 0.0))
        return jnp.mean((labels[0] - predictions[0]) ** 2) + flagged

    rng = np.random.default_rng(0)
    inputs = rng.normal(size=(48, 8)).astype(np.float32)
    flags = np.zeros((48, 1), np.float32)
    flags[3 * BATCH_SIZE] = 1.0  # one example of batch 3 (loop step 3, global step 4)
    dataset = loopax.ArrayDataset(
        inputs,
        [inputs[:, :2].sum(1, keepdims=True), flags],
        BATCH_SIZE,
        shuffle=False,
        loop_forever=True,
    )
    trainer = new_trainer(loss_with_flag)
    loop = loopax.Loop(trainer)
    directory = tmp_path / "ckpt"
    checkpointer = hooks.checkpoint(loop, directory, every_n_steps=1, keep=None)
    with pytest.raises(loopax.NonFiniteLossError) as raised:
        loop.run_steps(dataset, 12)
    assert raised.value.step == 3
    assert "the loss is inf at step 3 (global step 4)" in str(raised.value)
    assert all_finite(trainer.params)  # the update itself was finite: only the loss was not
    checkpointer.wait()
    steps = checkpointer.all_steps()
    assert steps and max(steps) <= 3
    for step in steps:  # every checkpoint on disk restores, and holds only finite values
        assert checkpointer.restore(step) == step
        assert all_finite(trainer.state_dict())


def test_an_eval_dataset_dropping_its_remainder_warns_with_the_counts():
    trainer = make_trainer()
    loopax.Loop(trainer).run_steps(make_data(), 1)
    dataset = make_data(20, name="test", loop_forever=False, drop_remainder=True)
    with pytest.warns(
        RuntimeWarning,
        match=r"dataset 'test' drops its last 4 of 20 examples "
        r"\(drop_remainder=True with batch_size 8\): this "
        r"evaluation covers 16; build it with "
        r"drop_remainder=False",
    ):
        trainer.evaluate(dataset)


def test_a_checkpoint_directory_holding_other_files(tmp_path):
    (tmp_path / "notes.txt").write_text("my notes")
    (tmp_path / "results").mkdir()
    with pytest.raises(
        ValueError,
        match=r"holds 'notes.txt', which is not part of a loopax "
        r"checkpoint.*pass a new or empty directory",
    ):
        hooks.checkpoint(loopax.Loop(make_trainer()), tmp_path)
    # Nothing of what was there is touched.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "results"]
    assert (tmp_path / "notes.txt").read_text() == "my notes"


@pytest.mark.cpu_devices
def test_a_train_batch_not_divisible_by_the_device_count(checkpointed):
    _, directory, saved = checkpointed
    assert len(jax.devices()) == 4, "tests/conftest.py makes 4 CPU devices visible"
    trainer = new_trainer(devices=jax.devices())
    loop = loopax.Loop(trainer)
    hooks.checkpoint(loop, directory)
    assert trainer.global_step == 4
    data = make_data()
    # The data it was trained on (its position comes back from the checkpoint), in batches of 6.
    dataset = loopax.ArrayDataset(
        data.inputs, data.labels, batch_size=6, name=data.name, seed=data.seed, loop_forever=True
    )
    with pytest.raises(
        ValueError,
        match=r"batch size 6 is not divisible by the 4 devices; use a "
        r"batch size that is a multiple of 4 or pass devices=",
    ):
        loop.run_steps(dataset, 2)
    assert_restores(directory, 4, saved)


@pytest.mark.parametrize(
    "optimizer, culprit",
    [
        (optax.adam, "function"),  # the factory, not called
        ("adam", "str"),
    ],
)
def test_a_trainer_with_an_optimizer_that_is_not_optax(optimizer, culprit):
    with pytest.raises(
        TypeError,
        match=rf"optimizer must be an optax.GradientTransformation, got "
        rf"{culprit}; e.g. optax.adam\(1e-3\)",
    ):
        loopax.Trainer(model_fn, loopax.losses.mean_squared_error, optimizer)


@pytest.mark.parametrize(
    ("labels", "shown"),
    [
        (np.array(["cat", "dog"] * 4), r"dtype <U3 \(strings\)"),
        (np.array(["cat", "dog"] * 4, dtype=object), r"dtype object \(Python objects\)"),
    ],
)
def test_string_labels_are_named_with_their_dtype_and_the_fix(labels, shown):
    import flax.linen as nn

    trainer = loopax.Trainer(
        lambda ctx, spec, inputs: nn.Dense(2)(inputs[0]),
        loopax.losses.mean_squared_error,
        optax.sgd(0.1),
    )
    x = np.ones((8, 2), np.float32)
    message = rf"labels\[0\] of the train batch .*{shown}.*np.unique\(labels, return_inverse=True\)"
    for data in (loopax.ArrayDataset(x, labels, 4), [(x, labels)]):
        with pytest.raises(TypeError, match=message):
            loopax.Loop(trainer).run_steps(data, 1)
    with pytest.raises(TypeError, match=rf"inputs\[0\] of the eval batch .*{shown}.*numbers"):
        trainer.evaluate([(labels[:, None], x)])
    assert trainer.global_step == 0


def test_an_empty_batch_is_named_not_blamed_on_the_learning_rate():
    import flax.linen as nn

    trainer = loopax.Trainer(
        lambda ctx, spec, inputs: nn.Dense(1)(inputs[0]),
        loopax.losses.mean_squared_error,
        optax.sgd(0.1),
    )
    empty = (np.ones((0, 2), np.float32), np.ones((0, 1), np.float32))
    with pytest.raises(ValueError, match=r"the train batch for spec None is empty.*0 examples"):
        loopax.Loop(trainer).run_steps([empty], 1)
    with pytest.raises(ValueError, match=r"the eval batch for spec None is empty"):
        trainer.evaluate([empty])
    assert trainer.global_step == 0
