"""`metrics_log`: the plot's points as CSV or JSON lines, for pandas users."""

import csv
import json

import jax
import numpy as np
import pytest
from observability_helpers import make_data, make_trainer

import loopax
from loopax import hooks


def read_csv(path):
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def test_csv_with_train_and_eval_points(tmp_path):
    trainer = make_trainer()
    loop = loopax.Loop(trainer)
    hooks.evaluate(loop, make_data("test", 1, seed=1), every_n_steps=3, call_on_end=False)
    log = hooks.metrics_log(loop, tmp_path / "logs" / "metrics.csv", every_n_steps=2)
    loop.run_steps(make_data(loop_forever=True), 7)
    assert log.file_format == "csv"

    rows = read_csv(tmp_path / "logs" / "metrics.csv")
    assert list(rows[0]) == ["metric", "short", "type", "step", "value"]
    train_steps = sorted({int(r["step"]) for r in rows if r["metric"].startswith("train/")})
    assert train_steps == [2, 4, 6, 7]  # every 2 steps, then the end of the run
    assert {r["metric"] for r in rows if r["metric"].startswith("train/")} == {
        "train/loss",
        "train/moving_average_loss",
        "train/Moving Average Accuracy",
        "train/learning_rate",  # as Keras's CSVLogger logs `learning_rate`
    }
    rates = [float(r["value"]) for r in rows if r["metric"] == "train/learning_rate"]
    assert rates == pytest.approx([float(trainer.learning_rate_array())] * 4)
    eval_rows = [r for r in rows if r["metric"].startswith("eval/test/")]
    assert [(r["metric"], r["short"], r["type"], int(r["step"])) for r in eval_rows] == [
        ("eval/test/mean_loss", "#loss", "loss", 3),
        ("eval/test/Accuracy", "acc", "accuracy", 3),
        ("eval/test/mean_loss", "#loss", "loss", 6),
        ("eval/test/Accuracy", "acc", "accuracy", 6),
    ]
    assert float(eval_rows[-1]["value"]) == pytest.approx(loop.history["eval/test/Accuracy"][-1][1])
    # The same keys and values as the loop's history (which keeps no learning rate).
    for row in rows:
        if row["metric"] != "train/learning_rate":
            history = loop.history[row["metric"]]
            assert (int(row["step"]), pytest.approx(float(row["value"]))) in history
    assert len(rows) == 4 * 4 + 4


def test_the_learning_rate_can_be_left_out(tmp_path):
    loop = loopax.Loop(make_trainer())
    hooks.metrics_log(loop, tmp_path / "m.csv", every_n_steps=2, learning_rate=False)
    loop.run_steps(make_data(loop_forever=True), 4)
    assert "train/learning_rate" not in {r["metric"] for r in read_csv(tmp_path / "m.csv")}


def test_json_lines_and_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    trainer = make_trainer()
    loop = loopax.Loop(trainer)
    hooks.metrics_log(loop, path, every_n_steps=3)
    loop.run_steps(make_data(loop_forever=True), 3)
    checkpoint = jax.device_get(trainer.state)
    loop.run_steps(make_data(loop_forever=True), 4)

    trainer.state = jax.tree.map(np.array, checkpoint)  # resume from global step 3
    resumed = loopax.Loop(trainer)
    hooks.metrics_log(resumed, path, every_n_steps=3, format="jsonl")
    resumed.run_steps(make_data(loop_forever=True), 5)
    points = [json.loads(line) for line in path.read_text().splitlines()]
    steps = [p["step"] for p in points if p["metric"] == "train/loss"]
    assert steps == [3, 6, 8]  # 6 and 7 of the abandoned run are dropped, then run again
    assert set(points[0]) == {"metric", "short", "type", "step", "value"}


def test_bad_format(tmp_path):
    loop = loopax.Loop(make_trainer())
    with pytest.raises(ValueError, match="format must be one of"):
        hooks.metrics_log(loop, tmp_path / "m.txt", format="parquet")
    with pytest.raises(ValueError, match="n must be a positive int"):
        hooks.metrics_log(loop, tmp_path / "m.csv", every_n_steps=-1)
