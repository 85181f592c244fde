"""`loopax.load_params`: a checkpoint's parameters as numpy, without a model; and the same with
plain Orbax, as the README shows."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import loopax
from loopax import hooks


def model_fn(ctx, spec, inputs):
    return nn.Dense(1)(nn.relu(nn.Dense(4)(inputs[0])))


@pytest.fixture
def trained(tmp_path):
    trainer = loopax.Trainer(
        model_fn, loopax.losses.mean_squared_error, optax.adam(0.01), devices=jax.devices()[:1]
    )
    loop = loopax.Loop(trainer)
    checkpointer = hooks.checkpoint(loop, tmp_path, every_n_steps=3, keep=None)
    saved = {}
    loop.on_step(
        "remember",
        lambda loop, m: saved.update(
            {loop.trainer.global_step: jax.device_get(loop.trainer.params)}
        ),
        loopax.Priority.UI,
    )
    x = np.random.default_rng(0).normal(size=(32, 3)).astype(np.float32)
    loop.run_steps(loopax.ArrayDataset(x, x[:, :1], 8, loop_forever=True), 7)
    checkpointer.wait()
    return tmp_path, saved


def assert_same(want, got):
    assert jax.tree.structure(want) == jax.tree.structure(got)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        assert isinstance(b, np.ndarray)
        np.testing.assert_array_equal(a, b)


def test_the_newest_and_a_given_step(trained):
    directory, saved = trained
    assert_same(saved[7], loopax.load_params(directory))
    assert_same(saved[3], loopax.load_params(directory, step=3))


def test_a_damaged_newest_is_skipped_with_a_warning_and_left_in_place(trained):
    directory, saved = trained
    (directory / "7" / "loopax" / "metadata").write_text("{not json")
    with pytest.warns(RuntimeWarning, match=r"'.*7' is damaged .*reading the next newest"):
        params = loopax.load_params(directory)
    assert_same(saved[6], params)
    assert (directory / "7").is_dir() and not (directory / "damaged").exists()


def test_missing_things_are_named(trained, tmp_path_factory):
    directory, _ = trained
    with pytest.raises(FileNotFoundError, match=r"no checkpoint of step 5 .*there are \[3, 6, 7\]"):
        loopax.load_params(directory, step=5)
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        loopax.load_params(directory / "nowhere")
    empty = tmp_path_factory.mktemp("empty")
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        loopax.load_params(empty)


def test_plain_orbax_reads_them_too(trained):
    directory, saved = trained
    import orbax.checkpoint as ocp

    # The README's lines, as a user without loopax would write them:
    manager = ocp.CheckpointManager(
        directory, item_handlers={"state": ocp.StandardCheckpointHandler()}
    )
    step = manager.latest_step()
    state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))[
        "state"
    ]
    params = state["params"]
    assert step == 7
    assert_same(saved[7], jax.tree.map(np.asarray, params))
