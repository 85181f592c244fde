"""A small dropout regression model, its data and checkpoint-file helpers, shared by the
in-process reliability tests (not a test file)."""

import warnings
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import optax

import loopax
from loopax import hooks

ONE_DEVICE = jax.devices()[:1]
BATCH_SIZE = 8
NUM_FEATURES = 8
# 8 x 64 kernels: big enough that Orbax (OCDBT) keeps the arrays in a data file of their own
# instead of inlining them in its index, so damaging "the array data file" damages arrays.
HIDDEN = 64


def model_fn(ctx, spec, inputs):
    hidden = nn.relu(nn.Dense(HIDDEN)(inputs[0]))
    hidden = nn.Dropout(0.3, deterministic=not ctx.training)(hidden)
    return nn.Dense(1)(hidden)


def new_trainer(loss_fn=loopax.losses.mean_squared_error, **kwargs):
    """A fresh, uncompiled trainer of the model."""
    kwargs.setdefault("devices", ONE_DEVICE)
    return loopax.Trainer(model_fn, loss_fn, optax.adam(0.01), **kwargs)


_COMPILED = {}


def make_trainer():
    """The trainer of this test process, back at its freshly initialized state (step 0).

    Compiling costs a second and a step microseconds: one trainer is compiled per process
    and handed out again with its initial state, as a new process would start.
    """
    if "trainer" not in _COMPILED:
        trainer = new_trainer()
        initial = []
        trainer.add_state_initializer(lambda state: initial.append(jax.device_get(state)) or state)
        loopax.Loop(trainer).run_steps(make_data(), 1)
        trainer.evaluate(make_data(name="test", loop_forever=False))
        _COMPILED["trainer"] = trainer, initial[0]
    trainer, initial_state = _COMPILED["trainer"]
    trainer.state = jax.tree.map(np.array, initial_state)
    return trainer


def make_data(examples=48, *, name="train", loop_forever=True, nan_at_batch=None, **kwargs):
    """A regression set; with `nan_at_batch=k` the k-th batch of each epoch holds NaN (the
    batches are then in order: no shuffling)."""
    rng = np.random.default_rng(0)
    inputs = rng.normal(size=(examples, NUM_FEATURES)).astype(np.float32)
    labels = inputs[:, :2].sum(axis=1, keepdims=True)
    if nan_at_batch is not None:
        inputs[nan_at_batch * BATCH_SIZE : (nan_at_batch + 1) * BATCH_SIZE] = np.nan
        kwargs["shuffle"] = False
    return loopax.ArrayDataset(
        inputs, labels, BATCH_SIZE, name=name, loop_forever=loop_forever, seed=1, **kwargs
    )


def train_with_checkpoints(trainer, directory, steps, every=2):
    """Trains to `steps` with a checkpoint every `every` steps (all kept); returns the
    `state_dict()` of every step, as a host copy."""
    loop = loopax.Loop(trainer)
    checkpointer = hooks.checkpoint(loop, directory, every_n_steps=every, keep=None)
    states = remember_states(loop)
    loop.run_to_step(make_data(), steps)
    checkpointer.wait()
    return states


def remember_states(loop):
    """Returns a dict that receives `{global_step: trainer.state_dict()}` after every step."""
    trainer, states = loop.trainer, {}

    def remember(loop, metrics):
        states[trainer.global_step] = trainer.state_dict()

    loop.on_step("remember", remember, loopax.Priority.UI)
    return states


def assert_trees_equal(expected, actual):
    expected, actual = jax.device_get(expected), jax.device_get(actual)
    assert jax.tree.structure(expected) == jax.tree.structure(actual)
    for (path, want), got in zip(
        jax.tree_util.tree_flatten_with_path(expected)[0], jax.tree.leaves(actual), strict=True
    ):
        assert np.array_equal(want, got), jax.tree_util.keystr(path)


def all_finite(tree):
    return all(
        np.isfinite(leaf).all()
        for leaf in jax.tree.leaves(jax.device_get(tree))
        if np.issubdtype(np.asarray(leaf).dtype, np.inexact)
    )


def array_data_files(checkpoint: Path) -> list[Path]:
    """The files holding checkpoint `checkpoint`'s array bytes: the data files Orbax's
    process wrote (OCDBT; the top-level `state/d/` holds the index). How the arrays spread
    over them varies from save to save, so tests damage them all."""
    files = sorted((checkpoint / "state" / "ocdbt.process_0" / "d").iterdir())
    assert max(path.stat().st_size for path in files) > 4 * NUM_FEATURES * HIDDEN, (
        "the arrays are not in data files of their own (inlined in the index?)"
    )
    return files


def files_under(directory: Path) -> list[str]:
    return sorted(
        str(path.relative_to(directory)) for path in directory.rglob("*") if path.is_file()
    )


def flip_bytes(path: Path, count=16):
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for index in range(middle, min(middle + count, len(data))):
        data[index] ^= 0xFF
    path.write_bytes(bytes(data))


def assert_restores(directory, step, state):
    """A new hook on `directory` (as in a new process) restores checkpoint `step`, equal to
    `state` (a `state_dict()`), without a warning."""
    trainer = make_trainer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpointer = hooks.checkpoint(loopax.Loop(trainer), directory)
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], caught
    assert checkpointer.restored_step == step
    assert_trees_equal(state, trainer.state_dict())
    return trainer
