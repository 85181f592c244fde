"""A checkpoint written by loopax's format version 1 (commit 33666b0, before the train metric
states were keyed by name) restores and continues exactly as the uninterrupted run did then,
and as it does now. See `v1_fixture.py` for the run behind it."""

import json
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
from v1_fixture import END_STEP, FIXTURE, SAVED_STEP, make_trainer, run, summary

import loopax
from loopax import hooks
from loopax.hooks._checkpointing._io import open_manager, read


def as_lists(history):
    return {key: [list(point) for point in points] for key, points in history.items()}


def test_fixture_is_format_version_1():
    bundle = json.loads((FIXTURE / str(SAVED_STEP) / "loopax" / "metadata").read_text())
    assert bundle["version"] == 1
    assert bundle["global_step"] == SAVED_STEP


def test_v1_checkpoint_restores_and_continues_bit_identically(tmp_path):
    expected = json.loads((FIXTURE / "expected.json").read_text())
    directory = tmp_path / "ckpt"
    shutil.copytree(FIXTURE / str(SAVED_STEP), directory / str(SAVED_STEP))

    trainer, loop, last = run(directory)
    resumed = summary(trainer, loop, last)
    assert trainer.global_step == END_STEP
    # The run resumed at the saved step, not from scratch.
    assert sorted(int(entry.name) for entry in directory.iterdir()) == [SAVED_STEP, 16, END_STEP]

    # What loopax wrote the checkpoint with computed, after an uninterrupted run:
    assert resumed["params"].keys() == expected["params"].keys()
    for key, values in expected["params"].items():
        np.testing.assert_array_equal(np.asarray(resumed["params"][key]), np.asarray(values))
    assert resumed["last_metrics"] == expected["last_metrics"]
    assert as_lists(resumed["history"]) == expected["history"]

    # And what the code of today computes uninterrupted.
    fresh_trainer, fresh_loop, fresh_last = run(tmp_path / "fresh")
    fresh = summary(fresh_trainer, fresh_loop, fresh_last)
    assert fresh["last_metrics"] == resumed["last_metrics"]
    for path_and_leaf in zip(
        jax.tree.leaves(jax.device_get(fresh_trainer.state_dict())),
        jax.tree.leaves(jax.device_get(trainer.state_dict())),
        strict=True,
    ):
        np.testing.assert_array_equal(*path_and_leaf)


def test_v1_checkpoint_restores_the_train_metric_states_under_their_names(tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(FIXTURE / str(SAVED_STEP), directory / str(SAVED_STEP))
    manager = open_manager(ocp, directory, create=False)
    try:
        saved, _ = read(manager, ocp, SAVED_STEP)
    finally:
        manager.close()
    assert sorted(saved["train_metrics"]) == ["0", "1"]  # by position, as version 1 kept them

    trainer = make_trainer()
    hooks.checkpoint(loopax.Loop(trainer), directory)
    assert trainer.global_step == SAVED_STEP
    restored = jax.device_get(trainer.state.train_metrics)
    assert sorted(restored) == ["Moving Average Accuracy", "moving_average_loss"]
    np.testing.assert_array_equal(restored["moving_average_loss"], saved["train_metrics"]["0"])
    accuracy = restored["Moving Average Accuracy"]
    np.testing.assert_array_equal(accuracy.mean, saved["train_metrics"]["1"]["mean"])
    np.testing.assert_array_equal(accuracy.count, saved["train_metrics"]["1"]["count"])
    assert int(accuracy.count) == SAVED_STEP  # a real state, not a fresh one


def test_load_params_reads_a_v1_checkpoint(tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(FIXTURE / str(SAVED_STEP), directory / str(SAVED_STEP))
    params = loopax.load_params(directory)
    trainer = make_trainer()
    hooks.checkpoint(loopax.Loop(trainer), directory)
    restored = jax.device_get(trainer.params)
    assert jax.tree.structure(params) == jax.tree.structure(restored)
    for want, got in zip(jax.tree.leaves(params), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(want, got)
