"""Tests for loopax.optimizers' optimizer factories, clipping and from_name."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from loopax import optimizers
from loopax.testing import count_compilations

# Learning rates that make each optimizer converge quickly on the problem below.
_LEARNING_RATES = {"sgd": 0.1, "adam": 0.05, "adamw": 0.05, "rmsprop": 0.03}


def _least_squares():
    rng = np.random.default_rng(0)
    features = jnp.asarray(rng.normal(size=(64, 3)), jnp.float32)
    true_weights = jnp.asarray([1.5, -2.0, 0.5], jnp.float32)
    targets = features @ true_weights + 0.3

    def loss_fn(params):
        predictions = features @ params["w"] + params["b"]
        return jnp.mean((predictions - targets) ** 2)

    return loss_fn, {"w": jnp.zeros(3), "b": jnp.zeros(())}


def _train(optimizer, loss_fn, params, num_steps):
    @jax.jit
    def train_step(params, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = optimizer.init(params)
    with count_compilations() as first_step:
        params, opt_state, _ = train_step(params, opt_state)
    with count_compilations() as later_steps:
        for _ in range(num_steps - 1):
            params, opt_state, _ = train_step(params, opt_state)
    assert (first_step.count, later_steps.count) == (1, 0)
    return params, opt_state


@pytest.mark.parametrize("name", sorted(_LEARNING_RATES))
@pytest.mark.parametrize("use_schedule", [False, True])
def test_each_optimizer_reduces_least_squares_loss(name, use_schedule):
    loss_fn, params = _least_squares()
    learning_rate = _LEARNING_RATES[name]
    if use_schedule:
        learning_rate = optimizers.cosine_decay(learning_rate, decay_steps=400, alpha=0.1)
    optimizer = optimizers.from_name(name, learning_rate=learning_rate)
    assert isinstance(optimizer, optax.GradientTransformation)
    initial_loss = float(loss_fn(params))
    params, _ = _train(optimizer, loss_fn, params, num_steps=200)
    assert float(loss_fn(params)) < 0.01 * initial_loss


@pytest.mark.parametrize("name", sorted(_LEARNING_RATES))
def test_optimizers_with_clipping_still_train(name):
    loss_fn, params = _least_squares()
    optimizer = optimizers.from_name(
        name, learning_rate=_LEARNING_RATES[name], clip_value=10.0, clip_global_norm=10.0
    )
    initial_loss = float(loss_fn(params))
    params, opt_state = _train(optimizer, loss_fn, params, num_steps=200)
    assert float(loss_fn(params)) < 0.01 * initial_loss
    assert float(optimizers.get_learning_rate(opt_state)) == pytest.approx(_LEARNING_RATES[name])


def test_sgd_momentum_and_nesterov_train():
    loss_fn, params = _least_squares()
    for nesterov in (False, True):
        optimizer = optimizers.sgd(0.05, momentum=0.9, nesterov=nesterov)
        trained, _ = _train(optimizer, loss_fn, params, num_steps=200)
        assert float(loss_fn(trained)) < 0.01 * float(loss_fn(params))


def test_adamw_applies_weight_decay_where_adam_does_not():
    learning_rate, weight_decay, num_steps = 0.1, 0.5, 3
    params = {"w": jnp.array([1.0, -2.0, 4.0])}
    zero_grads = jax.tree.map(jnp.zeros_like, params)

    def run(optimizer):
        opt_state, current = optimizer.init(params), params
        for _ in range(num_steps):
            updates, opt_state = optimizer.update(zero_grads, opt_state, current)
            current = optax.apply_updates(current, updates)
        return current["w"]

    adam_params = run(optimizers.adam(learning_rate))
    adamw_params = run(optimizers.adamw(learning_rate, weight_decay=weight_decay))
    np.testing.assert_allclose(adam_params, params["w"])
    np.testing.assert_allclose(
        adamw_params,
        params["w"] * (1 - learning_rate * weight_decay) ** num_steps,
        rtol=1e-6,
    )
    assert bool(jnp.all(jnp.abs(adamw_params) < jnp.abs(params["w"])))


def test_adamw_mask_excludes_parameters_from_decay():
    params = {"w": jnp.array([2.0]), "b": jnp.array([2.0])}
    optimizer = optimizers.adamw(0.1, weight_decay=0.5, mask={"w": True, "b": False})
    zero_grads = jax.tree.map(jnp.zeros_like, params)
    updates, _ = optimizer.update(zero_grads, optimizer.init(params), params)
    np.testing.assert_allclose(updates["w"], [-0.1])
    np.testing.assert_allclose(updates["b"], [0.0])
    callable_mask = optimizers.adamw(0.1, weight_decay=0.5, mask=lambda p: {"w": True, "b": False})
    updates, _ = callable_mask.update(zero_grads, callable_mask.init(params), params)
    np.testing.assert_allclose(updates["b"], [0.0])


def test_clip_global_norm_bounds_the_update():
    grads = {"w": jnp.array([30.0, -40.0]), "b": jnp.array(120.0)}  # global norm 130
    params = jax.tree.map(jnp.zeros_like, grads)
    optimizer = optimizers.sgd(1.0, clip_global_norm=2.0)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    assert float(optax.tree.norm(updates)) == pytest.approx(2.0, rel=1e-5)
    # Direction is kept: the update is the rescaled negative gradient.
    np.testing.assert_allclose(updates["w"], -grads["w"] * 2.0 / 130.0, rtol=1e-5)


def test_clip_global_norm_leaves_small_gradients_alone():
    grads = {"w": jnp.array([0.3, -0.4])}
    optimizer = optimizers.sgd(1.0, clip_global_norm=2.0)
    updates, _ = optimizer.update(grads, optimizer.init(grads))
    np.testing.assert_allclose(updates["w"], -grads["w"])


def test_clip_value_bounds_each_update_element():
    grads = {"w": jnp.array([5.0, -7.0, 0.05])}
    optimizer = optimizers.sgd(1.0, clip_value=0.1)
    updates, _ = optimizer.update(grads, optimizer.init(grads))
    np.testing.assert_allclose(updates["w"], [-0.1, 0.1, -0.05], rtol=1e-6)


def test_clip_value_then_global_norm():
    grads = {"w": jnp.array([5.0, -7.0, 0.0, 3.0])}
    optimizer = optimizers.sgd(1.0, clip_value=1.0, clip_global_norm=1.0)
    updates, _ = optimizer.update(grads, optimizer.init(grads))
    # Values clipped to [1, -1, 0, 1] (norm sqrt(3)), then rescaled to norm 1.
    np.testing.assert_allclose(
        updates["w"], -np.array([1.0, -1.0, 0.0, 1.0]) / np.sqrt(3.0), rtol=1e-5
    )


@pytest.mark.parametrize("name", sorted(_LEARNING_RATES))
def test_every_optimizer_accepts_clipping_options(name):
    grads = {"w": jnp.array([50.0, -70.0])}
    optimizer = optimizers.from_name(name, learning_rate=0.1, clip_value=1e-3)
    updates, _ = optimizer.update(grads, optimizer.init(grads), grads)
    assert bool(jnp.all(jnp.isfinite(updates["w"])))


def test_from_name_is_case_insensitive_and_matches_factory():
    by_name = optimizers.from_name("SGD", learning_rate=0.5)
    grads = jnp.array([1.0])
    updates, _ = by_name.update(grads, by_name.init(grads))
    np.testing.assert_allclose(updates, [-0.5])


def test_from_name_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="'adagrad'.*adam, adamw, rmsprop, sgd"):
        optimizers.from_name("adagrad")


def test_from_name_unknown_hparam_names_it_and_valid_ones():
    with pytest.raises(TypeError, match="'lr'.*valid ones are: learning_rate, b1"):
        optimizers.from_name("adam", lr=0.1)
    with pytest.raises(TypeError, match="did you mean 'weight_decay'"):
        optimizers.from_name("adamw", weight_decy=0.1)
    with pytest.raises(TypeError, match="'weight_decay'"):
        optimizers.from_name("adam", weight_decay=0.1)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: optimizers.sgd(-0.1), "learning_rate=-0.1 must be non-negative"),
        (lambda: optimizers.adam("fast"), "must be a non-negative number or a schedule"),
        (lambda: optimizers.sgd(0.1, momentum=1.5), "momentum=1.5"),
        (lambda: optimizers.sgd(0.1, nesterov=True), "nesterov=True needs a momentum"),
        (lambda: optimizers.rmsprop(nesterov=True), "nesterov=True needs a momentum"),
        (lambda: optimizers.adam(clip_value=0.0), "clip_value=0.0 must be positive"),
        (lambda: optimizers.adamw(clip_global_norm=-1.0), "clip_global_norm=-1.0"),
        (lambda: optimizers.adamw(weight_decay=-1e-4), "weight_decay=-0.0001"),
    ],
)
def test_invalid_configuration_raises_at_construction(build, message):
    with pytest.raises(ValueError, match=message):
        build()
