"""A loss's auxiliary outputs (`(loss, {name: value})`) and `Trainer(log_grad_norm=True)`.

Both become train metrics computed in the compiled step. Each value is checked against a
reference computed by hand in the same run (from the trainer's own parameters), on 1 and 4
simulated devices (tests/conftest.py), with gradient accumulation and in fused steps.
Float tolerance: rtol=1e-5, atol=1e-6 (sums run in another order on 4 devices).
"""

from __future__ import annotations

import csv

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loopax
from loopax import hooks

RTOL, ATOL = 1e-5, 1e-6
BATCH = 16

needs_four_devices = pytest.mark.skipif(
    jax.device_count() < 4,
    reason="needs 4 devices: XLA_FLAGS=--xla_force_host_platform_device_count=4 before jax loads",
)
DEVICE_COUNTS = [1, pytest.param(4, marks=needs_four_devices)]


class Classifier(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.tanh(nn.Dense(8)(x)))


def per_example_loss(labels, logits):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def loss_with_aux(labels, predictions):
    """Per-example losses, with per-example accuracy and a per-shard scalar as aux."""
    logits = predictions[0]
    accuracy = jnp.argmax(logits, -1) == labels[0]
    mean_logit = jnp.mean(logits)  # a scalar: each device's shard's, averaged over devices
    return per_example_loss(labels[0], logits), {"accuracy": accuracy, "mean_logit": mean_logit}


