"""Host metrics in the trainer: values gathered from every device, left on the device until
read, read for the step they came from, bounded when never read; through a real Loop.
"""

import csv

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loopax
from loopax import hooks, metrics
from loopax.trainer import _host_metrics


def dense_model(ctx, spec, inputs):
    return nn.Dense(1)(inputs[0])


def squared_error(labels, predictions):
    return jnp.mean((labels[0] - predictions[0]) ** 2)


def abs_errors(labels, predictions):
    return jnp.abs(labels[0] - predictions[0])[:, 0]  # per example


def batch_mean_abs_error(labels, predictions):
    return jnp.mean(jnp.abs(labels[0] - predictions[0]))  # a scalar: the batch mean


def frozen_trainer(devices=1, parallel="shard_map", train=True, eval_=True):
    """Learning rate 0: the parameters stay the initial ones, so the host can recompute
    every value."""
    median_metrics = lambda: [  # noqa: E731
        metrics.StreamingMedian("median_error", abs_errors, short_name="med"),
        metrics.Mean("mean_error", abs_errors),
        metrics.StreamingMedian("median_batch_error", batch_mean_abs_error),
    ]
    return loopax.Trainer(
        dense_model,
        squared_error,
        optax.sgd(0.0),
        train_metrics=median_metrics() if train else (),
        eval_metrics=median_metrics() if eval_ else (),
        devices=jax.devices()[:devices],
        parallel=parallel,
    )


def make_batch(rng, batch_size=8):
    x = rng.normal(size=(batch_size, 3)).astype(np.float32)
    y = rng.normal(size=(batch_size, 1)).astype(np.float32)
    return x, y


def host_errors(trainer, x, y):
    params = jax.device_get(trainer.params)["Dense_0"]
    return np.abs(y - (x @ params["kernel"] + params["bias"]))[:, 0]


def count_fetches(monkeypatch):
    fetched = []
    real_fetch = _host_metrics.fetch

    def counting_fetch(entries):
        fetched.append(len(entries))
        return real_fetch(entries)

    monkeypatch.setattr(_host_metrics, "fetch", counting_fetch)
    return fetched


@pytest.mark.parametrize(
    "devices, parallel", [(1, "shard_map"), (4, "shard_map"), (4, "pmap")], ids=str
)
def test_train_median_equals_numpys_over_every_example(devices, parallel):
    trainer = frozen_trainer(devices, parallel, eval_=False)
    rng = np.random.default_rng(0)
    errors, batch_means = [], []
    for _ in range(6):
        x, y = make_batch(rng)
        values = trainer.train_step(None, [x], [y])
        errors.extend(host_errors(trainer, x, y))
        batch_means.append(host_errors(trainer, x, y).mean())
        assert list(values) == [
            "loss",
            "moving_average_loss",
            "median_error",
            "mean_error",
            "median_batch_error",
        ]
        assert float(values["median_error"]) == pytest.approx(np.median(errors), rel=1e-6)
        assert float(values["median_batch_error"]) == pytest.approx(
            np.median(batch_means), rel=1e-6
        )
    # The compiled metric beside it is unaffected.
    assert float(values["mean_error"]) == pytest.approx(np.mean(errors), rel=1e-5)


@pytest.mark.parametrize(
    "devices, parallel", [(1, "shard_map"), (4, "shard_map"), (4, "pmap")], ids=str
)
def test_eval_median_counts_every_example_once_for_any_batch_size(devices, parallel):
    trainer = frozen_trainer(devices, parallel, train=False)
    rng = np.random.default_rng(1)
    trainer.train_step(None, *[[a] for a in make_batch(rng)])
    x, y = make_batch(rng, 23)
    # Batches of 7, 7, 7 and 2: none divisible by 4 devices, the last smaller than 4.
    dataset = loopax.ArrayDataset(x, y, 7, name="test", drop_remainder=False, shuffle=False)
    result = trainer.evaluate(dataset)
    errors = host_errors(trainer, x, y)
    assert list(result) == ["mean_loss", "median_error", "mean_error", "median_batch_error"]
    assert all(type(value) is float for value in result.values())
    assert result["median_error"] == pytest.approx(np.median(errors), rel=1e-6)
    batch_means = [errors[start : start + 7].mean() for start in range(0, 23, 7)]
    assert result["median_batch_error"] == pytest.approx(np.median(batch_means), rel=1e-6)
    # evaluate() starts afresh each time: a second evaluation of other data forgets the first.
    x2, y2 = make_batch(rng, 12)
    again = trainer.evaluate(loopax.ArrayDataset(x2, y2, 4, name="other", shuffle=False))
    assert again["median_error"] == pytest.approx(np.median(host_errors(trainer, x2, y2)), rel=1e-6)


