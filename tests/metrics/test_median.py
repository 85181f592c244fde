"""StreamingMedian's host part (the bounded sample and its median), median_loss, and the
HostMetric protocol check; the trainer's side is in test_host_metrics.py.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from loopax import losses, metrics
from loopax.metrics._host import is_host_metric


def feed(metric, chunks):
    state = metric.init_host()
    for chunk in chunks:
        state = metric.update_host(state, np.asarray(chunk))
    return state


@pytest.mark.parametrize("count", [1, 3, 8, 100, 101])
def test_up_to_sample_size_the_median_is_numpys_over_every_value(count):
    values = np.random.default_rng(count).lognormal(size=count)
    median = metrics.StreamingMedian("median", lambda y, p: p[0], sample_size=101)
    # Chunks of uneven sizes, a 2-D one among them: every element is one value.
    chunks = [values[:1], values[1:5].reshape(2, -1), values[5:]]
    state = feed(median, chunks)
    assert state.count == state.seen == count
    assert median.compute_host(state) == pytest.approx(np.median(values), rel=1e-12)


def test_empty_sample_reports_nan():
    median = metrics.StreamingMedian("median", lambda y, p: p[0])
    assert np.isnan(median.compute_host(median.init_host()))
    assert np.isnan(median.compute_host(feed(median, [np.zeros((0,))])))


def test_past_sample_size_the_sample_stays_bounded_and_estimates_the_median():
    # GoMLX's own check: 1/r for r uniform in (0.01, 1), a skewed stream.
    rng = np.random.default_rng(0)
    values = 1.0 / rng.uniform(0.01, 1.0, size=200_000)
    median = metrics.StreamingMedian("median", lambda y, p: p[0], sample_size=10_001)
    state = feed(median, np.split(values, 200))
    assert (state.count, state.seen, state.samples.shape) == (10_001, 200_000, (10_001,))
    # Every kept value is one of the stream's, each once at most.
    assert np.isin(state.samples, values).all()
    assert len(np.unique(state.samples)) == 10_001
    estimate = median.compute_host(state)
    rank = np.mean(values <= estimate)  # where the estimate sits in the true distribution
    assert 0.49 < rank < 0.51


def test_the_sample_is_uniform_whatever_the_chunking():
    # Reservoir sampling keeps each of n values with probability sample_size / n.
    values = np.arange(40, dtype=np.float64)
    kept_in_chunks = np.zeros(40)
    kept_one_by_one = np.zeros(40)
    runs = 1500
    for seed in range(runs):
        median = metrics.StreamingMedian("m", lambda y, p: p[0], sample_size=8, seed=seed)
        kept_in_chunks[feed(median, [values[:10], values[10:]]).samples.astype(int)] += 1
        kept_one_by_one[feed(median, values[:, None]).samples.astype(int)] += 1
    for kept in (kept_in_chunks, kept_one_by_one):
        frequency = kept / runs
        # 8 / 40 = 0.2; the standard error of one frequency is about 0.01.
        assert np.all(np.abs(frequency - 0.2) < 0.05), frequency
        assert abs(frequency[:20].mean() - frequency[20:].mean()) < 0.02


def test_the_same_seed_keeps_the_same_sample():
    values = np.random.default_rng(3).normal(size=500)
    first, second, other = (
        metrics.StreamingMedian("m", lambda y, p: p[0], sample_size=50, seed=seed)
        for seed in (7, 7, 8)
    )
    assert np.array_equal(feed(first, [values]).samples, feed(second, [values]).samples)
    assert not np.array_equal(feed(first, [values]).samples, feed(other, [values]).samples)


def test_the_same_seed_keeps_the_same_sample_whatever_the_chunking():
    # The trainer folds values in when they are read: a resumed run reads at other steps.
    values = np.random.default_rng(5).normal(size=300)
    median = metrics.StreamingMedian("m", lambda y, p: p[0], sample_size=16, seed=2)
    whole = feed(median, [values])
    for chunks in (np.split(values, 30), [values[:7], values[7:200], values[200:]]):
        state = feed(median, chunks)
        np.testing.assert_array_equal(state.samples, whole.samples)
        assert median.compute_host(state) == median.compute_host(whole)


def test_init_host_starts_empty_each_time():
    median = metrics.StreamingMedian("m", lambda y, p: p[0], sample_size=5)
    feed(median, [np.arange(9.0)])
    fresh = median.init_host()
    assert (fresh.count, fresh.seen) == (0, 0)


def test_attributes_and_pretty_print():
    median = metrics.StreamingMedian(
        "Median Error", lambda y, p: p[0], short_name="med", metric_type="loss"
    )
    assert (median.name, median.short_name, median.metric_type) == ("Median Error", "med", "loss")
    assert median.sample_size == 10_001
    assert median.pretty_print(0.123456) == "0.123"
    assert repr(median) == "StreamingMedian(name='Median Error')"
    assert metrics.StreamingMedian("x", lambda y, p: p[0]).short_name == "x"


def test_device_values_are_fns():
    median = metrics.StreamingMedian("m", lambda y, p: jnp.abs(y[0] - p[0]))
    values = median.device_values([jnp.array([1.0, 3.0])], [jnp.array([2.0, 0.0])])
    np.testing.assert_array_equal(values, [1.0, 3.0])


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"name": ""}, ValueError, "non-empty name"),
        ({"name": 3}, ValueError, "non-empty name"),
        ({"fn": "abs"}, TypeError, "fn must be callable"),
        ({"sample_size": 0}, ValueError, "sample_size=0 must be >= 1"),
        ({"sample_size": 2.5}, ValueError, "sample_size must be an int"),
        ({"sample_size": True}, ValueError, "sample_size must be an int"),
    ],
)
def test_bad_arguments_raise_naming_them(kwargs, error, match):
    arguments = {"name": "median", "fn": lambda y, p: p[0], **kwargs}
    with pytest.raises(error, match=match):
        metrics.StreamingMedian(arguments.pop("name"), arguments.pop("fn"), **arguments)


def test_median_loss_gives_each_examples_loss():
    metric = metrics.median_loss(losses.mean_squared_error, sample_size=11)
    assert (metric.name, metric.short_name, metric.metric_type) == ("median_loss", "median", "loss")
    assert metric.sample_size == 11
    labels = jnp.array([[1.0, 1.0], [2.0, 0.0], [0.0, 0.0]])
    predictions = jnp.zeros((3, 2))
    values = metric.device_values([labels], [predictions])
    np.testing.assert_allclose(values, [1.0, 2.0, 0.0])


def test_median_loss_with_class_labels_and_a_mask():
    logits = jnp.array([[2.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    labels = jnp.array([0, 0, 1])
    mask = jnp.array([True, True, False])
    metric = metrics.median_loss(losses.sparse_categorical_crossentropy_logits)
    values = metric.device_values([labels, mask], [logits])
    one_by_one = [
        losses.sparse_categorical_crossentropy_logits(
            [labels[i : i + 1], mask[i : i + 1]], [logits[i : i + 1]]
        )
        for i in range(3)
    ]
    np.testing.assert_allclose(values, one_by_one, rtol=1e-6)
    assert values.shape == (3,)


def test_median_loss_needs_a_callable():
    with pytest.raises(TypeError, match="median_loss: loss_fn must be callable"):
        metrics.median_loss("mse")


def test_is_host_metric_names_what_a_partial_host_metric_lacks():
    class Partial:
        name = "partial"

        def device_values(self, labels, predictions):
            return predictions[0]

        def init_host(self):
            return []

    with pytest.raises(TypeError, match=r"missing \['update_host', 'compute_host'\]"):
        is_host_metric(Partial())
    assert not is_host_metric(metrics.Mean("mean", lambda y, p: p[0]))
    assert is_host_metric(metrics.StreamingMedian("median", lambda y, p: p[0]))


def test_the_sample_saved_as_json_goes_on_exactly_as_the_unsaved_one():
    import json

    median = metrics.StreamingMedian("median", lambda y, p: p[0], sample_size=16, seed=4)
    rng = np.random.default_rng(0)
    chunks = [rng.lognormal(size=size) for size in (7, 20, 3, 30)]
    state = feed(median, chunks[:2])  # full: the generator picks what the rest replaces
    saved = json.loads(json.dumps(median.host_state_dict(state)))  # as a checkpoint keeps it
    assert saved["count"] == 16 and saved["seen"] == 27
    loaded = median.load_host_state_dict(saved)
    for chunk in chunks[2:]:
        state = median.update_host(state, chunk)
        loaded = median.update_host(loaded, chunk)
    np.testing.assert_array_equal(loaded.samples[: loaded.count], state.samples[: state.count])
    assert (loaded.count, loaded.seen) == (state.count, state.seen)
    assert median.compute_host(loaded) == median.compute_host(state)


def test_a_sample_larger_than_sample_size_does_not_load():
    saved = metrics.StreamingMedian("median", lambda y, p: p[0], sample_size=16).host_state_dict(
        feed(metrics.StreamingMedian("median", lambda y, p: p[0], sample_size=16), [np.ones(20)])
    )
    smaller = metrics.StreamingMedian("median", lambda y, p: p[0], sample_size=8)
    with pytest.raises(ValueError, match="saved sample holds 16 values.*sample_size is 8"):
        smaller.load_host_state_dict(saved)


def test_a_host_metric_keeps_no_state_for_checkpoints_by_default():
    class MaxValue(metrics.HostMetric):
        name, short_name = "max", "max"

        def device_values(self, labels, predictions):
            return predictions[0]

        def init_host(self):
            return float("-inf")

        def update_host(self, state, values):
            return max(state, float(np.max(values)))

        def compute_host(self, state):
            return state

    metric = MaxValue()
    assert metric.host_state_dict(3.0) is None
    with pytest.raises(NotImplementedError, match="load_host_state_dict"):
        metric.load_host_state_dict({})
