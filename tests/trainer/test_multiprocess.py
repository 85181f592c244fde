"""Multi-process data parallelism: 2 processes x 2 CPU devices == 1 device, same batches."""

import numpy as np
import pytest

from loopax.testing import multiprocess

# Their processes fork from one pre-imported interpreter (conftest.py, tests/zygote.py).
pytestmark = pytest.mark.usefixtures("forked_processes")

GLOBAL_BATCH = 16


def model_fn(ctx, spec, inputs):
    import flax.linen as nn

    return nn.Dense(1)(nn.tanh(nn.Dense(8)(inputs[0])))


def batches():
    rng = np.random.default_rng(0)
    for _ in range(5):
        x = rng.normal(size=(GLOBAL_BATCH, 3)).astype(np.float32)
        yield x, x.sum(axis=1, keepdims=True)


def local_share(num_processes, process_id):
    # Each process yields its own rows of every global batch.
    share = GLOBAL_BATCH // num_processes
    start = process_id * share
    for x, y in batches():
        yield [x[start : start + share]], [y[start : start + share]]


def train(one_device):
    """One process's run; with `one_device`, a lone process on one device (the reference)."""
    import jax
    import optax

    import loopax

    count, index = jax.process_count(), jax.process_index()
    devices = jax.devices()[:1] if one_device else jax.devices()
    trainer = loopax.Trainer(
        model_fn, loopax.losses.mean_squared_error, optax.sgd(0.1), devices=devices
    )
    loop = loopax.Loop(trainer)
    dataset = loopax.IterableDataset(lambda: local_share(count, index), name="share")
    metrics = loop.run_epochs(dataset, 1)
    leaves = [np.asarray(jax.device_get(leaf)).tolist() for leaf in jax.tree.leaves(trainer.params)]
    return {
        "devices": trainer.num_devices,
        "step": trainer.global_step,
        "loss": float(metrics["loss"]),
        "params": leaves,
    }


def test_two_processes_match_one_device():
    (expected,) = multiprocess(1, 1, train, True, timeout=120)
    results = multiprocess(2, 2, train, False, timeout=120)
    assert expected["devices"] == 1 and expected["step"] == 5
    for got in results:
        assert (got["devices"], got["step"]) == (4, 5)
        np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-5, atol=1e-6)
        for leaf, want in zip(got["params"], expected["params"], strict=True):
            np.testing.assert_allclose(leaf, want, rtol=1e-5, atol=1e-6)
