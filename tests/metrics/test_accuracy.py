"""Accuracy metrics against NumPy references: masks, weights, shards, jit, printing."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loopax import metrics
from loopax.testing import count_compilations

NUM_CLASSES = 5


def sparse_batch(rng, size, trailing_one=False):
    logits = rng.normal(size=(size, NUM_CLASSES)).astype(np.float32)
    labels = rng.integers(0, NUM_CLASSES, size=(size, 1) if trailing_one else size).astype(np.int32)
    return labels, logits


def binary_batch(rng, size, logits):
    labels = rng.integers(0, 2, size=size).astype(np.float32)
    predictions = rng.normal(size=size) if logits else rng.uniform(size=size)
    return labels, predictions.astype(np.float32)


def correct_np(kind, labels, predictions):
    if kind == "sparse":
        return predictions.argmax(-1) == labels.reshape(predictions.shape[:-1])
    if kind == "binary":
        return np.abs(labels - predictions) < 0.5
    return predictions * (labels - 0.5) > 0


MEAN = {
    "sparse": metrics.SparseCategoricalAccuracy,
    "binary": metrics.BinaryAccuracy,
    "logits": metrics.BinaryLogitsAccuracy,
}
MOVING = {
    "sparse": metrics.MovingAverageSparseCategoricalAccuracy,
    "binary": metrics.MovingAverageBinaryAccuracy,
    "logits": metrics.MovingAverageBinaryLogitsAccuracy,
}
KINDS = sorted(MEAN)


def make_batch(kind, rng, size):
    return (
        sparse_batch(rng, size) if kind == "sparse" else binary_batch(rng, size, kind == "logits")
    )


def shard_bounds(size, num_shards):
    return [round(i * size / num_shards) for i in range(num_shards + 1)]


def global_partial(metric, labels, predictions, bounds):
    partials = [
        metric.update([y[a:b] for y in labels], [p[a:b] for p in predictions])
        for a, b in itertools.pairwise(bounds)
    ]
    return functools.reduce(metric.merge, partials)


@pytest.mark.parametrize("num_shards", [1, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_mean_accuracy_over_batches_matches_numpy(kind, num_shards):
    rng = np.random.default_rng(0)
    metric = MEAN[kind]()
    state, all_correct = metric.init(), []
    for size in [8, 4, 16, 12]:
        labels, predictions = make_batch(kind, rng, size)
        all_correct.append(correct_np(kind, labels, predictions))
        partial = global_partial(metric, [labels], [predictions], shard_bounds(size, num_shards))
        state = metric.accumulate(state, partial)
    np.testing.assert_allclose(metric.compute(state), np.concatenate(all_correct).mean(), rtol=1e-6)


@pytest.mark.parametrize("num_shards", [1, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_moving_average_accuracy_matches_numpy(kind, num_shards):
    rng = np.random.default_rng(1)
    metric = MOVING[kind](new_example_weight=0.25)
    state, mean, count = metric.init(), 0.0, 0
    for size in [8, 4, 16, 12, 8, 4, 20]:
        labels, predictions = make_batch(kind, rng, size)
        count += 1
        weight = max(0.25, 1 / count)
        mean = mean * (1 - weight) + correct_np(kind, labels, predictions).mean() * weight
        partial = global_partial(metric, [labels], [predictions], shard_bounds(size, num_shards))
        state = metric.accumulate(state, partial)
    np.testing.assert_allclose(metric.compute(state), mean, rtol=1e-5)


def test_sparse_labels_with_trailing_one_and_ties():
    acc = metrics.SparseCategoricalAccuracy()
    logits = jnp.array([[1.0, 1.0, 0.0], [0.0, 2.0, 2.0]])  # ties go to the lowest class
    assert float(acc.compute(acc.update([jnp.array([[0], [1]])], [logits]))) == 1.0
    assert float(acc.compute(acc.update([jnp.array([1, 2])], [logits]))) == 0.0


def test_sparse_accuracy_over_sequence_axes():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(3, 4, NUM_CLASSES)).astype(np.float32)
    labels = rng.integers(0, NUM_CLASSES, size=(3, 4)).astype(np.int32)
    acc = metrics.SparseCategoricalAccuracy()
    partial = acc.update([labels], [logits])
    assert float(partial.weight) == 12.0
    np.testing.assert_allclose(
        acc.compute(partial), (logits.argmax(-1) == labels).mean(), rtol=1e-6
    )


def test_binary_edges_are_misses():
    assert (
        float(
            metrics.BinaryAccuracy().compute(
                metrics.BinaryAccuracy().update([jnp.array([1.0, 0.0])], [jnp.array([0.5, 0.5])])
            )
        )
        == 0.0
    )
    logits = metrics.BinaryLogitsAccuracy()
    assert float(logits.compute(logits.update([jnp.array([1, 0])], [jnp.array([0.0, 0.0])]))) == 0.0


@pytest.mark.parametrize("kind", ["binary", "logits"])
def test_binary_labels_may_be_bool_int_and_differ_by_trailing_one(kind):
    metric = MEAN[kind]()
    good = jnp.array([[0.9], [-0.9]]) if kind == "logits" else jnp.array([[0.9], [0.1]])
    for labels in (jnp.array([True, False]), jnp.array([1, 0]), jnp.array([[1.0], [0.0]])):
        assert float(metric.compute(metric.update([labels], [good]))) == 1.0


@pytest.mark.parametrize("order", ["mask_first", "weights_first", "mask_only", "weights_only"])
@pytest.mark.parametrize("kind", KINDS)
def test_mask_and_weights(kind, order):
    rng = np.random.default_rng(3)
    labels, predictions = make_batch(kind, rng, 16)
    mask = rng.uniform(size=16) < 0.6
    weights = rng.uniform(0.1, 2.0, size=16).astype(np.float32)
    extras = {
        "mask_first": [mask, weights],
        "weights_first": [weights, mask],
        "mask_only": [mask],
        "weights_only": [weights],
    }[order]
    weights_np = (
        np.where(mask, weights, 0.0)
        if len(extras) == 2
        else (mask.astype(np.float32) if order == "mask_only" else weights)
    )
    expected = (correct_np(kind, labels, predictions) * weights_np).sum() / weights_np.sum()
    for metric in (MEAN[kind](), MOVING[kind]()):
        partial = global_partial(metric, [labels, *extras], [predictions], shard_bounds(16, 4))
        np.testing.assert_allclose(
            metric.compute(metric.accumulate(metric.init(), partial)), expected, rtol=1e-5
        )


def test_masked_out_weights_may_be_nan():
    acc = metrics.BinaryAccuracy()
    labels = [jnp.array([1.0, 0.0]), jnp.array([True, False]), jnp.array([2.0, jnp.nan])]
    assert float(acc.compute(acc.update(labels, [jnp.array([0.9, 0.9])]))) == 1.0


def test_fully_masked_batch():
    acc, moving = (
        metrics.SparseCategoricalAccuracy(),
        metrics.MovingAverageSparseCategoricalAccuracy(),
    )
    logits = jnp.array([[1.0, 0.0], [1.0, 0.0]])
    hit = [jnp.array([0, 0]), jnp.array([True, True])]
    none = [jnp.array([0, 1]), jnp.array([False, False])]
    assert float(acc.compute(acc.update(none, [logits]))) == 0.0
    state = moving.accumulate(moving.init(), moving.update(hit, [logits]))
    state = moving.accumulate(state, moving.update(none, [logits]))  # no data: skipped
    assert int(state.count) == 1 and float(moving.compute(state)) == 1.0


@pytest.mark.parametrize(
    "extra, message",
    [
        (np.ones(3, bool), r"labels\[1\] \(mask\) has shape \(3,\); expected .*shape \(4,\)"),
        (
            np.ones((4, 1), np.float32),
            r"labels\[1\] \(weights\) has shape \(4, 1\); expected .*shape \(4,\)",
        ),
        (
            np.ones(4, np.int32),
            r"labels\[1\] has dtype int32; expected a bool mask and/or float weights",
        ),
    ],
)
@pytest.mark.parametrize("kind", KINDS)
def test_bad_extra_labels_raise_naming_expected_shapes(kind, extra, message):
    labels, predictions = make_batch(kind, np.random.default_rng(4), 4)
    for metric in (MEAN[kind](), MOVING[kind]()):
        with pytest.raises(ValueError, match=message):
            metric.update([labels, extra], [predictions])


def test_duplicate_mask_or_weights_raise():
    labels, logits = sparse_batch(np.random.default_rng(5), 4)
    acc = metrics.SparseCategoricalAccuracy()
    with pytest.raises(ValueError, match="more than one bool mask"):
        acc.update([labels, np.ones(4, bool), np.ones(4, bool)], [logits])
    with pytest.raises(ValueError, match="more than one float weights"):
        acc.update([labels, np.ones(4, np.float32), np.ones(4, np.float32)], [logits])


def test_bad_label_shapes_and_dtypes_raise():
    acc = metrics.SparseCategoricalAccuracy()
    logits = jnp.zeros((4, 3))
    with pytest.raises(ValueError, match=r"shape \(4, 2\).*expected \(4,\) or \(4, 1\)"):
        acc.update([jnp.zeros((4, 2), jnp.int32)], [logits])
    with pytest.raises(ValueError, match="integer class ids"):
        acc.update([jnp.zeros(4)], [logits])
    with pytest.raises(ValueError, match="class axis"):
        acc.update([jnp.zeros((), jnp.int32)], [jnp.zeros(())])
    with pytest.raises(ValueError, match="labels\\[0\\] and predictions\\[0\\]"):
        acc.update([], [logits])
    with pytest.raises(ValueError, match=r"BinaryAccuracy 'Accuracy'.*\(4, 2\).*\(4,\)"):
        metrics.BinaryAccuracy().update([jnp.zeros(4)], [jnp.zeros((4, 2))])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", [MEAN, MOVING], ids=["mean", "moving"])
def test_jitted_pipeline_matches_eager_and_compiles_once(kind, family):
    metric = family[kind]()
    bounds = shard_bounds(8, 4)

    @jax.jit
    def step(state, labels, predictions):
        state = metric.accumulate(state, global_partial(metric, labels, predictions, bounds))
        return state, metric.compute(state)

    rng = np.random.default_rng(6)
    state = eager = metric.init()
    compiled_per_step = []
    for _ in range(3):
        labels, predictions = make_batch(kind, rng, 8)
        mask = rng.uniform(size=8) < 0.8
        with count_compilations() as compiled:
            state, value = step(state, [labels, mask], [predictions])
        compiled_per_step.append(compiled.count)
        eager = metric.accumulate(eager, metric.update([labels, mask], [predictions]))
        np.testing.assert_allclose(value, metric.compute(eager), rtol=1e-6)
    assert compiled_per_step == [1, 0, 0]


@settings(max_examples=20, deadline=None)
@given(
    cuts=st.lists(st.integers(1, 19), min_size=3, max_size=3, unique=True),
    kind=st.sampled_from(KINDS),
    seed=st.integers(0, 2**16),
)
def test_merged_random_shards_equal_whole_batch(cuts, kind, seed):
    rng = np.random.default_rng(seed)
    labels, predictions = make_batch(kind, rng, 20)
    weights = rng.uniform(size=20).astype(np.float32)
    metric = MEAN[kind]()
    whole = metric.update([labels, weights], [predictions])
    merged = global_partial(metric, [labels, weights], [predictions], [0, *sorted(cuts), 20])
    np.testing.assert_allclose(merged, whole, rtol=1e-5)


def test_names_types_and_pretty_print():
    for cls in MEAN.values():
        metric = cls()
        assert (metric.name, metric.short_name, metric.metric_type) == (
            "Accuracy",
            "acc",
            "accuracy",
        )
        assert metric.pretty_print(jnp.float32(0.93412)) == "93.41%"
    for cls in MOVING.values():
        metric = cls()
        assert (metric.name, metric.short_name, metric.metric_type) == (
            "Moving Average Accuracy",
            "~acc",
            "accuracy",
        )
        assert metric.new_example_weight == 0.01
        assert metric.pretty_print(1.0) == "100.00%"
    renamed = metrics.BinaryAccuracy(name="Train Accuracy", short_name="tacc")
    assert (renamed.name, renamed.short_name) == ("Train Accuracy", "tacc")
    with pytest.raises(ValueError, match="new_example_weight"):
        metrics.MovingAverageBinaryAccuracy(new_example_weight=0.0)
