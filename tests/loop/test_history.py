"""`History` and `Evaluation`: the record of a run's metrics under one naming scheme."""

import json
import math

import pytest

from loopax import Evaluation, History


def test_values_by_key_in_step_order_one_per_step():
    history = History()
    history.record(10, {"train/loss": 0.5})
    history.record(20, {"train/loss": 0.25, "eval/test/mean_loss": 0.3})
    history.record(20, {"train/loss": 0.2})  # the same step again replaces
    history.record(15, {"train/loss": 0.4})  # an earlier step lands in order
    assert history["train/loss"] == [(10, 0.5), (15, 0.4), (20, 0.2)]
    assert list(history) == ["train/loss", "eval/test/mean_loss"] and len(history) == 2
    assert history.value_at("train/loss", 15) == 0.4 and history.value_at("train/loss", 12) is None
    assert history.latest("eval/test/mean_loss") == (20, 0.3) and history.latest("x") is None
    history["train/loss"].append((99, 9.9))  # a copy: the history is not changed through it
    assert history.latest("train/loss") == (20, 0.2)


def test_truncate_after_drops_later_steps_and_empty_keys():
    history = History()
    history.record(5, {"a": 1.0})
    history.record(10, {"a": 2.0, "b": 3.0})
    history.truncate_after(7)
    assert dict(history) == {"a": [(5, 1.0)]}


def test_state_round_trips_through_json_with_non_finite_values():
    history = History()
    history.record(1, {"train/loss": float("nan"), "train/other": float("inf")})
    history.record(2, {"train/loss": 0.5})
    restored = History()
    restored.set_state(json.loads(json.dumps(history.get_state(), allow_nan=False)))
    assert math.isnan(restored["train/loss"][0][1]) and restored["train/loss"][1] == (2, 0.5)
    assert restored["train/other"] == [(1, float("inf"))]


def test_a_missing_key_names_the_recorded_ones():
    history = History()
    history.record(1, {"train/loss": 1.0})
    with pytest.raises(
        KeyError, match=r"no metric 'val_loss'.*\['train/loss'\].*'eval/<dataset>/<metric>'"
    ):
        history["val_loss"]


def test_to_pandas_has_a_row_per_step_and_a_column_per_key():
    pandas = pytest.importorskip("pandas")
    history = History()
    history.record(1, {"train/loss": 1.0})
    history.record(2, {"train/loss": 0.5, "eval/test/mean_loss": 0.7})
    frame = history.to_pandas()
    assert list(frame.index) == [1, 2] and frame.index.name == "step"
    assert frame.loc[2, "eval/test/mean_loss"] == 0.7 and pandas.isna(
        frame.loc[1, "eval/test/mean_loss"]
    )


def test_an_evaluation_keys_its_values_by_dataset():
    evaluation = Evaluation(step=7, dataset="val", values={"mean_loss": 0.1, "Accuracy": 0.9})
    assert evaluation.keyed() == {"eval/val/mean_loss": 0.1, "eval/val/Accuracy": 0.9}
