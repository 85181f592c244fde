"""A checkpoint written by loopax's format version 1 (commit 33666b0, before the train metric
states were keyed by name) restores and continues exactly as the uninterrupted run did then,
and as it does now. See `v1_fixture.py` for the run behind it."""

import json
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
from v1_fixture import END_STEP, FIXTURE, SAVED_STEP, make_data, make_trainer, run, summary

import loopax
from loopax import hooks
from loopax.hooks._checkpointing._io import open_manager, read

# The fixture's numbers came from another CPU (see the test below): XLA's code for this one
# sums in another order. Measured against expected.json: at most 6e-8 absolute (2e-6
# relative, on a parameter of 0.005) with XLA's AVX-512, AVX2 and SSE4.2 code. A resume that
# restored something wrongly moves them by 1e-3 or more (adam's steps here are 1e-2 each;
# another dropout key: 1.4). 1e-6 absolute plus 1e-5 relative sits between the two with a
# margin of 10 or more on each side.
FIXTURE_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
NOISE_PARAMETER = "['Dense_0']['bias']"


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

    # What loopax wrote the checkpoint with computed, after an uninterrupted run. That run
    # was on another machine: XLA compiles for the host CPU's vector width, so its float sums
    # may differ in the last bits here (seen: 1.5e-8 on an AVX-512 machine for a fixture
    # made on an AVX2 one). Bit for bit is asserted below, against today's run on this CPU.
    # The bias of the Dense before the BatchNorm is left out: its gradient is zero in exact
    # arithmetic (the normalization removes it), so what it gets is rounding noise, which
    # adam scales up to full-size steps: it differs in every digit across CPUs.
    assert resumed["params"].keys() == expected["params"].keys()
    for key, values in expected["params"].items():
        if key != NOISE_PARAMETER:
            np.testing.assert_allclose(
                np.asarray(resumed["params"][key]), np.asarray(values), **FIXTURE_TOLERANCE
            )
    assert resumed["last_metrics"].keys() == expected["last_metrics"].keys()
    for key, value in expected["last_metrics"].items():
        np.testing.assert_allclose(resumed["last_metrics"][key], value, **FIXTURE_TOLERANCE)
    history = as_lists(resumed["history"])
    assert history.keys() == expected["history"].keys()
    for key, points in expected["history"].items():
        assert [step for step, _ in history[key]] == [step for step, _ in points], key
        np.testing.assert_allclose(
            [value for _, value in history[key]],
            [value for _, value in points],
            err_msg=key,
            **FIXTURE_TOLERANCE,
        )

    # And bit for bit on this machine: the same saved arrays loaded by hand (read with Orbax,
    # the train metric states renamed, the dataset position set) continue to the same state.
    # (A run started by hand resets the train metrics' running averages, as any run does;
    # a resumed one continues them: those two differ by design and are left out.)
    by_hand, by_hand_loop, by_hand_last = run_from_raw_arrays(tmp_path / "by_hand")
    assert by_hand_last["loss"] == last["loss"]
    for field in ("step", "params", "opt_state", "model_state", "rng"):
        want, got = by_hand.state_dict()[field], trainer.state_dict()[field]
        assert jax.tree.structure(want) == jax.tree.structure(got)
        for want_leaf, got_leaf in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
            np.testing.assert_array_equal(want_leaf, got_leaf)
    assert by_hand_loop.history["train/loss"] == [
        point for point in loop.history["train/loss"] if point[0] > SAVED_STEP
    ]


def run_from_raw_arrays(directory):
    """`run` from the fixture's step, its arrays and position set by hand (no v1 restore)."""
    manager = open_manager(ocp, FIXTURE, create=False)
    try:
        saved, bundle = read(manager, ocp, SAVED_STEP)
    finally:
        manager.close()
    names = make_trainer().train_metric_state_names  # version 1 kept them in this order
    saved["train_metrics"] = {
        name: saved["train_metrics"][str(index)] for index, name in enumerate(names)
    }
    trainer = make_trainer()
    trainer.load_state_dict(saved)
    loop = loopax.Loop(trainer)
    hooks.checkpoint(loop, directory, every_n_steps=SAVED_STEP, keep=None, restore=False)
    hooks.every_n_steps(loop, 3, "read", lambda loop, m: loop.record_train_metrics())
    data = make_data()
    data.set_state(bundle["datasets"]["train"])
    last = loop.run_to_step(data, END_STEP)
    return trainer, loop, {key: float(np.asarray(value)) for key, value in last.items()}


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
