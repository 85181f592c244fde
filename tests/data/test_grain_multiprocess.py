"""grain per process: ElasticIterator shards each global batch by process, and its global
position resumes a 2-process checkpoint on 1 process exactly; ShardByJaxProcess per process."""

import numpy as np
import pytest

from loopax.testing import multiprocess

# Their processes fork from one pre-imported interpreter (conftest.py, tests/zygote.py).
pytestmark = pytest.mark.usefixtures("forked_processes")

grain = pytest.importorskip("grain")

GLOBAL_BATCH = 8


def rows():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype(np.float32)
    return x, x.sum(axis=1, keepdims=True).astype(np.float32)


def elastic():
    """This process's share of every global batch of 8 (grain's ElasticIterator)."""
    import grain
    import jax

    import loopax

    x, y = rows()
    source = grain.MapDataset.source(np.arange(len(x))).map(lambda i: (x[i], y[i]))
    shard = grain.sharding.ShardOptions(jax.process_index(), jax.process_count())
    options = grain.ReadOptions(num_threads=0)
    return loopax.IterableDataset(
        lambda: grain.experimental.ElasticIterator(
            source.repeat(), GLOBAL_BATCH, shard, read_options=options
        ),
        name="grain",
    )


def model_fn(ctx, spec, inputs):
    import flax.linen as nn

    return nn.Dense(1)(nn.tanh(nn.Dense(8)(inputs[0])))


def train_to(directory, target, one_device=False):
    import jax
    import optax

    import loopax
    from loopax import hooks

    devices = jax.devices()[:1] if one_device else jax.devices()
    trainer = loopax.Trainer(
        model_fn, loopax.losses.mean_squared_error, optax.sgd(0.05), devices=devices
    )
    loop = loopax.Loop(trainer)
    checkpointer = hooks.checkpoint(loop, directory, every_n_steps=2, barrier_timeout=60)
    start, losses = trainer.global_step, []
    loop.on_step("record", lambda loop, m: losses.append(float(m["loss"])))
    loop.run_to_step(elastic(), target)
    checkpointer.wait()
    leaves = [np.asarray(leaf).tolist() for leaf in jax.tree.leaves(trainer.params)]
    return {"start": start, "losses": losses, "params": leaves}


def test_an_elastic_position_saved_by_two_processes_resumes_on_one(tmp_path):
    reference = train_to(str(tmp_path / "reference"), 8, one_device=True)  # here, 1 device
    directory = str(tmp_path / "ckpt")
    first = multiprocess(2, 2, train_to, directory, 4, timeout=120)
    for result in first:
        np.testing.assert_allclose(result["losses"], reference["losses"][:4], rtol=1e-5)
    (resumed,) = multiprocess(1, 1, train_to, directory, 8, timeout=120)
    assert resumed["start"] == 4  # the next global batch: the uninterrupted run's fifth
    np.testing.assert_allclose(resumed["losses"], reference["losses"][4:], rtol=1e-5)
    for got, want in zip(resumed["params"], reference["params"], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
