"""`Trainer.predict`: every example once, padded last batch included, on 1 and 4 devices."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import loopax

RNG = np.random.default_rng(0)
X = RNG.normal(size=(103, 5)).astype(np.float32)
Z = RNG.normal(size=(103, 2)).astype(np.float32)


def two_inputs_two_outputs(ctx, spec, inputs):
    hidden = nn.tanh(nn.Dense(8)(inputs[0]) + nn.Dense(8)(inputs[1]))
    hidden = nn.Dropout(0.5, deterministic=not ctx.training)(hidden)
    return [nn.Dense(3)(hidden), nn.Dense(1)(hidden)]


def by_hand(params, x, z):
    hidden = np.tanh(
        x @ params["Dense_0"]["kernel"]
        + params["Dense_0"]["bias"]
        + z @ params["Dense_1"]["kernel"]
        + params["Dense_1"]["bias"]
    )
    return [
        hidden @ params[name]["kernel"] + params[name]["bias"] for name in ("Dense_2", "Dense_3")
    ]


@pytest.fixture(params=[(1, "shard_map"), (4, "shard_map"), (4, "pmap")], ids=str)
def trainer(request):
    devices, parallel = request.param
    trainer = loopax.Trainer(
        two_inputs_two_outputs,
        lambda labels, predictions: predictions[1] ** 2,
        optax.sgd(0.1),
        devices=jax.devices()[:devices],
        parallel=parallel,
    )
    trainer.train_step(None, [X[:8], Z[:8]], [np.zeros((8,), np.float32)])
    return trainer


def test_predictions_equal_a_forward_pass_by_hand_for_every_example(trainer):
    compiled = []
    trainer.on_exec_creation(lambda info: compiled.append(info.input_shapes))
    expected = by_hand(jax.device_get(trainer.params), X, Z)
    # 103 examples in batches of 10 (rounded up to the device count): the last is padded.
    predictions = trainer.predict([X, Z], batch_size=10)
    assert [p.shape for p in predictions] == [(103, 3), (103, 1)]
    for want, got in zip(expected, predictions, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    size = -(-10 // trainer.num_devices) * trainer.num_devices
    assert compiled == [((size, 5), (size, 2))]  # one batch shape: compiled once
    again = trainer.predict([X, Z], batch_size=10)
    assert compiled == [((size, 5), (size, 2))]
    for first, second in zip(predictions, again, strict=True):
        np.testing.assert_array_equal(first, second)  # eval mode: no dropout


def test_a_dataset_and_small_inputs(trainer):
    expected = by_hand(jax.device_get(trainer.params), X, Z)
    dataset = loopax.ArrayDataset(
        [X, Z], np.zeros(103, np.float32), 16, shuffle=False, drop_remainder=False, name="all"
    )
    for want, got in zip(expected, trainer.predict(dataset), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for count in (1, 3):  # fewer examples than devices
        small = trainer.predict([X[:count], Z[:count]])
        np.testing.assert_allclose(small[0], expected[0][:count], rtol=1e-5, atol=1e-5)


def test_a_single_output_is_an_array():
    trainer = loopax.Trainer(
        lambda ctx, spec, x: nn.Dense(2)(x[0]),
        loopax.losses.mean_squared_error,
        optax.sgd(0.1),
        devices=jax.devices()[:1],
    )
    trainer.train_step(None, [X[:8]], [np.zeros((8, 2), np.float32)])
    predictions = trainer.predict(X)
    assert isinstance(predictions, np.ndarray) and predictions.shape == (103, 2)


def test_errors_name_what_is_missing_or_wrong():
    trainer = loopax.Trainer(
        lambda ctx, spec, x: nn.Dense(2)(x[0]),
        loopax.losses.mean_squared_error,
        optax.sgd(0.1),
        devices=jax.devices()[:1],
    )
    with pytest.raises(RuntimeError, match="predict needs the model's variables"):
        trainer.predict(X)
    trainer.train_step(None, [X[:8]], [np.zeros((8, 2), np.float32)])
    with pytest.raises(ValueError, match=r"different first dimensions \[5, 103\]"):
        trainer.predict([X, Z[:5]])
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        trainer.predict(X, batch_size=0)


def test_a_dataset_whose_specs_give_different_output_counts_is_refused():
    def two_heads(ctx, spec, inputs):
        out = nn.Dense(2)(inputs[0])
        return [out, out] if spec == "two" else out

    trainer = loopax.Trainer(
        two_heads, loopax.losses.mean_squared_error, optax.sgd(0.1), devices=jax.devices()[:1]
    )
    x = np.ones((4, 3), np.float32)
    trainer.train_step("one", [x], [np.ones((4, 2), np.float32)])
    batches = [("one", [x], [x]), ("two", [x], [x])]
    with pytest.raises(ValueError, match="returned 1 predictions for some batches and 2"):
        trainer.predict(loopax.IterableDataset(batches, name="mixed"))