def test_nothing_is_read_per_step_until_a_value_is_read(monkeypatch):
    fetched = count_fetches(monkeypatch)
    trainer = frozen_trainer(4, eval_=False)
    rng = np.random.default_rng(2)
    errors, steps = [], []
    for _ in range(20):
        x, y = make_batch(rng)
        steps.append(trainer.train_step(None, [x], [y]))
        errors.append(host_errors(trainer, x, y))
    assert fetched == []  # 20 steps, no reader: no transfer
    assert float(steps[-1]["median_error"]) == pytest.approx(np.median(errors), rel=1e-6)
    assert fetched == [20]  # one read fetched the 20 pending steps at once
    # Each step's value is the median through that step, whenever it is read: step 5's,
    # read after step 20's, does not include the later steps.
    assert float(steps[4]["median_error"]) == pytest.approx(np.median(errors[:5]), rel=1e-6)
    assert np.asarray(steps[9]["median_error"]) == pytest.approx(np.median(errors[:10]), rel=1e-6)
    assert float(steps[-1]["median_error"]) == pytest.approx(np.median(errors), rel=1e-6)
    assert fetched == [20]  # reading again, or an older step, fetches nothing


def test_values_read_later_than_newer_ones_keep_their_step(monkeypatch):
    fetched = count_fetches(monkeypatch)
    trainer = frozen_trainer(1, eval_=False)
    rng = np.random.default_rng(3)
    errors = []
    first = None
    for step in range(6):
        x, y = make_batch(rng)
        values = trainer.train_step(None, [x], [y])
        errors.append(host_errors(trainer, x, y))
        if step == 1:
            first = values  # held, unread, while later steps are read
        if step >= 3:
            assert float(values["median_batch_error"]) == pytest.approx(
                np.median([e.mean() for e in errors]), rel=1e-6
            )
    assert fetched == [4, 1, 1]
    assert float(first["median_error"]) == pytest.approx(np.median(errors[:2]), rel=1e-6)
    assert (
        f"{first['median_batch_error']:.4f}" == f"{np.median([e.mean() for e in errors[:2]]):.4f}"
    )
    assert jax.device_get(first)["median_error"] == pytest.approx(np.median(errors[:2]), rel=1e-6)


def test_pending_values_stay_bounded_without_readers(monkeypatch):
    monkeypatch.setattr(_host_metrics, "MAX_PENDING", 8)
    fetched = count_fetches(monkeypatch)
    trainer = frozen_trainer(1, eval_=False)
    host = trainer.host_metric_states  # the trainer's pending values, to check them
    rng = np.random.default_rng(4)
    errors, copying = [], []
    for _ in range(30):
        x, y = make_batch(rng)
        values = trainer.train_step(None, [x], [y])
        errors.append(host_errors(trainer, x, y))
        assert host.pending_steps < 8
        copying.append(host.copied_through)
    # Copies to the host start 4 steps at a time, 4 steps before those steps are folded
    # (8 pending -> 4): the fold of steps 0-3 at step 7 reads copies started at step 3.
    assert (
        copying
        == [-1, -1, -1] + [3] * 4 + [7] * 4 + [11] * 4 + [15] * 4 + [19] * 4 + [23] * 4 + [27] * 3
    )
    assert fetched == [4] * 6
    assert float(values["median_error"]) == pytest.approx(np.median(errors), rel=1e-6)
    assert fetched == [4] * 6 + [6]


def test_reset_train_metrics_starts_the_median_afresh():
    trainer = frozen_trainer(1, eval_=False)
    rng = np.random.default_rng(5)
    x, y = make_batch(rng)
    before = trainer.train_step(None, [x], [y])
    old_errors = host_errors(trainer, x, y)
    trainer.reset_train_metrics()
    errors = []
    for _ in range(3):
        x, y = make_batch(rng)
        after = trainer.train_step(None, [x], [y])
        errors.extend(host_errors(trainer, x, y))
    assert float(after["median_error"]) == pytest.approx(np.median(errors), rel=1e-6)
    # A value from before the reset still reads its own step.
    assert float(before["median_error"]) == pytest.approx(np.median(old_errors), rel=1e-6)


def test_a_skipped_step_leaves_its_values_out():
    trainer = frozen_trainer(4, eval_=False)
    trainer.skip_non_finite_steps()
    rng = np.random.default_rng(6)
    x, y = make_batch(rng)
    trainer.train_step(None, [x], [y])
    errors = list(host_errors(trainer, x, y))
    bad_x, bad_y = make_batch(rng)
    bad_x[0, 0] = np.nan
    skipped = trainer.train_step(None, [bad_x], [bad_y])
    assert float(skipped["skipped_steps"]) == 1.0
    assert list(skipped)[-1] == "skipped_steps"
    assert float(skipped["median_error"]) == pytest.approx(np.median(errors), rel=1e-6)
    x, y = make_batch(rng)
    values = trainer.train_step(None, [x], [y])
    errors.extend(host_errors(trainer, x, y))
    assert float(values["median_error"]) == pytest.approx(np.median(errors), rel=1e-6)


