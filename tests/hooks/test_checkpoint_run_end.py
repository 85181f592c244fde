"""What a hook raising at a save's step keeps: the save is still committed (issue 22, item
13). Real Orbax checkpoints throughout.
"""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import loopax
from loopax import hooks

BATCH_SIZE = 8


def model_fn(ctx, spec, inputs):
    return nn.Dense(1)(nn.relu(nn.Dense(4)(inputs[0])))


def make_trainer():
    return loopax.Trainer(
        model_fn, loopax.losses.mean_squared_error, optax.adam(0.01), devices=jax.devices()[:1]
    )


def make_dataset():
    inputs = np.random.default_rng(0).normal(size=(24, 3)).astype(np.float32)
    return loopax.ArrayDataset(
        inputs, inputs.sum(1, keepdims=True), batch_size=BATCH_SIZE, loop_forever=True
    )


@pytest.fixture(scope="module")
def compiled_trainer():
    # Compiling costs seconds, a step well under a millisecond: one trainer for the module.
    trainer = make_trainer()
    initial = []
    trainer.add_state_initializer(lambda state: initial.append(jax.device_get(state)) or state)
    loopax.Loop(trainer).run_steps(make_dataset(), 1)
    return trainer, initial[0]


@pytest.fixture
def trainer(compiled_trainer):
    """The shared trainer, back at its freshly initialized state (step 0)."""
    trainer, initial_state = compiled_trainer
    trainer.state = jax.tree.map(np.array, initial_state)
    return trainer


# -- a hook raising at a save's step (issue 22, item 13) -------------------------------------


def test_a_save_is_committed_when_a_later_hook_of_its_step_raises(trainer, tmp_path):
    loop = loopax.Loop(trainer)
    checkpointer = hooks.checkpoint(loop, tmp_path / "ckpt", every_n_steps=3)
    log = hooks.metrics_log(loop, tmp_path / "log.csv", every_n_steps=1, learning_rate=False)

    def fail(loop, metrics):
        if loop.trainer.global_step == 3:
            raise RuntimeError("a bug in a UI hook")

    loop.on_step("fail", fail, loopax.Priority.UI)
    with pytest.raises(loopax.HookError, match="a bug in a UI hook"):
        loop.run_steps(make_dataset(), 10)
    saved = trainer.state_dict()  # the state of step 3: the run stopped there
    assert checkpointer.all_steps() == [3]
    # Its logs went out before it committed, as without the error.
    points = log.file.read()
    assert sorted({point["step"] for point in points}) == [1, 2, 3]

    resumed_trainer = make_trainer()
    resumed = hooks.checkpoint(loopax.Loop(resumed_trainer), tmp_path / "ckpt")
    assert resumed.restored_step == 3
    np.testing.assert_array_equal(
        resumed_trainer.state_dict()["params"]["Dense_0"]["kernel"],
        saved["params"]["Dense_0"]["kernel"],
    )


def test_the_end_of_run_save_is_committed_when_a_later_end_hook_raises(trainer, tmp_path):
    loop = loopax.Loop(trainer)
    checkpointer = hooks.checkpoint(loop, tmp_path, every_n_steps=100)

    def fail(loop, metrics):
        raise RuntimeError("a bug in an end hook")

    loop.on_end("fail", fail, loopax.Priority.UI)
    with pytest.raises(loopax.HookError, match="a bug in an end hook"):
        loop.run_steps(make_dataset(), 4)
    assert checkpointer.all_steps() == [4]


def test_a_step_that_raises_before_the_save_saves_nothing(trainer, tmp_path):
    loop = loopax.Loop(trainer)
    checkpointer = hooks.checkpoint(loop, tmp_path, every_n_steps=3)

    def fail(loop, metrics):
        if loop.trainer.global_step == 3:
            raise RuntimeError("a bug in an evaluation")

    loop.on_step("fail", fail, loopax.Priority.EVALUATE)  # before the checkpoint's band
    with pytest.raises(loopax.HookError, match="a bug in an evaluation"):
        loop.run_steps(make_dataset(), 10)
    assert checkpointer.all_steps() == []
