"""A mesh across 2 processes x 2 CPU devices trains as 1 process on 1 device."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import loopax
from loopax.testing import multiprocess
from loopax.trainer._state import to_plain  # the plain form a checkpoint restores

# Their processes fork from one pre-imported interpreter (conftest.py, tests/zygote.py).
pytestmark = pytest.mark.usefixtures("forked_processes")

STEPS = 20
MESH = {"data": 2, "model": 2}
RULES = [("embed", None), ("mlp", "model")]


def model_fn(ctx, spec, inputs):
    init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
    hidden = nn.Dense(8, kernel_init=init)(inputs[0])
    hidden = nn.Dropout(0.3, deterministic=not ctx.training)(nn.relu(hidden))
    return nn.Dense(1)(hidden)


def mse(labels, predictions):
    return (labels[0] - predictions[0]) ** 2


def batch():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 4)).astype(np.float32)
    return x, (x.sum(axis=1, keepdims=True) > 0).astype(np.float32)


def train(trainer, x, y, steps=STEPS):
    return [float(trainer.train_step(None, [x], [y])["loss"]) for _ in range(steps)]


def sharded_trainer():
    return loopax.Trainer(model_fn, mse, optax.adam(0.05), mesh=MESH, rules=RULES, fsdp=True)


def train_on_mesh():
    """In each process: its half of every global batch, on the shared 2x2 mesh.

    Half the steps, then the state (global arrays, sharded across the processes) loaded
    into a new trainer before its first batch, which runs the other half.
    """
    x, y = batch()
    share = slice(4 * jax.process_index(), 4 * (jax.process_index() + 1))
    first = sharded_trainer()
    losses = train(first, x[share], y[share], STEPS // 2)
    trainer = sharded_trainer()
    trainer.load_state_dict(to_plain(first.state))
    losses += train(trainer, x[share], y[share], STEPS - STEPS // 2)
    kernel = trainer.params["Dense_0"]["kernel"]
    try:
        trainer.state_dict()
        refused = ""
    except ValueError as err:
        refused = str(err)
    evaluation = trainer.evaluate([(None, [x[share]], [y[share]])])
    predictions = trainer.predict(x[share])  # this process's examples, each once
    return {
        "losses": losses,
        "spec": str(kernel.sharding.spec),
        "fsdp_spec": str(trainer.params["Dense_1"]["kernel"].sharding.spec),
        "refused": refused,
        "mean_loss": evaluation["mean_loss"],
        "predictions": predictions.tolist(),
    }


def test_a_mesh_over_two_processes_trains_as_one_device():
    results = multiprocess(2, 2, train_on_mesh, timeout=120)
    x, y = batch()
    one = loopax.Trainer(model_fn, mse, optax.adam(0.05), devices=jax.devices()[:1])
    expected = train(one, x, y)
    expected_eval = one.evaluate([(None, [x], [y])])["mean_loss"]
    expected_predictions = one.predict(x)
    for process, result in enumerate(results):
        np.testing.assert_allclose(result["losses"], expected, atol=1e-5)
        assert result["spec"] == "P(None, 'model')"
        assert result["fsdp_spec"] == "P('data',)"
        assert "sharded across processes" in result["refused"]
        assert "hooks.checkpoint" in result["refused"]
        assert abs(result["mean_loss"] - expected_eval) <= 1e-5
        share = expected_predictions[4 * process : 4 * (process + 1)]
        np.testing.assert_allclose(result["predictions"], share, atol=1e-5)
