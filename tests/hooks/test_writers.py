"""The one writer path: any `MetricWriter` fed by `write_metrics`, one key per metric everywhere."""

import csv
import json

import pytest
from observability_helpers import make_data, make_trainer
from tensorboard_runs import keyed_scalars

import loopax
from loopax import hooks


class ListWriter(hooks.MetricWriter):
    """A user's own output: keeps every call."""

    def __init__(self):
        self.scalars, self.truncations, self.flushes = [], [], 0

    def write_scalars(self, step, scalars):
        self.scalars.append((step, dict(scalars)))

    def truncate_after(self, step):
        self.truncations.append(step)
        self.scalars = [(s, values) for s, values in self.scalars if s <= step]

    def flush(self):
        self.flushes += 1


def test_a_user_writer_gets_train_metrics_on_its_schedule_and_every_evaluation():
    trainer = make_trainer()
    loop = loopax.Loop(trainer)
    writer = ListWriter()
    hooks.evaluate(loop, make_data("test", 1), every_n_steps=4, call_on_end=False)
    hooks.write_metrics(loop, writer, every_n_steps=3, learning_rate=True)
    loop.run_steps(make_data(loop_forever=True), 8)
    train = sorted(step for step, values in writer.scalars if "train/loss" in values)
    evals = sorted(step for step, values in writer.scalars if "eval/test/mean_loss" in values)
    assert train == [3, 6, 8] and evals == [4, 8]
    assert {key for _, values in writer.scalars for key in values} == {
        "train/loss",
        "train/moving_average_loss",
        "train/Moving Average Accuracy",
        "train/learning_rate",
        "eval/test/mean_loss",
        "eval/test/Accuracy",
    }
    assert writer.truncations == [0]  # the run's start: nothing after step 0 to drop
    assert writer.flushes == 1  # the end of the run
    for step, values in writer.scalars:
        for key, value in values.items():
            assert (step, pytest.approx(value)) in loop.history[key]


def test_write_metrics_rejects_what_is_not_a_writer():
    loop = loopax.Loop(make_trainer())
    with pytest.raises(TypeError, match="needs a loopax.hooks.MetricWriter"):
        hooks.write_metrics(loop, print)
    with pytest.raises(ValueError, match="n must be a positive int"):
        hooks.write_metrics(loop, ListWriter(), every_n_steps=0)


def test_one_key_for_one_metric_in_every_output(tmp_path):
    key = "eval/test/Accuracy"
    trainer = make_trainer()
    loop = loopax.Loop(trainer)
    hooks.evaluate(loop, make_data("test", 2, seed=1, shuffle=False), every_n_steps=3)
    hooks.tensorboard(loop, tmp_path / "tb", every_n_steps=3)
    hooks.metrics_log(loop, tmp_path / "log.csv", every_n_steps=3)
    hooks.plot(loop, tmp_path / "plot", start_step=3, factor=2, render=False)
    checkpointer = hooks.checkpoint(
        loop, tmp_path / "ckpt", every_n_steps=3, keep=1, best_metric=key, best_mode="max"
    )
    loop.run_steps(make_data(loop_forever=True), 12)
    checkpointer.wait()
    expected = loop.history[key]
    assert [step for step, _ in expected] == [3, 6, 9, 12]

    # TensorBoard's run `eval/test`, tag `Accuracy`: the same key, as a run and a tag.
    assert keyed_scalars(tmp_path / "tb")[key] == [
        (step, pytest.approx(value)) for step, value in expected
    ]
    with open(tmp_path / "log.csv", newline="") as file:
        rows = [
            (int(r["step"]), float(r["value"])) for r in csv.DictReader(file) if r["metric"] == key
        ]
    assert rows == [(step, pytest.approx(value)) for step, value in expected]
    with open(tmp_path / "plot" / "plot_points.jsonl") as file:
        points = [json.loads(line) for line in file]
    assert [(p["step"], p["value"]) for p in points if p["metric"] == key] == [
        (step, pytest.approx(value)) for step, value in expected
    ]
    # The checkpoint hook ranks its saves by the same key and values.
    assert dict(expected)[checkpointer.best_step()] == max(value for _, value in expected)
