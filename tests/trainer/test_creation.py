"""The train state's creation: one program, compiled in the background beside the first step's.

A fresh Trainer's first step compiles two programs and nothing else: the state's creation
(the model's initializers, the optimizer and metric states) and the step. The creation
compiles on a background thread while the step, lowered against the state's shapes, compiles
on the calling thread. A state initializer that changes what the step was compiled for (the
RNG key) gets a step compiled anew for the state it made.
"""

import threading

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import loopax
from loopax.testing import count_compilations
from loopax.testing._compilations import BACKEND_COMPILE_EVENT

ONE_DEVICE = jax.devices()[:1]


def model_fn(ctx, spec, inputs):
    hidden = nn.relu(nn.Dense(37)(inputs[0]))  # widths no other test uses: nothing cached
    hidden = nn.Dropout(0.5, deterministic=not ctx.training)(hidden)
    return nn.Dense(3)(hidden)


class TwoLayers(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.relu(nn.Dense(37)(x)))


def new_trainer(**kwargs):
    kwargs.setdefault("devices", ONE_DEVICE)
    return loopax.Trainer(model_fn, loopax.losses.mean_squared_error, optax.adamw(0.01), **kwargs)


def batch(seed=0):
    rng = np.random.default_rng(seed)
    inputs = rng.normal(size=(8, 5)).astype(np.float32)
    return None, [inputs], [inputs[:, :3] * 2.0]


@pytest.mark.parametrize("devices", [1, 4])
def test_the_first_step_compiles_the_state_creation_and_the_step_only(devices):
    # What a process compiles once, whatever the model (e.g. the seed's key), first.
    loopax.Trainer(
        TwoLayers(), loopax.losses.mean_squared_error, optax.sgd(0.1), devices=ONE_DEVICE
    ).train_step(None, [np.ones((2, 4), np.float32)], [np.ones((2, 3), np.float32)])
    trainer = new_trainer(devices=jax.devices()[:devices])
    threads = []

    def on_duration(event, duration, **kwargs):
        if event == BACKEND_COMPILE_EVENT:
            threads.append((str(kwargs.get("fun_name")), threading.current_thread().name))

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    try:
        with count_compilations() as compiled:
            trainer.train_step(*batch())
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)
    # Not one program per operation of the optimizer's and metrics' initial states.
    assert compiled.count == 2, compiled.names
    assert dict(threads)["jit(create)"].startswith("loopax-compile")
    assert dict(threads)["jit(train)"] == threading.current_thread().name
    assert trainer.global_step == 1


@pytest.mark.parametrize("devices", [1, 4])
def test_the_created_state_is_the_models_own_initialization(devices):
    trainer = loopax.Trainer(
        TwoLayers(), loopax.losses.mean_squared_error, optax.adamw(0.01),
        devices=jax.devices()[:devices],
    )  # fmt: skip
    _, inputs, labels = batch()
    trainer.evaluate([(None, inputs, labels)])  # creates the state without a step
    # Flax's init of one device's shard, under the key loopax derives from the seed.
    key = jax.random.fold_in(jax.random.PRNGKey(0), 2**31 - 1)
    params_key, dropout_key = jax.random.split(key)
    shard = inputs[0][: len(inputs[0]) // devices]
    expected = TwoLayers().init({"params": params_key, "dropout": dropout_key}, shard)["params"]
    state = jax.device_get(trainer.state)
    assert jax.tree.structure(state.params) == jax.tree.structure(expected)
    for want, got in zip(jax.tree.leaves(expected), jax.tree.leaves(state.params), strict=True):
        np.testing.assert_array_equal(got, want)
    assert int(state.step) == 0
    for leaf in jax.tree.leaves(state.opt_state):  # adamw's moments and count start at 0
        assert not np.any(np.asarray(leaf))
    np.testing.assert_array_equal(state.rng, jax.random.PRNGKey(0))


def test_an_initializer_changing_the_key_gets_steps_compiled_with_its_key():
    """The step is compiled with the key the initializer puts in, not the seed's."""
    other_key = np.asarray(jax.random.PRNGKey(7))
    with_initializer = new_trainer()
    with_initializer.add_state_initializer(lambda state: state.replace(rng=other_key))
    for seed in range(3):
        with_initializer.train_step(*batch(seed))

    # The same state given the key after its creation: the steps compile anew for it.
    given_later = new_trainer()
    given_later.evaluate([batch()])
    given_later.state = given_later.state.replace(rng=other_key)
    for seed in range(3):
        given_later.train_step(*batch(seed))

    unchanged = new_trainer()  # the seed's key: dropout draws other masks
    for seed in range(3):
        unchanged.train_step(*batch(seed))

    np.testing.assert_array_equal(with_initializer.state.rng, other_key)
    for want, got in zip(
        jax.tree.leaves(jax.device_get(given_later.params)),
        jax.tree.leaves(jax.device_get(with_initializer.params)),
        strict=True,
    ):
        np.testing.assert_array_equal(got, want)
    assert not all(
        np.array_equal(a, b)
        for a, b in zip(
            jax.tree.leaves(jax.device_get(unchanged.params)),
            jax.tree.leaves(jax.device_get(with_initializer.params)),
            strict=True,
        )
    )
    assert len(with_initializer.executors()) == 1  # the stale step was dropped


def test_init_params_start_the_created_state():
    first = new_trainer()
    first.train_step(*batch())
    params = jax.device_get(first.params)
    second = new_trainer(init_params=params)
    second.evaluate([batch()])
    for want, got in zip(
        jax.tree.leaves(params), jax.tree.leaves(jax.device_get(second.params)), strict=True
    ):
        np.testing.assert_array_equal(got, want)


def test_a_first_step_that_fails_leaves_nothing_compiling_behind():
    """The creation's compiling ends before the error reaches the caller."""

    def loss_of_the_wrong_kind(labels, predictions):
        return "not an array"

    trainer = loopax.Trainer(model_fn, loss_of_the_wrong_kind, optax.sgd(0.1), devices=ONE_DEVICE)
    with count_compilations() as compiled:
        with pytest.raises(TypeError, match="must return one array"):
            trainer.train_step(*batch())
        at_the_error = list(compiled.names)
    assert "jit(create)" in at_the_error  # compiled (or read from the cache) already
    assert trainer.state is None