def test_through_a_loop_into_the_metrics_log_and_history(tmp_path, monkeypatch):
    fetched = count_fetches(monkeypatch)
    trainer = frozen_trainer(4, eval_=False)
    trainer.train_step(None, *[[a] for a in make_batch(np.random.default_rng(7))])
    rng = np.random.default_rng(8)
    batches = [make_batch(rng) for _ in range(9)]
    loop = loopax.Loop(trainer)
    hooks.metrics_log(loop, tmp_path / "metrics.csv", every_n_steps=3, call_on_end=False)
    loop.run_steps(batches, 9)
    errors = [host_errors(trainer, x, y) for x, y in batches]
    # The run starts the metrics afresh at global step 1; the log writes after global
    # steps 3, 6 and 9 (its 2nd, 5th and 8th batches), each the median through its step.
    history = loop.history["train/median_error"]
    assert [step for step, _ in history] == [3, 6, 9]
    for (_, value), through in zip(history, (2, 5, 8), strict=True):
        assert value == pytest.approx(np.median(np.concatenate(errors[:through])), rel=1e-6)
    with open(tmp_path / "metrics.csv", newline="") as file:
        rows = [row for row in csv.DictReader(file) if row["metric"] == "train/median_error"]
    assert [(row["short"], int(row["step"])) for row in rows] == [
        ("med", 3),
        ("med", 6),
        ("med", 9),
    ]
    assert [float(row["value"]) for row in rows] == pytest.approx([v for _, v in history])
    # Reads happened when the log read its steps, never once per step: each fetched the
    # steps since the previous read; the last step waits for a reader.
    assert fetched == [2, 3, 3]
    assert loop.host_metrics()["median_error"] == pytest.approx(
        np.median(np.concatenate(errors)), rel=1e-6
    )
    assert fetched == [2, 3, 3, 1]


def test_the_second_step_does_not_compile_again():
    trainer = frozen_trainer(4)
    compiled = []
    trainer.on_exec_creation(compiled.append)
    rng = np.random.default_rng(9)
    for _ in range(3):
        x, y = make_batch(rng)
        trainer.train_step(None, [x], [y])
        trainer.eval_step(None, [x], [y])
    assert [info.graph_type for info in compiled] == ["train", "eval"]


def test_host_metric_names_are_checked_with_the_others():
    median = metrics.StreamingMedian("error", abs_errors)
    with pytest.raises(ValueError, match="duplicate train metric name 'error'"):
        loopax.Trainer(
            dense_model,
            squared_error,
            optax.sgd(0.1),
            train_metrics=[median, metrics.Mean("error", abs_errors)],
        )
    with pytest.raises(ValueError, match="duplicate eval metric name 'mean_loss'"):
        loopax.Trainer(
            dense_model,
            squared_error,
            optax.sgd(0.1),
            eval_metrics=[metrics.StreamingMedian("mean_loss", abs_errors)],
        )


def test_a_host_metric_missing_methods_is_rejected_at_construction():
    class NoHostPart:
        name = "incomplete"

        def device_values(self, labels, predictions):
            return predictions[0]

    with pytest.raises(TypeError, match="HostMetric protocol"):
        loopax.Trainer(dense_model, squared_error, optax.sgd(0.1), train_metrics=[NoHostPart()])


def test_non_numeric_device_values_raise_at_the_first_step():
    median = metrics.StreamingMedian("complex", lambda y, p: p[0].astype(jnp.complex64))
    trainer = loopax.Trainer(
        dense_model,
        squared_error,
        optax.sgd(0.1),
        train_metrics=[median],
        devices=jax.devices()[:1],
    )
    x, y = make_batch(np.random.default_rng(10))
    with pytest.raises(ValueError, match="host metric 'complex'.*complex64.*real numbers"):
        trainer.train_step(None, [x], [y])


def test_a_user_host_metric_through_train_and_eval():
    class MaxAbsoluteError(metrics.HostMetric):
        name, short_name, metric_type = "max_error", "max", "loss"

        def device_values(self, labels, predictions):
            return jnp.abs(labels[0] - predictions[0])

        def init_host(self):
            return float("-inf")

        def update_host(self, state, values):
            return max(state, float(np.max(values)))

        def compute_host(self, state):
            return state

    trainer = loopax.Trainer(
        dense_model,
        squared_error,
        optax.sgd(0.0),
        train_metrics=[MaxAbsoluteError()],
        eval_metrics=[MaxAbsoluteError()],
        devices=jax.devices()[:4],
    )
    rng = np.random.default_rng(11)
    errors = []
    for _ in range(3):
        x, y = make_batch(rng)
        values = trainer.train_step(None, [x], [y])
        errors.extend(host_errors(trainer, x, y))
    assert float(values["max_error"]) == pytest.approx(max(errors), rel=1e-6)
    x, y = make_batch(rng, 10)
    result = trainer.evaluate(loopax.ArrayDataset(x, y, 10, name="test"))
    assert result["max_error"] == pytest.approx(host_errors(trainer, x, y).max(), rel=1e-6)
