"""Tests for get_learning_rate / set_learning_rate on loopax and optax optimizer states."""

import flax.linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loopax
from loopax import optimizers
from loopax.testing import count_compilations

_NAMES = ["adam", "adamw", "rmsprop", "sgd"]
_PARAMS = {"w": jnp.array([1.0, -2.0]), "b": jnp.zeros(())}
_GRADS = {"w": jnp.array([0.5, 0.25]), "b": jnp.array(1.0)}


def _step_fn(optimizer):
    def train_step(params, opt_state, grads):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return train_step


@pytest.mark.parametrize("name", _NAMES)
@pytest.mark.parametrize("clip_global_norm", [None, 100.0])
def test_get_set_round_trip(name, clip_global_norm):
    optimizer = optimizers.from_name(name, learning_rate=0.5, clip_global_norm=clip_global_norm)
    opt_state = optimizer.init(_PARAMS)
    assert float(optimizers.get_learning_rate(opt_state)) == 0.5
    new_state = optimizers.set_learning_rate(opt_state, 0.125)
    assert float(optimizers.get_learning_rate(new_state)) == 0.125
    assert float(optimizers.get_learning_rate(opt_state)) == 0.5  # input unchanged
    old_leaves, old_tree = jax.tree.flatten(opt_state)
    new_leaves, new_tree = jax.tree.flatten(new_state)
    assert old_tree == new_tree
    for old, new in zip(old_leaves, new_leaves, strict=True):
        assert jax.typeof(old) == jax.typeof(new)


def test_learning_rate_stays_after_updates_and_set_value_is_used():
    optimizer = optimizers.sgd(0.5, clip_value=10.0)
    step = jax.jit(_step_fn(optimizer))
    params, opt_state = step(_PARAMS, optimizer.init(_PARAMS), _GRADS)
    assert float(optimizers.get_learning_rate(opt_state)) == 0.5
    opt_state = optimizers.set_learning_rate(opt_state, 0.25)
    new_params, opt_state = step(params, opt_state, _GRADS)
    np.testing.assert_allclose(new_params["w"], params["w"] - 0.25 * _GRADS["w"])
    assert float(optimizers.get_learning_rate(opt_state)) == 0.25


@pytest.mark.parametrize("name", _NAMES)
def test_set_learning_rate_does_not_recompile(name):
    optimizer = optimizers.from_name(name, learning_rate=0.5, clip_value=10.0)
    step = jax.jit(_step_fn(optimizer))
    opt_state = optimizer.init(_PARAMS)
    with count_compilations() as first_steps:
        params, opt_state = step(_PARAMS, opt_state, _GRADS)
        params, opt_state = step(params, opt_state, _GRADS)
    compiled_after_set = []
    for value in (0.1, jnp.float32(0.01), jnp.array(0.0)):
        opt_state = optimizers.set_learning_rate(opt_state, value)
        with count_compilations() as compiled:
            params, opt_state = step(params, opt_state, _GRADS)
        compiled_after_set.append(compiled.count)
    assert first_steps.count == 1
    assert compiled_after_set == [0, 0, 0]


def test_compiled_step_accepts_state_with_new_learning_rate():
    optimizer = optimizers.adam(0.5, clip_global_norm=1.0)
    opt_state = optimizer.init(_PARAMS)
    compiled = jax.jit(_step_fn(optimizer)).lower(_PARAMS, opt_state, _GRADS).compile()
    zeroed = optimizers.set_learning_rate(opt_state, 0.0)
    params, next_state = compiled(_PARAMS, zeroed, _GRADS)
    np.testing.assert_allclose(params["w"], _PARAMS["w"])  # learning rate 0: no move
    assert float(optimizers.get_learning_rate(next_state)) == 0.0


def test_set_learning_rate_inside_jit():
    optimizer = optimizers.sgd(0.5)

    @jax.jit
    def halve(opt_state):
        return optimizers.set_learning_rate(opt_state, optimizers.get_learning_rate(opt_state) / 2)

    opt_state = halve(optimizer.init(_PARAMS))
    assert float(optimizers.get_learning_rate(opt_state)) == 0.25


def test_schedule_drives_the_learning_rate_and_refuses_set():
    schedule = optimizers.exponential_decay(1.0, transition_steps=1, decay_rate=0.5)
    optimizer = optimizers.sgd(schedule)
    step = jax.jit(_step_fn(optimizer))
    params, opt_state = _PARAMS, optimizer.init(_PARAMS)
    assert float(optimizers.get_learning_rate(opt_state)) == 1.0  # schedule(0)
    for num_updates in range(1, 4):
        params, opt_state = step(params, opt_state, _GRADS)
        # The injected value is the one the last update used: schedule(count - 1).
        assert float(optimizers.get_learning_rate(opt_state)) == pytest.approx(
            0.5 ** (num_updates - 1)
        )
    with pytest.raises(ValueError, match="driven by a schedule.*overwrites"):
        optimizers.set_learning_rate(opt_state, 0.1)