def data(examples=BATCH, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(examples, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0.5).astype(np.int32)
    return x, y


def logits_of(params, x):
    return np.asarray(Classifier().apply({"params": params}, x))


def hand_aux(params, x, y):
    """The aux values of a step on `x` by hand, from the parameters before it."""
    logits = logits_of(params, x)
    return {
        "accuracy": float(np.mean(np.argmax(logits, -1) == y)),
        "mean_logit": float(np.mean(logits)),
    }


def hand_gradients(params, x, y):
    """The gradient of the mean loss over the whole batch, by hand."""

    def mean_loss(p):
        logits = Classifier().apply({"params": p}, x)
        return jnp.mean(per_example_loss(y, logits))

    return jax.grad(mean_loss)(params)


def global_norm(tree):
    """The L2 norm of all leaves together, by hand in float64 (as `optax.tree.norm`)."""
    return float(np.sqrt(sum(np.sum(np.square(np.float64(a))) for a in jax.tree.leaves(tree))))


def copy(tree):
    return jax.tree.map(np.array, jax.device_get(tree))


# ---------------------------------------------------------------------------------------
# Auxiliary outputs.


@pytest.mark.parametrize("devices", DEVICE_COUNTS)
def test_aux_outputs_are_train_metrics_averaged_over_devices(devices):
    trainer = loopax.Trainer(
        Classifier(), loss_with_aux, optax.adam(0.05), devices=jax.devices()[:devices]
    )
    x, y = data()
    first = trainer.train_step(None, [x], [y])
    assert list(first) == ["loss", "moving_average_loss", "accuracy", "mean_logit"]
    assert trainer.train_metric_names == ("loss", "moving_average_loss", "accuracy", "mean_logit")
    for _ in range(3):
        before = copy(trainer.params)
        metrics = trainer.train_step(None, [x], [y])
        expected = hand_aux(before, x, y)
        for name, value in expected.items():
            np.testing.assert_allclose(float(metrics[name]), value, rtol=RTOL, atol=ATOL)
        logits = logits_of(before, x)
        np.testing.assert_allclose(
            float(metrics["loss"]),
            float(np.mean(per_example_loss(y, logits))),
            rtol=RTOL,
            atol=ATOL,
        )


def test_aux_outputs_do_not_change_training_or_evaluation():
    x, y = data()

    def plain_loss(labels, predictions):
        return per_example_loss(labels[0], predictions[0])

    one = jax.devices()[:1]
    with_aux = loopax.Trainer(Classifier(), loss_with_aux, optax.adam(0.05), devices=one)
    without = loopax.Trainer(Classifier(), plain_loss, optax.adam(0.05), devices=one)
    for _ in range(3):
        a = with_aux.train_step(None, [x], [y])
        b = without.train_step(None, [x], [y])
        assert float(a["loss"]) == float(b["loss"])
    jax.tree.map(np.testing.assert_array_equal, copy(with_aux.params), copy(without.params))
    dataset = loopax.ArrayDataset(x, y, batch_size=8, shuffle=False, name="test")
    assert with_aux.evaluate(dataset) == without.evaluate(dataset)


@pytest.mark.parametrize("devices", DEVICE_COUNTS)
def test_aux_outputs_average_over_accumulated_micro_batches(devices):
    trainer = loopax.Trainer(
        Classifier(),
        loss_with_aux,
        optax.sgd(0.1),
        devices=jax.devices()[:devices],
        accumulate_steps=2,
        log_grad_norm=True,
    )
    x, y = data(2 * BATCH)
    xs, ys = x.reshape(2, BATCH, 4), y.reshape(2, BATCH)
    trainer.train_step(None, [xs], [ys])  # creates the state
    before = copy(trainer.params)
    metrics = trainer.train_step(None, [xs], [ys])
    per_micro = [hand_aux(before, xs[i], ys[i]) for i in range(2)]
    for name in ("accuracy", "mean_logit"):
        expected = np.mean([values[name] for values in per_micro])
        np.testing.assert_allclose(float(metrics[name]), expected, rtol=RTOL, atol=ATOL)
    # The accumulated gradient is the mean loss's over both micro-batches (equal sizes).
    expected_norm = global_norm(hand_gradients(before, x, y))
    np.testing.assert_allclose(float(metrics["grad_norm"]), expected_norm, rtol=RTOL, atol=ATOL)


def run_logged(steps_per_execution, tmp_path):
    """8 steps with a writer, a CSV log and the history every step; what each recorded."""
    trainer = loopax.Trainer(
        Classifier(),
        loss_with_aux,
        optax.adam(0.05),
        devices=jax.devices()[:1],
        log_grad_norm=True,
    )
    loop = loopax.Loop(trainer, steps_per_execution=steps_per_execution)
    written = []

    class Writer(hooks.MetricWriter):
        def write_scalars(self, step, scalars):
            written.append((step, dict(scalars)))

    hooks.write_metrics(loop, Writer(), every_n_steps=1, learning_rate=False)
    log = tmp_path / f"log{steps_per_execution}.csv"
    hooks.metrics_log(loop, log, every_n_steps=1, learning_rate=False)
    x, y = data(4 * BATCH)
    loop.run_steps(loopax.ArrayDataset(x, y, BATCH, seed=1, loop_forever=True), 8)
    with open(log, newline="") as file:
        rows = [(r["metric"], int(r["step"]), float(r["value"])) for r in csv.DictReader(file)]
    return loop.history, written, rows


def test_aux_outputs_and_norms_reach_every_writer_and_the_history_fused_or_not(tmp_path):
    keys = ("train/accuracy", "train/mean_logit", "train/grad_norm", "train/update_norm")
    single_history, single_written, single_rows = run_logged(1, tmp_path)
    fused_history, fused_written, fused_rows = run_logged(4, tmp_path)
    for key in keys:
        single = single_history[key]
        assert [step for step, _ in single] == list(range(1, 9))
        fused = fused_history[key]
        assert [step for step, _ in fused] == list(range(1, 9))
        np.testing.assert_allclose(
            [v for _, v in fused], [v for _, v in single], rtol=RTOL, atol=ATOL
        )
        for history, written, rows in (
            (single_history, single_written, single_rows),
            (fused_history, fused_written, fused_rows),
        ):
            assert [(s, pytest.approx(v)) for s, v in history[key]] == [
                (step, values[key]) for step, values in written if key in values
            ]
            assert [(s, pytest.approx(v)) for s, v in history[key]] == [
                (step, value) for metric, step, value in rows if metric == key
            ]
    accuracies = [v for _, v in single_history["train/accuracy"]]
    assert all(0.0 <= a <= 1.0 for a in accuracies)


def test_aux_output_errors_name_the_culprit():
    x, y = data()
    one = jax.devices()[:1]

    def aux_named(name, value=1.0):
        def loss(labels, predictions):
            return per_example_loss(labels[0], predictions[0]), {name: value}

        return loss

    cases = [
        (aux_named("loss"), ValueError, "'loss', which is already a train metric"),
        (aux_named("a/b"), ValueError, "named 'a/b'; names must be non-empty strings"),
        (aux_named(3), TypeError, "named 3; names must be non-empty strings"),
        (aux_named("note", "text"), TypeError, "auxiliary output 'note' as a str"),
    ]
    for loss, error, message in cases:
        trainer = loopax.Trainer(Classifier(), loss, optax.sgd(0.1), devices=one)
        with pytest.raises(error, match=message):
            trainer.train_step(None, [x], [y])

    def changing(labels, predictions):
        name = "small" if predictions[0].shape[0] < BATCH else "large"
        return per_example_loss(labels[0], predictions[0]), {name: 1.0}

    trainer = loopax.Trainer(Classifier(), changing, optax.sgd(0.1), devices=one)
    trainer.train_step(None, [x], [y])
    with pytest.raises(ValueError, match=r"changed from \['large'\] to \['small'\]"):
        trainer.train_step(None, [x[:8]], [y[:8]])


# ---------------------------------------------------------------------------------------
# Gradient and update norms.


@pytest.mark.parametrize(
    "devices, options",
    [
        (1, {}),
        pytest.param(4, {}, marks=needs_four_devices),
        pytest.param(4, {"parallel": "pmap"}, marks=needs_four_devices),
        pytest.param(4, {"mesh": {"data": 4}}, marks=needs_four_devices),
    ],
)
def test_grad_norm_is_the_global_gradients_norm(devices, options):
    trainer = loopax.Trainer(
        Classifier(),
        loss_with_aux,
        optax.adam(0.05),
        devices=jax.devices()[:devices],
        log_grad_norm=True,
        **options,
    )
    x, y = data()
    first = trainer.train_step(None, [x], [y])
    assert list(first) == [
        "loss",
        "moving_average_loss",
        "grad_norm",
        "update_norm",
        "accuracy",
        "mean_logit",
    ]
    for _ in range(3):
        before = copy(trainer.params)
        metrics = trainer.train_step(None, [x], [y])
        after = copy(trainer.params)
        for name, value in hand_aux(before, x, y).items():
            np.testing.assert_allclose(float(metrics[name]), value, rtol=RTOL, atol=ATOL)
        grads = hand_gradients(before, x, y)
        np.testing.assert_allclose(
            float(metrics["grad_norm"]), global_norm(grads), rtol=RTOL, atol=ATOL
        )
        update = jax.tree.map(lambda a, b: a - b, after, before)
        np.testing.assert_allclose(
            float(metrics["update_norm"]), global_norm(update), rtol=1e-4, atol=ATOL
        )


def test_grad_norm_is_off_by_default_and_reserves_its_names_when_on():
    def plain_loss(labels, predictions):
        return per_example_loss(labels[0], predictions[0])

    one = jax.devices()[:1]
    x, y = data()
    trainer = loopax.Trainer(Classifier(), plain_loss, optax.sgd(0.1), devices=one)
    assert list(trainer.train_step(None, [x], [y])) == ["loss", "moving_average_loss"]
    metric = loopax.metrics.Mean("grad_norm", lambda labels, predictions: predictions[0])
    loopax.Trainer(Classifier(), plain_loss, optax.sgd(0.1), train_metrics=[metric])
    with pytest.raises(ValueError, match="duplicate train metric name 'grad_norm'"):
        loopax.Trainer(
            Classifier(), plain_loss, optax.sgd(0.1), train_metrics=[metric], log_grad_norm=True
        )
    with pytest.raises(TypeError, match="log_grad_norm must be True or False, got str"):
        loopax.Trainer(Classifier(), plain_loss, optax.sgd(0.1), log_grad_norm="yes")
