"""Mean and MovingAverage against NumPy references, across shards and under jit."""

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


def squared_error(labels, predictions):
    return (labels[0] - predictions[0]) ** 2


def mean_squared_error(labels, predictions):
    return jnp.mean((labels[0] - predictions[0]) ** 2)


def make_batches(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [
        ([rng.normal(size=n).astype(np.float32)], [rng.normal(size=n).astype(np.float32)])
        for n in sizes
    ]


def shard(arrays, bounds):
    return [[a[start:stop] for a in arrays] for start, stop in itertools.pairwise(bounds)]


def global_partial(metric, labels, predictions, bounds=None):
    """What the trainer does: update per device shard, then fold with merge."""
    if bounds is None:
        return metric.update(labels, predictions)
    partials = [
        metric.update(ls, ps)
        for ls, ps in zip(shard(labels, bounds), shard(predictions, bounds), strict=True)
    ]
    return functools.reduce(metric.merge, partials)


def run(metric, batches, num_shards=1):
    state = metric.init()
    for labels, predictions in batches:
        size = len(predictions[0])
        bounds = (
            None
            if num_shards == 1
            else [round(i * size / num_shards) for i in range(num_shards + 1)]
        )
        state = metric.accumulate(state, global_partial(metric, labels, predictions, bounds))
    return metric.compute(state)


SIZES = [8, 3, 16, 5]


@pytest.mark.parametrize("fn", [squared_error, mean_squared_error], ids=["per_example", "scalar"])
@pytest.mark.parametrize("num_shards", [1, 4])
def test_mean_is_example_weighted_mean_over_batches(fn, num_shards):
    batches = make_batches(SIZES if num_shards == 1 else [8, 4, 16, 12])
    errors = np.concatenate([(y[0] - p[0]) ** 2 for y, p in batches])
    value = run(metrics.Mean("mse", fn), batches, num_shards)
    np.testing.assert_allclose(value, errors.mean(), rtol=1e-5)


def test_mean_per_element_values_count_every_element():
    mean = metrics.Mean("m", lambda y, p: p[0])  # [batch, 3]: 3 elements per example
    state = mean.accumulate(mean.init(), mean.update([], [jnp.arange(6.0).reshape(2, 3)]))
    state = mean.accumulate(state, mean.update([], [jnp.full((1, 3), 10.0)]))
    assert float(state.weight) == 9.0
    np.testing.assert_allclose(mean.compute(state), (15.0 + 30.0) / 9)


def test_mean_scalar_prediction_counts_once():
    mean = metrics.Mean("m", lambda y, p: p[0])
    state = mean.init()
    for value in (1.0, 2.0, 6.0):
        state = mean.accumulate(state, mean.update([], [jnp.asarray(value)]))
    assert float(state.weight) == 3.0
    np.testing.assert_allclose(mean.compute(state), 3.0)


def test_mean_fn_may_return_mean_state():
    mean = metrics.Mean("m", lambda y, p: metrics.MeanState(jnp.sum(p[0]), jnp.asarray(2)))
    state = mean.accumulate(mean.init(), mean.update([], [jnp.array([1.0, 2.0, 3.0])]))
    assert state.total.dtype == jnp.float32 and state.weight.dtype == jnp.float32
    np.testing.assert_allclose(mean.compute(state), 3.0)


def test_mean_before_any_example_and_empty_shard_is_zero():
    mean = metrics.Mean("m", mean_squared_error)
    assert float(mean.compute(mean.init())) == 0.0
    empty = mean.update([jnp.zeros(0)], [jnp.zeros(0)])  # jnp.mean of nothing is NaN
    assert float(empty.total) == 0.0 and float(empty.weight) == 0.0


def test_mean_upcasts_low_precision_values():
    mean = metrics.Mean("m", lambda y, p: p[0])
    partial = mean.update([], [jnp.full((4096,), 1.001, jnp.bfloat16)])
    assert partial.total.dtype == jnp.float32


def test_mean_names_and_defaults():
    mean = metrics.Mean("Mean Squared Error", squared_error, metric_type="loss")
    assert (mean.name, mean.short_name, mean.metric_type) == (
        "Mean Squared Error",
        "Mean Squared Error",
        "loss",
    )
    assert metrics.Mean("x", squared_error, short_name="mse").short_name == "mse"
    assert isinstance(mean, metrics.Metric)
    assert repr(mean) == "Mean(name='Mean Squared Error')"


@pytest.mark.parametrize(
    "make",
    [
        lambda: metrics.Mean("", squared_error),
        lambda: metrics.MovingAverage("", squared_error),
        lambda: metrics.MovingAverage("ma", squared_error, new_example_weight=0.0),
        lambda: metrics.MovingAverage("ma", squared_error, new_example_weight=1.5),
    ],
)
def test_invalid_configuration_raises_at_construction(make):
    with pytest.raises(ValueError):
        make()


def test_fn_must_be_callable():
    with pytest.raises(TypeError, match="callable"):
        metrics.Mean("m", 3.0)


def test_non_numeric_fn_result_raises():
    mean = metrics.Mean("m", lambda y, p: jnp.array([1 + 2j]))
    with pytest.raises(ValueError, match="'m'.*complex"):
        mean.update([], [jnp.zeros(1)])


def moving_average_reference(batch_means, new_example_weight):
    mean, count = 0.0, 0
    for value in batch_means:
        count += 1
        weight = max(new_example_weight, 1.0 / count)
        mean = mean * (1 - weight) + value * weight
    return mean


@pytest.mark.parametrize("num_shards", [1, 4])
def test_moving_average_matches_reference(num_shards):
    sizes = [8, 4, 16, 12, 8, 20, 4, 8]
    batches = make_batches(sizes, seed=1)
    batch_means = [float(np.mean((y[0] - p[0]) ** 2)) for y, p in batches]
    ma = metrics.MovingAverage("ma", squared_error, new_example_weight=0.25)
    np.testing.assert_allclose(
        run(ma, batches, num_shards), moving_average_reference(batch_means, 0.25), rtol=1e-5
    )


def test_moving_average_is_exact_mean_of_batch_means_during_warm_up():
    ma = metrics.MovingAverage("ma", lambda y, p: p[0], new_example_weight=0.1)
    values = np.arange(1.0, 13.0, dtype=np.float32)
    state = ma.init()
    for count, value in enumerate(values, start=1):
        # Batch sizes differ, yet each batch counts once (GoMLX's rule).
        state = ma.accumulate(state, ma.update([], [jnp.full((count,), value)]))
        assert int(state.count) == count
        if count <= 10:
            np.testing.assert_allclose(ma.compute(state), values[:count].mean(), rtol=1e-6)
    after_10 = values[:10].mean()
    after_11 = after_10 * 0.9 + values[10] * 0.1
    np.testing.assert_allclose(ma.compute(state), after_11 * 0.9 + values[11] * 0.1, rtol=1e-6)


def test_moving_average_state_layout_and_skip_of_weightless_batch():
    ma = metrics.MovingAverage("ma", squared_error)
    state = ma.init()
    assert state.mean.dtype == jnp.float32 and state.count.dtype == jnp.int32
    assert state.mean.shape == () and state.count.shape == ()
    state = ma.accumulate(state, ma.update([jnp.ones(2)], [jnp.zeros(2)]))
    skipped = ma.accumulate(state, metrics.MeanState(jnp.float32(0), jnp.float32(0)))
    assert int(skipped.count) == 1 and float(skipped.mean) == 1.0


@pytest.mark.parametrize(
    "make",
    [
        lambda: metrics.Mean("m", squared_error),
        lambda: metrics.Mean("m", mean_squared_error),
        lambda: metrics.MovingAverage("ma", squared_error, new_example_weight=0.3),
    ],
)
def test_jitted_pipeline_matches_eager_and_compiles_once(make):
    metric = make()

    @jax.jit
    def step(state, labels, predictions):
        partials = [
            metric.update(ls, ps)
            for ls, ps in zip(
                shard(labels, [0, 2, 4, 6, 8]), shard(predictions, [0, 2, 4, 6, 8]), strict=True
            )
        ]
        state = metric.accumulate(state, functools.reduce(metric.merge, partials))
        return state, metric.compute(state)

    state = eager_state = metric.init()
    compiled_per_step = []
    for labels, predictions in make_batches([8, 8, 8], seed=2):
        with count_compilations() as compiled:
            state, value = step(state, labels, predictions)
        compiled_per_step.append(compiled.count)
        eager_state = metric.accumulate(eager_state, metric.update(labels, predictions))
        np.testing.assert_allclose(value, metric.compute(eager_state), rtol=1e-6)
    assert compiled_per_step == [1, 0, 0]
    assert jax.tree.map(lambda a: (a.shape, a.dtype), state) == jax.tree.map(
        lambda a: (a.shape, a.dtype), metric.init()
    )


@settings(max_examples=25, deadline=None)
@given(
    cuts=st.lists(st.integers(1, 23), min_size=3, max_size=3, unique=True), scalar_fn=st.booleans()
)
def test_merged_shards_equal_whole_batch(cuts, scalar_fn):
    ((labels, predictions),) = make_batches([24], seed=3)
    bounds = [0, *sorted(cuts), 24]
    for metric in (
        metrics.Mean("m", mean_squared_error if scalar_fn else squared_error),
        metrics.MovingAverage("ma", mean_squared_error if scalar_fn else squared_error),
    ):
        whole = metric.update(labels, predictions)
        merged = global_partial(metric, labels, predictions, bounds)
        np.testing.assert_allclose(merged, whole, rtol=1e-5)
        np.testing.assert_allclose(
            metric.compute(metric.accumulate(metric.init(), merged)),
            metric.compute(metric.accumulate(metric.init(), whole)),
            rtol=1e-5,
        )


def test_merge_is_associative():
    metric = metrics.Mean("m", squared_error)
    a, b, c = (metric.update(y, p) for y, p in make_batches([3, 5, 7], seed=4))
    np.testing.assert_allclose(
        metric.merge(metric.merge(a, b), c), metric.merge(a, metric.merge(b, c)), rtol=1e-6
    )


def test_pretty_print_uses_three_significant_digits():
    metric = metrics.Mean("m", squared_error)
    assert metric.pretty_print(jnp.float32(0.123456)) == "0.123"
    assert metric.pretty_print(1234.5) == "1.23e+03"
