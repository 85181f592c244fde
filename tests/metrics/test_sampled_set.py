"""`metrics.SampledSet`: a uniform sample of examples' values over an evaluation, the same on
1 and 4 simulated devices, deterministic for a seed, fresh each evaluation, in TensorBoard."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import loopax
from loopax import hooks, metrics
from loopax.metrics import SampledSet

EXAMPLES = 37  # batches of 8, then 5: a last batch 4 devices do not divide


def model_fn(ctx, spec, inputs):
    return nn.Dense(3)(inputs[0])


def make_trainer(sampled, devices):
    return loopax.Trainer(
        model_fn,
        loopax.losses.sparse_categorical_crossentropy_logits,
        optax.sgd(0.1),
        eval_metrics=[sampled],
        devices=devices,
        seed=0,
    )


def make_data(name="test"):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(EXAMPLES, 4)).astype(np.float32)
    y = rng.integers(0, 3, size=(EXAMPLES,)).astype(np.int32)
    data = loopax.ArrayDataset(x, y, 8, name=name, shuffle=False, drop_remainder=False)
    return data, x, y


def test_the_sample_is_the_same_on_1_and_4_devices_and_fresh_each_evaluation():
    data, x, y = make_data()
    samples = {}
    for count in (1, 4):
        sampled = SampledSet("samples", 6, seed=5)
        trainer = make_trainer(sampled, jax.devices()[:count])
        assert trainer.evaluate(data)["samples"] == EXAMPLES  # sampled from every example
        first = sampled.latest
        assert trainer.evaluate(data)["samples"] == EXAMPLES  # a fresh sample: not 74
        again = sampled.latest
        np.testing.assert_array_equal(again.indices, first.indices)
        np.testing.assert_array_equal(again.rows, first.rows)
        samples[count] = first
        predictions = trainer.predict(x)
    one, four = samples[1], samples[4]
    assert len(one.indices) == 6 and one.seen == EXAMPLES
    assert one.columns == ("label", "prediction[0]", "prediction[1]", "prediction[2]")
    np.testing.assert_array_equal(four.indices, one.indices)
    # Each row is its example's label and prediction (by its index in the dataset).
    np.testing.assert_array_equal(one.rows[:, 0], y[one.indices])
    np.testing.assert_array_equal(four.rows[:, 0], y[four.indices])
    np.testing.assert_allclose(four.rows[:, 1:], one.rows[:, 1:], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(one.rows[:, 1:], predictions[one.indices], rtol=1e-5, atol=1e-6)


def chunked(metric, values, sizes):
    state = metric.init_host()
    start = 0
    for size in sizes:
        state = metric.update_host(state, values[start : start + size])
        start += size
    assert start == len(values)
    return metric.sample(state)


def test_deterministic_for_a_seed_whatever_the_chunks_and_merged_exactly():
    values = np.arange(100, dtype=np.float64)[:, None] * 10
    metric = SampledSet("s", 7, seed=3)
    whole = chunked(metric, values, [100])
    for sizes in ([1] * 100, [3, 50, 47], [7, 7, 86]):
        pieces = chunked(metric, values, sizes)
        np.testing.assert_array_equal(pieces.indices, whole.indices)
        np.testing.assert_array_equal(pieces.rows, whole.rows)
    np.testing.assert_array_equal(whole.rows[:, 0], whole.indices * 10)
    # The sample is the examples with the smallest seeded keys.
    keys = metrics._sampled.sample_keys(3, np.arange(100))
    assert sorted(whole.indices) == sorted(np.argsort(keys)[:7].tolist())
    other = chunked(SampledSet("s", 7, seed=4), values, [100])
    assert other.indices.tolist() != whole.indices.tolist()
    # Fewer examples than size: all of them.
    assert chunked(metric, values[:5], [2, 3]).indices.tolist() == [0, 1, 2, 3, 4]


def test_uniform_over_seeds():
    # 400 seeds, 40 examples, samples of 10: each example is in a sample 100 times on
    # average; a scheme that favours early, late or any examples fails the wide bounds.
    values = np.zeros((40, 1))
    counts = np.zeros(40, int)
    for seed in range(400):
        counts[chunked(SampledSet("s", 10, seed=seed), values, [13, 27]).indices] += 1
    assert counts.sum() == 4000
    assert counts.min() > 60 and counts.max() < 140, counts


def test_checkpoint_state_round_trips_and_bad_input_is_named():
    metric = SampledSet("s", 4, seed=1)
    state = metric.update_host(metric.init_host(), np.arange(30.0).reshape(10, 3))
    saved = metric.host_state_dict(state)
    loaded = metric.load_host_state_dict(saved)
    assert loaded.seen == 10 and loaded.indices.tolist() == state.indices.tolist()
    np.testing.assert_array_equal(loaded.rows, state.rows)
    more = np.arange(30.0, 60.0).reshape(10, 3)
    np.testing.assert_array_equal(
        metric.update_host(loaded, more).indices, metric.update_host(state, more).indices
    )
    with pytest.raises(ValueError, match="size must be a positive int"):
        SampledSet("s", 0)
    with pytest.raises(ValueError, match="an example has 2 values where earlier ones had 3"):
        metric.update_host(state, np.zeros((1, 2)))
    with pytest.raises(ValueError, match="holds 4 examples and size is 2"):
        SampledSet("s", 2).load_host_state_dict(saved)


def test_tensorboard_writes_each_evaluation_s_sample_as_a_table(tmp_path):
    data, _, y = make_data("val")
    sampled = SampledSet(
        "predictions",
        5,
        fn=lambda labels, predictions: jax.numpy.stack(
            [labels[0], predictions[0].argmax(-1)], axis=1
        ),
        columns=("label", "predicted"),
    )
    trainer = make_trainer(sampled, jax.devices()[:1])
    loop = loopax.Loop(trainer)
    hooks.evaluate(loop, data, every_n_steps=2)
    hooks.tensorboard(loop, tmp_path, every_n_steps=2)
    train = loopax.ArrayDataset(*make_data()[1:], 8, loop_forever=True)
    loop.run_steps(train, 4)
    events = EventAccumulator(str(tmp_path / "eval" / "val"), size_guidance={"tensors": 0})
    events.Reload()
    tables = events.Tensors("predictions")
    assert [event.step for event in tables] == [2, 4]
    text = tables[-1].tensor_proto.string_val[0].decode()
    lines = text.splitlines()
    assert lines[:4] == ["5 of 37 examples", "", "| example | label | predicted |", "|---|---|---|"]
    rows = [line.strip("| ").split(" | ") for line in lines[4:]]
    assert len(rows) == 5
    for index, label, predicted in rows:
        assert int(label) == y[int(index)] and int(predicted) in (0, 1, 2)
    # Its scalar is the number of examples sampled from, as for any eval metric.
    assert loop.history["eval/val/predictions"] == [(2, 37.0), (4, 37.0)]
