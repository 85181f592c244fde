"""The checkpoint format: version 2 keys the train metric states by name, version 1 by position."""

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from _tiny import tiny_data, tiny_trainer

import loopax
from loopax import hooks, losses, metrics
from loopax.hooks._checkpointing._format import VERSION, named_train_metrics
from loopax.hooks._checkpointing._io import open_manager, read

SAVED_STEP = 3
END_STEP = 6


def make_trainer():
    # A compiled metric before and after a host one (which has no state to save).
    return tiny_trainer(
        metrics=[
            metrics.Mean("mae", lambda y, p: abs(y[0] - p[0])),
            metrics.median_loss(losses.mean_absolute_error),
            metrics.MovingAverage("~mae", lambda y, p: abs(y[0] - p[0])),
        ]
    )


def make_dataset():
    return tiny_data(seed=1)


def run(directory):
    trainer = make_trainer()
    loop = loopax.Loop(trainer)
    checkpointer = hooks.checkpoint(loop, directory, every_n_steps=SAVED_STEP, keep=None)
    last = loop.run_to_step(make_dataset(), END_STEP)
    checkpointer.wait()
    return trainer, {key: float(np.asarray(value)) for key, value in last.items()}


def read_state(directory, step):
    manager = open_manager(ocp, directory, create=False)
    try:
        return read(manager, ocp, step)
    finally:
        manager.close()


def test_a_version_2_checkpoint_keys_the_train_metric_states_by_name(tmp_path):
    trainer, _ = run(tmp_path)
    state, bundle = read_state(tmp_path, SAVED_STEP)
    assert VERSION >= 2 and bundle["version"] == VERSION
    assert sorted(state["train_metrics"]) == ["mae", "moving_average_loss", "~mae"]
    assert trainer.train_metric_state_names == ("moving_average_loss", "mae", "~mae")


def test_a_version_2_checkpoint_restores_and_continues_bit_identically(tmp_path):
    trainer, last = run(tmp_path / "uninterrupted")
    directory = tmp_path / "resumed"
    directory.mkdir()
    (tmp_path / "uninterrupted" / str(SAVED_STEP)).rename(directory / str(SAVED_STEP))
    resumed, resumed_last = run(directory)
    assert resumed.global_step == END_STEP
    assert sorted(int(entry.name) for entry in directory.iterdir()) == [SAVED_STEP, END_STEP]
    # A host metric's state is on the host, not in checkpoints: its sample starts afresh.
    del last["median_loss"], resumed_last["median_loss"]
    assert resumed_last == last
    expected, actual = trainer.state_dict(), resumed.state_dict()
    assert jax.tree.structure(expected) == jax.tree.structure(actual)
    for want, got in zip(jax.tree.leaves(expected), jax.tree.leaves(actual), strict=True):
        np.testing.assert_array_equal(want, got)


def test_a_restored_state_holds_the_train_metric_states_saved(tmp_path):
    run(tmp_path)
    saved, _ = read_state(tmp_path, END_STEP)
    trainer = make_trainer()
    hooks.checkpoint(loopax.Loop(trainer), tmp_path)
    restored = jax.device_get(trainer.state.train_metrics)
    assert restored.keys() == saved["train_metrics"].keys()
    np.testing.assert_array_equal(
        restored["moving_average_loss"], saved["train_metrics"]["moving_average_loss"]
    )
    np.testing.assert_array_equal(restored["mae"].total, saved["train_metrics"]["mae"]["total"])
    np.testing.assert_array_equal(restored["~mae"].mean, saved["train_metrics"]["~mae"]["mean"])


def test_version_1_positions_become_the_trainers_names_in_order():
    average, accuracy = np.zeros(3, np.float32), {"mean": np.ones(()), "count": np.ones(())}
    v1 = {"params": {}, "train_metrics": {"0": average, "1": accuracy}}
    named = named_train_metrics(v1, 1, ("moving_average_loss", "Moving Average Accuracy"))
    assert list(named["train_metrics"]) == ["moving_average_loss", "Moving Average Accuracy"]
    assert named["train_metrics"]["Moving Average Accuracy"] is accuracy
    assert v1["train_metrics"].keys() == {"0", "1"}  # the state read is left as it is
    v2 = {"params": {}, "train_metrics": {"moving_average_loss": average}}
    assert named_train_metrics(v2, 2, ("moving_average_loss",)) is v2


def test_a_version_1_state_of_more_metrics_than_the_trainers_names_the_extra_one():
    trainer = make_trainer()
    batch = make_dataset().yield_batch()
    trainer.train_step(*batch)
    state = trainer.state_dict()
    by_name = state["train_metrics"]
    positions = [by_name[name] for name in trainer.train_metric_state_names]
    # Eleven positions sort as numbers, not as strings: "10" comes after "9".
    positions += [np.zeros((), np.float32)] * 8
    v1 = {**state, "train_metrics": {str(i): value for i, value in enumerate(positions)}}
    named = named_train_metrics(v1, 1, trainer.train_metric_state_names)
    assert list(named["train_metrics"]) == [
        *trainer.train_metric_state_names,
        *map(str, range(3, 11)),
    ]
    with pytest.raises(ValueError, match=r"holds \['train_metrics/10', 'train_metrics/3'"):
        trainer.load_state_dict(named)
