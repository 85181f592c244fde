"""Uneven evaluation shares on 2 processes: the processes agree on every batch's size and pad
with masked shards, so the results equal one process evaluating the union."""

import pytest

from loopax.testing import multiprocess

# Their processes fork from one pre-imported interpreter (conftest.py, tests/zygote.py).
pytestmark = pytest.mark.usefixtures("forked_processes")

EXAMPLES = 10
FEATURES = 5
CLASSES = 3


def _model_fn(ctx, spec, inputs):
    import flax.linen as nn

    return nn.Dense(CLASSES)(inputs[0])


def _trainer(devices):
    import optax

    import loopax

    return loopax.Trainer(
        _model_fn,
        loopax.losses.sparse_categorical_crossentropy_logits,
        optax.sgd(0.1),
        eval_metrics=[
            loopax.metrics.SparseCategoricalAccuracy(),
            loopax.metrics.StreamingMedian(
                "median_logit", lambda labels, predictions: predictions[0].max(axis=-1)
            ),
        ],
        devices=devices,
    )


def _examples():
    import numpy as np

    rng = np.random.default_rng(3)
    x = rng.normal(size=(EXAMPLES, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=(EXAMPLES,)).astype(np.int32)
    return x, y


def _batches(x, y, batch_size):
    return [
        (None, [x[i : i + batch_size]], [y[i : i + batch_size]])
        for i in range(0, len(x), batch_size)
    ]


def evaluate_shares(cuts, batch_size):
    """Each process evaluates and predicts its share (process 0: examples [:cut], 1: [cut:])."""
    import jax
    import numpy as np

    x, y = _examples()
    trainer = _trainer(jax.devices())
    reference = _trainer(jax.local_devices()[:1])
    results = []
    for cut in cuts:
        start, stop = (0, cut) if jax.process_index() == 0 else (cut, EXAMPLES)
        shared = trainer.evaluate(_batches(x[start:stop], y[start:stop], batch_size))
        union = reference.evaluate(_batches(x, y, batch_size))
        predicted = trainer.predict(x[start:stop], batch_size=batch_size)
        assert predicted.shape == (stop - start, CLASSES), predicted.shape
        if stop > start:  # one process refuses to predict no example; shares may hold none
            expected = reference.predict(x[start:stop])
            assert np.allclose(predicted, expected, atol=1e-6), (predicted, expected)
        results.append({"shared": shared, "union": union})
    return results


def test_uneven_and_empty_shares_equal_one_process_over_the_union():
    # Predictions too: every process gets its own examples' predictions, none of the padding.
    # 7 and 3 examples in batches of 4 (the case), 10 and none, none and 10, 9 and 1.
    results = multiprocess(2, 2, evaluate_shares, [7, 10, 0, 9], 4, timeout=120)
    for process in results:
        for case in process:
            assert case["shared"].keys() == case["union"].keys()
            for name, value in case["union"].items():
                assert abs(case["shared"][name] - value) <= 1e-6, (name, case)
    assert results[0] == results[1]
