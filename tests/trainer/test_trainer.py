"""The Trainer: train/eval steps, metrics, state, Context and input validation."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tiny import tiny_trainer

import loopax
from loopax import metrics

ONE_DEVICE = jax.devices()[:1]
TRUE_WEIGHTS = np.array([[1.0], [-2.0], [0.5]], np.float32)


def dense_model(ctx, spec, inputs):
    return nn.Dense(1)(inputs[0])


def squared_error(labels, predictions):
    return (labels[0] - predictions[0]) ** 2


def regression_batch(seed, batch_size=8):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch_size, 3)).astype(np.float32)
    return x, (x @ TRUE_WEIGHTS + 0.3).astype(np.float32)


def make_trainer(model_fn=dense_model, loss_fn=squared_error, optimizer=None, **kwargs):
    kwargs.setdefault("devices", ONE_DEVICE)
    return loopax.Trainer(model_fn, loss_fn, optimizer or optax.sgd(0.05), **kwargs)


def mae(labels, predictions):
    return jnp.abs(labels[0] - predictions[0])


# -- train_step -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def frozen_trainer():
    """Learning rate 0: the params stay the initial ones, so host recomputations are exact."""
    return make_trainer(
        optimizer=optax.sgd(0.0),
        train_metrics=[
            metrics.Mean("mae", mae),
            metrics.MovingAverage("ma_mae", mae, new_example_weight=0.5),
        ],
    )


def host_predictions(trainer, x):
    params = jax.device_get(trainer.params)["Dense_0"]
    return x @ params["kernel"] + params["bias"]


def test_train_step_returns_loss_moving_average_then_user_metrics_on_device(frozen_trainer):
    x, y = regression_batch(0)
    steps_before = frozen_trainer.global_step
    values = frozen_trainer.train_step(None, [x], [y])
    assert list(values) == ["loss", "moving_average_loss", "mae", "ma_mae"]
    assert all(isinstance(value, jax.Array) for value in values.values())
    assert all(value.shape == () for value in values.values())
    assert frozen_trainer.global_step == steps_before + 1


def test_loss_and_metrics_are_means_over_the_batch(frozen_trainer):
    x, y = regression_batch(1)
    frozen_trainer.reset_train_metrics()
    values = jax.device_get(frozen_trainer.train_step(None, [x], [y]))
    predictions = host_predictions(frozen_trainer, x)
    np.testing.assert_allclose(values["loss"], np.mean((y - predictions) ** 2), rtol=1e-5)
    np.testing.assert_allclose(values["mae"], np.mean(np.abs(y - predictions)), rtol=1e-5)
    np.testing.assert_allclose(values["ma_mae"], values["mae"], rtol=1e-6)


def test_moving_average_loss_is_exact_mean_for_100_steps_then_weight_one_percent(frozen_trainer):
    frozen_trainer.reset_train_metrics()
    returned = []
    for step in range(130):
        x, y = regression_batch(step)  # a new batch each step: the losses vary
        returned.append(frozen_trainer.train_step(None, [x], [y]))
    host = jax.device_get(returned)
    losses = np.array([m["loss"] for m in host], np.float64)
    averages = np.array([m["moving_average_loss"] for m in host], np.float64)
    assert len(set(losses.round(6))) > 100, (
        "the losses should vary for this check to mean something"
    )
    expected, mean = [], 0.0
    for count, loss in enumerate(losses, start=1):
        weight = max(0.01, 1.0 / count)
        mean = mean * (1 - weight) + loss * weight
        expected.append(mean)
    np.testing.assert_allclose(averages, expected, rtol=2e-5)
    np.testing.assert_allclose(
        averages[:100], np.cumsum(losses[:100]) / np.arange(1, 101), rtol=2e-5
    )


def test_reset_train_metrics_resets_moving_averages(frozen_trainer):
    for seed in range(4):
        x, y = regression_batch(seed)
        values = jax.device_get(frozen_trainer.train_step(None, [x], [y]))
    assert values["moving_average_loss"] != pytest.approx(values["loss"])
    assert values["ma_mae"] != pytest.approx(values["mae"])
    frozen_trainer.reset_train_metrics()
    values = jax.device_get(frozen_trainer.train_step(None, [x], [y]))
    assert values["moving_average_loss"] == pytest.approx(values["loss"], rel=1e-6)
    assert values["ma_mae"] == pytest.approx(values["mae"], rel=1e-6)


def test_reset_train_metrics_before_the_first_step_is_a_no_op():
    trainer = make_trainer()
    trainer.reset_train_metrics()
    assert trainer.state is None


def test_global_step_state_and_learning():
    trainer = make_trainer(optimizer=optax.sgd(0.1))
    assert trainer.global_step == 0
    assert trainer.state is None and trainer.params is None
    assert trainer.num_devices == 1
    x, y = regression_batch(0)
    for _ in range(3):
        trainer.train_step(None, [x], [y])
    assert trainer.global_step == 3
    state = trainer.state
    assert isinstance(state, loopax.TrainState)
    for field in ("step", "params", "opt_state", "model_state", "rng", "train_metrics"):
        assert hasattr(state, field)
    assert int(jax.device_get(state.step)) == 3
    params = jax.device_get(trainer.params)
    assert params["Dense_0"]["kernel"].shape == (3, 1)
    assert params["Dense_0"]["bias"].shape == (1,)
    jax.tree.map(np.asarray, jax.device_get(state))  # host-readable
    x, y = regression_batch(0, batch_size=32)
    first = float(trainer.train_step(None, [x], [y])["loss"])
    for _ in range(50):
        last = trainer.train_step(None, [x], [y])
    assert float(last["loss"]) < 0.01 * first, "training reduces the loss"


def test_state_setter_restores_a_saved_state():
    trainer = tiny_trainer()
    x, y = regression_batch(0)
    trainer.train_step(None, [x], [y])
    saved = jax.device_get(trainer.state)
    after_one = jax.device_get(trainer.train_step(None, [x], [y])["loss"])
    trainer.train_step(None, [x], [y])
    trainer.state = jax.tree.map(np.array, saved)
    assert trainer.global_step == 1
    np.testing.assert_allclose(
        jax.device_get(trainer.train_step(None, [x], [y])["loss"]), after_one, rtol=1e-6
    )
    with pytest.raises(TypeError):
        trainer.state = {"params": saved.params}


def test_add_per_step_update_constrains_params_after_each_step():
    trainer = make_trainer(optimizer=optax.sgd(1.0))
    trainer.add_per_step_update(
        lambda params: jax.tree.map(lambda p: jnp.clip(p, -0.1, 0.1), params)
    )
    for seed in range(5):
        x, y = regression_batch(seed)
        trainer.train_step(None, [x], [y])
        leaves = jax.tree.leaves(jax.device_get(trainer.params))
        assert all(np.all(np.abs(leaf) <= 0.1 + 1e-7) for leaf in leaves)
    assert any(np.any(np.isclose(np.abs(leaf), 0.1)) for leaf in leaves), "clip should bind"


def test_add_per_step_update_added_after_compiling_takes_effect():
    trainer = make_trainer(optimizer=optax.sgd(1.0))
    x, y = regression_batch(0)
    trainer.train_step(None, [x], [y])
    trainer.add_per_step_update(lambda params: jax.tree.map(jnp.zeros_like, params))
    trainer.train_step(None, [x], [y])
    assert all(np.all(leaf == 0) for leaf in jax.tree.leaves(jax.device_get(trainer.params)))
    with pytest.raises(TypeError):
        trainer.add_per_step_update("not callable")


# -- losses from the model: loss_fn=None and ctx.add_loss -----------------------------------


def unused_parameters(inputs):
    """Zero, from a layer: a model needs trainable parameters, these never change a value."""
    return 0.0 * nn.Dense(1)(inputs[0])


def scaled_inputs_model(ctx, spec, inputs):
    """Predictions are 2x, and the model adds the non-scalar 2x as a loss."""
    predictions = 2.0 * inputs[0] + unused_parameters(inputs)
    ctx.add_loss(predictions)
    return predictions


def test_loss_fn_none_with_add_loss_mean_reduces_non_scalars():
    trainer = make_trainer(model_fn=scaled_inputs_model, loss_fn=None)
    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    values = trainer.train_step(None, [x], [])
    np.testing.assert_allclose(float(values["loss"]), np.mean(2 * x), rtol=1e-6)


def test_add_loss_is_summed_with_the_loss_function():
    trainer = make_trainer(model_fn=scaled_inputs_model, loss_fn=squared_error)
    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    y = np.ones_like(x)
    values = trainer.train_step(None, [x], [y])
    expected = np.mean((y - 2 * x) ** 2) + np.mean(2 * x)
    np.testing.assert_allclose(float(values["loss"]), expected, rtol=1e-6)


def test_add_loss_trains_the_model():
    def model(ctx, spec, inputs):
        predictions = nn.Dense(1)(inputs[0])
        ctx.add_loss(jnp.square(predictions - 3.0))  # pulls predictions to 3
        ctx.add_loss(0.0)  # a plain number also works
        return predictions

    trainer = make_trainer(model_fn=model, loss_fn=None, optimizer=optax.sgd(0.1))
    x, _ = regression_batch(0)
    first = float(trainer.train_step(None, [x], [])["loss"])
    for _ in range(40):
        last = trainer.train_step(None, [x], [])
    assert float(last["loss"]) < 0.05 * first


def test_neither_loss_fn_nor_add_loss_raises_a_clear_error_at_the_first_step():
    trainer = make_trainer(loss_fn=None)
    x, y = regression_batch(0)
    with pytest.raises(ValueError, match="no loss"):
        trainer.train_step(None, [x], [y])


def test_add_loss_rejects_non_numbers():
    def model(ctx, spec, inputs):
        ctx.add_loss("big")
        return inputs[0]

    trainer = make_trainer(model_fn=model, loss_fn=None)
    with pytest.raises(TypeError, match="add_loss"):
        trainer.train_step(None, [np.ones((2, 2), np.float32)], [])


# -- Context: RNG and training flag ---------------------------------------------------------


def random_loss_model(ctx, spec, inputs):
    """The loss is a sum of uniform draws from two RNG streams: it shows the keys."""
    ctx.add_loss(jax.random.uniform(ctx.make_rng("dropout"), (4,)))
    ctx.add_loss(10.0 * jax.random.uniform(ctx.make_rng("noise"), ()))  # any stream name works
    return inputs[0] + unused_parameters(inputs)


def test_make_rng_differs_per_step():
    trainer = make_trainer(model_fn=random_loss_model, loss_fn=None, seed=3)
    x = np.ones((2, 2), np.float32)
    losses = jax.device_get([trainer.train_step(None, [x], [])["loss"] for _ in range(4)])
    assert len(set(float(loss) for loss in losses)) == 4, "a fresh key every step"
    assert all(0.0 <= loss <= 11.0 for loss in losses)


def dropout_model(ctx, spec, inputs):
    hidden = nn.relu(nn.Dense(16)(inputs[0]))
    hidden = nn.Dropout(0.5, deterministic=not ctx.training)(hidden)
    return nn.Dense(1)(hidden)


def params_after_dropout_training(seed, steps=3):
    trainer = make_trainer(model_fn=dropout_model, seed=seed)
    x, y = regression_batch(0)
    losses = [trainer.train_step(None, [x], [y])["loss"] for _ in range(steps)]
    return jax.device_get(trainer.params), jax.device_get(losses), trainer


def test_make_rng_and_dropout_are_deterministic_from_the_seed():
    params, losses, trainer = params_after_dropout_training(seed=0)
    same_params, same_losses, _ = params_after_dropout_training(seed=0)
    jax.tree.map(np.testing.assert_array_equal, params, same_params)
    np.testing.assert_array_equal(losses, same_losses)
    other_params, _, _ = params_after_dropout_training(seed=1)
    assert not all(jax.tree.leaves(jax.tree.map(np.array_equal, params, other_params)))
    # Dropout is off in eval: the same batch gives the same loss twice.
    x, y = regression_batch(0)
    first = float(trainer.eval_step(None, [x], [y])["mean_loss"])
    trainer.reset_eval_metrics()
    assert float(trainer.eval_step(None, [x], [y])["mean_loss"]) == first


def test_ctx_training_is_true_in_train_and_false_in_eval():
    seen = []

    def model(ctx, spec, inputs):
        seen.append((ctx.training, ctx.spec, ctx.axis_name is not None))
        return nn.Dense(1)(inputs[0])

    trainer = make_trainer(model_fn=model)
    x, y = regression_batch(0)
    trainer.train_step("train-spec", [x], [y])
    traced_in_train = set(seen)
    seen.clear()
    trainer.eval_step("eval-spec", [x], [y])
    assert (True, "train-spec", True) in traced_in_train
    assert all(training for training, _, _ in traced_in_train)
    assert seen and all(not training for training, _, _ in seen)
    assert {spec for _, spec, _ in seen} == {"eval-spec"}


def test_spec_is_passed_to_the_model_function():
    def model(ctx, spec, inputs):
        return nn.Dense(spec["width"])(inputs[0])

    def loss_fn(labels, predictions):
        return jnp.mean(predictions[0] ** 2)

    trainer = make_trainer(model_fn=model, loss_fn=loss_fn)
    x, _ = regression_batch(0)
    trainer.train_step({"width": 2}, [x], [])
    assert jax.device_get(trainer.params)["Dense_0"]["kernel"].shape == (3, 2)


class MLP(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x, training):
        x = nn.Dense(self.width)(x)
        x = nn.BatchNorm(use_running_average=not training)(x)
        return nn.Dense(1)(nn.relu(x))


def test_flax_modules_inside_model_fn_with_batch_stats():
    def model(ctx, spec, inputs):
        return MLP(8)(inputs[0], ctx.training)

    trainer = make_trainer(model_fn=model, optimizer=optax.adam(0.01))
    x, y = regression_batch(0, batch_size=16)
    trainer.train_step(None, [x], [y])
    assert set(jax.device_get(trainer.params)) == {"MLP_0"}
    stats = jax.device_get(trainer.state.model_state)["batch_stats"]["MLP_0"]["BatchNorm_0"]
    first_mean = np.array(stats["mean"])
    losses = [trainer.train_step(None, [x], [y])["loss"] for _ in range(30)]
    stats = jax.device_get(trainer.state.model_state)["batch_stats"]["MLP_0"]["BatchNorm_0"]
    assert not np.allclose(stats["mean"], first_mean), "batch_stats update in training"
    losses = jax.device_get(losses)
    assert losses[-1] < losses[0]
    before = jax.device_get(trainer.state.model_state)
    trainer.evaluate(loopax.ArrayDataset(x, y, batch_size=8))
    jax.tree.map(np.testing.assert_array_equal, before, jax.device_get(trainer.state.model_state))


def test_several_inputs_and_predictions():
    def model(ctx, spec, inputs):
        joined = jnp.concatenate(inputs, axis=-1)
        return [nn.Dense(1)(joined), nn.Dense(2)(joined)]

    def loss_fn(labels, predictions):
        return jnp.mean((labels[0] - predictions[0]) ** 2) + jnp.mean(predictions[1] ** 2)

    trainer = make_trainer(model_fn=model, loss_fn=loss_fn)
    x, y = regression_batch(0)
    values = trainer.train_step(None, [x, x[:, :1]], [y])
    assert np.isfinite(float(values["loss"]))
    assert jax.device_get(trainer.params)["Dense_0"]["kernel"].shape == (4, 1)


def test_single_array_inputs_and_labels_are_accepted():
    trainer = tiny_trainer()
    x, y = regression_batch(0)
    trainer.train_step(None, x, y)
    trainer.train_step(None, (x,), (y,))
    assert trainer.global_step == 2
    assert len(trainer.executors()) == 1


# -- eval_step and evaluate -----------------------------------------------------------------


def batches_of_sizes(sizes, seed=0):
    """(inputs, labels) batches of different sizes for weighted-mean checks."""
    batches = []
    for index, size in enumerate(sizes):
        x, y = regression_batch(seed + index, batch_size=size)
        batches.append(([x], [y]))
    return batches


@pytest.fixture(scope="module")
def eval_trainer():
    trainer = make_trainer(
        train_metrics=[metrics.Mean("mae", mae)],
        eval_metrics=[
            metrics.Mean("mae", mae),
            metrics.Mean("batch_mean_abs", lambda y, p: jnp.mean(jnp.abs(p[0]))),
        ],
    )
    x, y = regression_batch(0)
    trainer.train_step(None, [x], [y])
    return trainer


def test_evaluate_returns_example_weighted_means_over_batches_of_different_sizes(eval_trainer):
    batches = batches_of_sizes([8, 2, 4])
    dataset = loopax.IterableDataset(lambda: iter(batches), name="uneven")
    results = eval_trainer.evaluate(dataset)
    assert list(results) == ["mean_loss", "mae", "batch_mean_abs"]
    assert all(isinstance(value, float) for value in results.values())
    x = np.concatenate([inputs[0] for inputs, _ in batches])
    y = np.concatenate([labels[0] for _, labels in batches])
    predictions = host_predictions(eval_trainer, x)
    np.testing.assert_allclose(results["mean_loss"], np.mean((y - predictions) ** 2), rtol=1e-5)
    np.testing.assert_allclose(results["mae"], np.mean(np.abs(y - predictions)), rtol=1e-5)
    # A metric returning a scalar per batch counts once per example of the batch.
    per_batch = [
        np.mean(np.abs(host_predictions(eval_trainer, inputs[0]))) for inputs, _ in batches
    ]
    np.testing.assert_allclose(
        results["batch_mean_abs"], np.average(per_batch, weights=[8, 2, 4]), rtol=1e-5
    )


def test_evaluate_resets_the_dataset_and_metrics_at_the_start(eval_trainer):
    batches = batches_of_sizes([4, 4, 4])
    made = []

    def make_iterator():
        made.append(1)
        return iter(batches)

    dataset = loopax.IterableDataset(make_iterator, name="counted")
    dataset.yield_batch()  # partly consumed: evaluate must start over
    first = eval_trainer.evaluate(dataset)
    # Running eval_step on other data in between must not leak into the next evaluate.
    x, y = regression_batch(99)
    eval_trainer.eval_step(None, [x], [100 * y])
    second = eval_trainer.evaluate(dataset)
    assert first == second
    assert len(made) == 3
    steps_before = eval_trainer.global_step
    params_before = jax.device_get(eval_trainer.params)
    eval_trainer.evaluate(dataset)
    assert eval_trainer.global_step == steps_before
    jax.tree.map(np.testing.assert_array_equal, params_before, jax.device_get(eval_trainer.params))


def test_eval_step_returns_running_values(eval_trainer):
    eval_trainer.reset_eval_metrics()
    (x1,), (y1,) = batches_of_sizes([4])[0]
    (x2,), (y2,) = batches_of_sizes([4], seed=5)[0]
    first = eval_trainer.eval_step(None, [x1], [y1])
    assert list(first) == ["mean_loss", "mae", "batch_mean_abs"]
    assert all(isinstance(value, jax.Array) for value in first.values())
    second = eval_trainer.eval_step(None, [x2], [y2])
    x, y = np.concatenate([x1, x2]), np.concatenate([y1, y2])
    np.testing.assert_allclose(
        float(second["mean_loss"]), np.mean((y - host_predictions(eval_trainer, x)) ** 2), rtol=1e-5
    )
    eval_trainer.reset_eval_metrics()
    again = eval_trainer.eval_step(None, [x1], [y1])
    np.testing.assert_allclose(float(again["mean_loss"]), float(first["mean_loss"]), rtol=1e-6)


def test_evaluate_with_zero_batches_raises(eval_trainer):
    with pytest.raises(ValueError, match="empty-set"):
        eval_trainer.evaluate(loopax.IterableDataset(lambda: iter([]), name="empty-set"))


def test_evaluate_reads_a_looping_array_dataset_once_and_refuses_other_endless_ones(eval_trainer):
    x, y = regression_batch(0)
    endless = loopax.ArrayDataset(x, y, batch_size=3, name="endless", loop_forever=True)
    endless.yield_batch()
    position = endless.get_state()
    once = loopax.ArrayDataset(x, y, 3, name="once", shuffle=False, drop_remainder=False)
    # One pass over every example (the last batch short), its training position untouched.
    assert eval_trainer.evaluate(endless) == pytest.approx(eval_trainer.evaluate(once))
    assert endless.get_state() == position

    class Endless:
        name, loop_forever = "custom", True

        def yield_batch(self):
            return None, [x], [y]

        def reset(self):
            pass

    with pytest.raises(ValueError, match="'custom' loops forever"):
        eval_trainer.evaluate(Endless())


def test_evaluate_names_a_dataset_that_raises(eval_trainer):
    def broken():
        yield regression_batch(0)
        raise OSError("disk gone")

    with pytest.raises(RuntimeError, match="broken-disk") as info:
        eval_trainer.evaluate(loopax.IterableDataset(broken, name="broken-disk"))
    assert "disk gone" in str(info.value)
    assert isinstance(info.value.__cause__, OSError)


def test_eval_before_any_train_step_initializes_the_variables():
    trainer = make_trainer()
    x, y = regression_batch(0)
    results = trainer.evaluate(loopax.ArrayDataset(x, y, batch_size=4))
    assert trainer.global_step == 0
    assert trainer.params is not None
    np.testing.assert_allclose(
        results["mean_loss"], np.mean((y - host_predictions(trainer, x)) ** 2), rtol=1e-5
    )


# -- bad input ------------------------------------------------------------------------------
# (A tiny trainer of tests/_tiny.py: what is checked here does not depend on the model.)


@pytest.fixture(scope="module")
def plain_trainer():
    return tiny_trainer()


def test_non_array_inputs_raise_type_error(plain_trainer):
    with pytest.raises(TypeError, match="not an array"):
        plain_trainer.train_step(None, [[[1.0, 2.0, 3.0]]], [np.zeros((1, 1), np.float32)])
    with pytest.raises(TypeError, match="labels"):
        plain_trainer.train_step(None, [np.zeros((1, 3), np.float32)], ["label"])


def test_mismatched_batch_sizes_raise(plain_trainer):
    x, y = regression_batch(0)
    with pytest.raises(ValueError, match=r"\[4, 8\]"):
        plain_trainer.train_step(None, [x], [y[:4]])
    with pytest.raises(ValueError, match="batch size"):
        plain_trainer.eval_step("two inputs", [x, x[:2]], [y])


def test_a_rejected_batch_does_not_pin_the_number_of_inputs_of_its_spec():
    trainer = tiny_trainer()
    x, y = regression_batch(0)
    with pytest.raises(ValueError, match="batch size"):
        trainer.train_step("first", [x, x[:2]], [y])
    trainer.train_step("first", [x], [y])  # the spec's first valid use: 1 input, 1 label
    assert trainer.global_step == 1


def test_zero_inputs_raise(plain_trainer):
    with pytest.raises(ValueError, match="at least one input"):
        plain_trainer.train_step("no-inputs", [], [np.zeros((2, 1), np.float32)])


def test_scalar_inputs_raise(plain_trainer):
    with pytest.raises(ValueError, match="batch dimension"):
        plain_trainer.train_step("scalar", [np.float32(1.0)], [])


def test_bad_batch_leaves_the_trainer_usable(plain_trainer):
    x, y = regression_batch(0)
    with pytest.raises(ValueError):
        plain_trainer.train_step(None, [x], [y[:4]])
    before = plain_trainer.global_step
    plain_trainer.train_step(None, [x], [y])
    assert plain_trainer.global_step == before + 1


@pytest.mark.parametrize(
    "args, kwargs, error, message",
    [
        (("model", squared_error, optax.sgd(0.1)), {}, TypeError, "model_fn"),
        ((dense_model, "mse", optax.sgd(0.1)), {}, TypeError, "loss_fn"),
        ((dense_model, squared_error, "adam"), {}, TypeError, "optax"),
        ((dense_model, squared_error, optax.sgd(0.1)), {"parallel": "vmap"}, ValueError, "vmap"),
        ((dense_model, squared_error, optax.sgd(0.1)), {"devices": []}, ValueError, "devices"),
        (
            (dense_model, squared_error, optax.sgd(0.1)),
            {"max_executors": 0},
            ValueError,
            "max_executors",
        ),
        (
            (dense_model, squared_error, optax.sgd(0.1)),
            {"train_metrics": [metrics.Mean("m", mae), metrics.Mean("m", mae)]},
            ValueError,
            "duplicate",
        ),
        (
            (dense_model, squared_error, optax.sgd(0.1)),
            {"train_metrics": [metrics.Mean("loss", mae)]},
            ValueError,
            "duplicate",
        ),
        (
            (dense_model, squared_error, optax.sgd(0.1)),
            {"eval_metrics": [metrics.Mean("mean_loss", mae)]},
            ValueError,
            "duplicate",
        ),
        (
            (dense_model, squared_error, optax.sgd(0.1)),
            {"eval_metrics": [object()]},
            TypeError,
            "Metric",
        ),
    ],
)
def test_bad_constructor_arguments(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        loopax.Trainer(*args, **kwargs)


def test_the_same_metric_name_may_be_used_in_train_and_eval(eval_trainer):
    x, y = regression_batch(0)
    assert "mae" in eval_trainer.train_step(None, [x], [y])
    assert "mae" in eval_trainer.eval_step(None, [x], [y])


def test_a_state_with_another_rng_key_recompiles_and_uses_it():
    def dropout_model(ctx, spec, inputs):
        return nn.Dense(1)(nn.Dropout(0.5, deterministic=not ctx.training)(inputs[0]))

    x, y = regression_batch(3)
    seeded_zero = make_trainer(model_fn=dropout_model, seed=0)
    seeded_one = make_trainer(model_fn=dropout_model, seed=1)
    seeded_zero.train_step(None, [x], [y])
    seeded_one.train_step(None, [x], [y])
    compiled = []
    seeded_one.on_exec_creation(compiled.append)

    # Same params and step, but seed 0's key: the next step must draw seed 0's dropout.
    seeded_one.state = jax.device_get(seeded_zero.state)
    np.testing.assert_array_equal(seeded_one.state.rng, seeded_zero.state.rng)
    seeded_zero.train_step(None, [x], [y])
    seeded_one.train_step(None, [x], [y])
    assert len(compiled) == 1  # the key is compiled into the step
    for want, got in zip(
        jax.tree.leaves(jax.device_get(seeded_zero.params)),
        jax.tree.leaves(jax.device_get(seeded_one.params)),
        strict=True,
    ):
        np.testing.assert_array_equal(want, got)

    # Setting a state with the same key does not recompile.
    seeded_one.state = jax.device_get(seeded_one.state)
    seeded_one.train_step(None, [x], [y])
    assert len(compiled) == 1