def test_state_without_injected_learning_rate():
    opt_state = optax.chain(optax.clip(1.0), optax.adam(0.1)).init(_PARAMS)
    assert optimizers.get_learning_rate(opt_state) is None
    with pytest.raises(ValueError, match="no injectable learning rate.*inject_hyperparams"):
        optimizers.set_learning_rate(opt_state, 0.1)


def test_works_on_plain_optax_inject_hyperparams_nested_in_chain():
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.inject_hyperparams(optax.sgd)(learning_rate=0.5, momentum=0.9),
    )
    opt_state = optimizers.set_learning_rate(optimizer.init(_PARAMS), 0.25)
    assert float(optimizers.get_learning_rate(opt_state)) == 0.25
    assert float(opt_state[1].hyperparams["momentum"]) == pytest.approx(0.9)


def test_set_learning_rate_rejects_bad_values():
    opt_state = optimizers.sgd(0.5).init(_PARAMS)
    with pytest.raises(ValueError, match="must be a scalar"):
        optimizers.set_learning_rate(opt_state, jnp.ones(2))
    with pytest.raises(ValueError, match="must be non-negative"):
        optimizers.set_learning_rate(opt_state, -0.1)


def test_set_learning_rate_keeps_committed_placement():
    optimizer = optimizers.sgd(0.5, momentum=0.9)
    device = jax.devices()[0]
    params, grads = jax.device_put((_PARAMS, _GRADS), device)
    opt_state = jax.device_put(optimizer.init(_PARAMS), device)
    step = jax.jit(_step_fn(optimizer))
    with count_compilations() as first_step:
        params, opt_state = step(params, opt_state, grads)
    opt_state = optimizers.set_learning_rate(opt_state, 0.125)
    assert optimizers.get_learning_rate(opt_state).committed
    with count_compilations() as after_set:
        params, opt_state = step(params, opt_state, grads)
    assert (first_step.count, after_set.count) == (1, 0)


# -- learning-rate mix-ups (issue 22 item 6) ----------------------------------------------


@pytest.mark.parametrize("factory", [optimizers.cosine_decay, optimizers.warmup_cosine])
def test_an_uncalled_schedule_factory_is_refused_at_the_call(factory):
    name = factory.__name__
    with pytest.raises(TypeError, match=rf"learning_rate={name} is a schedule factory.*call it"):
        optimizers.adam(learning_rate=factory)


def test_an_uncalled_optax_factory_is_refused_and_a_schedule_is_accepted():
    with pytest.raises(TypeError, match="cosine_decay_schedule is a schedule factory"):
        optimizers.sgd(learning_rate=optax.cosine_decay_schedule)
    optimizers.sgd(learning_rate=optax.cosine_decay_schedule(0.1, 10))
    optimizers.sgd(learning_rate=optimizers.cosine_decay(0.1, 10))
    optimizers.sgd(learning_rate=lambda count: 0.1 / (1 + count))


def test_set_learning_rate_refuses_a_schedule_naming_the_fix():
    trainer = loopax.Trainer(
        lambda ctx, spec, inputs: flax.linen.Dense(1)(inputs[0]),
        loopax.losses.mean_squared_error,
        optimizers.adam(1e-3),
    )
    schedule = optimizers.cosine_decay(1e-3, 1000)
    with pytest.raises(TypeError, match=r"takes a number.*build it with the schedule"):
        trainer.set_learning_rate(schedule)
    x = np.ones((4, 2), np.float32)
    trainer.train_step(None, [x], [x[:, :1]])
    with pytest.raises(TypeError, match="takes a number"):
        trainer.set_learning_rate(schedule)
    with pytest.raises(TypeError, match="takes a number"):
        optimizers.set_learning_rate(trainer.state.opt_state, schedule)
    trainer.set_learning_rate(5e-4)
    assert float(trainer.learning_rate_array()) == pytest.approx(5e-4)


# -- per-group rates (issue 22 item 20) ----------------------------------------------------


def two_groups():
    return optax.multi_transform(
        {"fast": optimizers.sgd(0.1), "slow": optimizers.sgd(0.01)}, {"w": "fast", "v": "slow"}
    )


def group_rates(opt_state):
    return [float(optimizers.get_learning_rate(s)) for s in opt_state.inner_states.values()]


def test_scale_learning_rate_keeps_each_groups_proportion_and_floor():
    state = two_groups().init({"w": jnp.zeros(2), "v": jnp.zeros(2)})
    assert group_rates(optimizers.scale_learning_rate(state, 0.5)) == pytest.approx([0.05, 0.005])
    floored = optimizers.scale_learning_rate(state, 0.1, minimum=0.005)
    assert group_rates(floored) == pytest.approx([0.01, 0.005])  # 0.001 stops at the floor
    below = optimizers.scale_learning_rate(state, 0.5, minimum=0.02)
    assert group_rates(below) == pytest.approx([0.05, 0.01])  # already below: left alone
    with pytest.raises(ValueError, match="factor must be > 0"):
        optimizers.scale_learning_rate(state, 0.0)
    with pytest.raises(ValueError, match="no injectable learning rate"):
        optimizers.scale_learning_rate(optax.sgd(0.1).init({"w": 0.0}), 0.5)
