"""A step's new device buffers: no more than a hand-written step with the same outputs.

On a GPU every output that is not donated state is a fresh buffer, at a new address every
step, and each new address makes XLA:GPU update the CUDA graph commands that read it; a
step that returns more such buffers than it needs pays for them every step. A CPU shows
no cost, so this counts them: the outputs of the compiled program that alias no donated
input, against those of a hand-written `jax.jit` step that donates its state and returns
the same metrics (the loss and its moving average).
"""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import loopax

ALIAS = re.compile(r"\{[\d, ]*\}: \(\d+, \{[\d, ]*\}, (?:may|must)-alias\)")


def new_buffers(compiled):
    """Outputs of a compiled program that alias no donated input (from its HLO module)."""
    header = compiled.as_text().splitlines()[0]  # `HloModule ..., input_output_alias={...}`
    return len(jax.tree.leaves(compiled.out_info)) - len(ALIAS.findall(header))


def model_fn(ctx, spec, inputs):
    return nn.Dense(1)(inputs[0])


def batch():
    rng = np.random.default_rng(0)
    inputs = rng.normal(size=(8, 3)).astype(np.float32)
    return jax.device_put(inputs), jax.device_put(inputs[:, :1])


def averaging_step(model, optimizer):
    """A hand-written step `(state, inputs, labels) -> (state, metrics)` keeping a loss
    moving average, as loopax's step does; `state` is `(params, opt_state, (total, weight))`."""

    def step(state, inputs, labels):
        params, opt_state, (total, weight) = state

        def loss_of(params):
            return jnp.mean((model.apply(params, inputs) - labels) ** 2)

        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        total, weight = 0.9 * total + 0.1 * loss, 0.9 * weight + 0.1
        state = (optax.apply_updates(params, updates), opt_state, (total, weight))
        return state, {"loss": loss, "moving_average_loss": total / weight}

    return step


def hand_written_step(inputs, labels):
    """A donated step over the same model and optimizer, keeping a loss moving average."""
    model, optimizer = nn.Dense(1), optax.adam(0.01)
    params = model.init(jax.random.key(0), inputs)
    average = (jnp.zeros(()), jnp.zeros(()))  # an exponential average and its weight
    state = (params, optimizer.init(params), average)
    step = averaging_step(model, optimizer)
    return jax.jit(step, donate_argnums=0).lower(state, inputs, labels).compile()


def test_a_train_step_makes_no_more_new_buffers_than_a_hand_written_one():
    inputs, labels = batch()
    trainer = loopax.Trainer(model_fn, loopax.losses.mean_squared_error, optax.adam(0.01))
    metrics = trainer.train_step(None, inputs, labels)
    (executor,) = trainer.executors()
    hand_written = hand_written_step(inputs, labels)
    assert set(metrics) == {"loss", "moving_average_loss"}
    # Both return the two metrics as new buffers; everything else aliases donated state.
    assert new_buffers(hand_written) == 2
    assert new_buffers(executor.run) <= new_buffers(hand_written)


def test_an_undonated_output_is_counted():
    # The count can fail: the same hand-written step without donation returns all anew.
    inputs, labels = batch()
    donated = hand_written_step(inputs, labels)
    leaves = len(jax.tree.leaves(donated.out_info))
    plain = jax.jit(lambda x: (x + 1, x * 2), donate_argnums=0).lower(inputs).compile()
    assert new_buffers(plain) == 1  # one of the two outputs reuses the donated input
    assert new_buffers(donated) < leaves
