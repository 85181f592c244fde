"""`check_replicas` and `metrics.SampledSet` across 2 processes x 2 CPU devices: each process
fingerprints its own devices' copies and the fingerprints are exchanged; the sample is the
same in every process and equals one device's."""

import numpy as np
import pytest

from loopax.testing import multiprocess

# Their processes fork from one pre-imported interpreter (conftest.py, tests/zygote.py).
pytestmark = pytest.mark.usefixtures("forked_processes")

EXAMPLES = 40  # rounds of 16 (8 per process), then 8 (4 per process)


def model_fn(ctx, spec, inputs):
    import flax.linen as nn

    return nn.Dense(3)(inputs[0])


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(EXAMPLES, 4)).astype(np.float32)
    y = rng.integers(0, 3, size=(EXAMPLES,)).astype(np.int32)
    return x, y


def shares(num_processes, process_id, batch):
    """Each process's rows of every global batch of `batch` examples, in dataset order."""
    x, y = data()
    for start in range(0, EXAMPLES, batch):
        rows = np.array_split(np.arange(start, min(start + batch, EXAMPLES)), num_processes)
        mine = rows[process_id]
        yield [x[mine]], [y[mine]]


def run(one_device):
    import jax
    import optax

    import loopax

    count, index = jax.process_count(), jax.process_index()
    sampled = loopax.metrics.SampledSet("samples", 7, seed=2)
    trainer = loopax.Trainer(
        model_fn,
        loopax.losses.sparse_categorical_crossentropy_logits,
        optax.sgd(0.1),
        eval_metrics=[sampled],
        devices=jax.devices()[:1] if one_device else jax.devices(),
    )
    train = loopax.IterableDataset(lambda: shares(count, index, 16), name="train")
    loopax.Loop(trainer).run_steps(train, 2)
    evaluation = loopax.IterableDataset(lambda: shares(count, index, 16), name="test")
    result = {
        "compared": trainer.check_replicas(),
        "seen": trainer.evaluate(evaluation)["samples"],
        "indices": sampled.latest.indices.tolist(),
        "labels": sampled.latest.rows[:, 0].tolist(),
    }
    if one_device:
        return result
    # One ulp changed in the copy of a replicated kernel on process 1's second device.
    placed = trainer._placed.device_state
    kernel = placed.params["Dense_0"]["kernel"]
    target = jax.devices()[3]
    copies = []
    for shard in kernel.addressable_shards:
        value = np.array(shard.data)
        if shard.device == target:
            value[0, 0] = np.nextafter(value[0, 0], np.float32(np.inf))
        copies.append(jax.device_put(value, shard.device))
    corrupted = jax.make_array_from_single_device_arrays(kernel.shape, kernel.sharding, copies)
    params = {"Dense_0": {**placed.params["Dense_0"], "kernel": corrupted}}
    trainer._placed.device_state = placed.replace(params=params)
    try:
        trainer.check_replicas()
    except loopax.ReplicaMismatchError as error:
        result["error"] = [error.path, error.device.id, error.device.process_index, str(error)]
    result["target"] = target.id
    return result


def test_every_process_finds_the_copy_that_differs_and_samples_the_same_examples():
    (reference,) = multiprocess(1, 1, run, True, timeout=120)
    results = multiprocess(2, 2, run, False, timeout=180)
    _, y = data()
    assert reference["seen"] == EXAMPLES and len(reference["indices"]) == 7
    assert reference["labels"] == y[reference["indices"]].tolist()
    for got in results:
        # step, kernel, bias, the loss average: replicated over the 4 devices of 2 processes
        assert got["compared"] == 4
        assert got["seen"] == EXAMPLES
        assert got["indices"] == reference["indices"]  # the same examples as on one device
        assert got["labels"] == reference["labels"]
        path, device_id, process, message = got["error"]
        # Named in both processes, though only process 1 holds that copy.
        assert (path, device_id, process) == ("params/Dense_0/kernel", got["target"], 1)
        assert "(process 1) from device" in message
