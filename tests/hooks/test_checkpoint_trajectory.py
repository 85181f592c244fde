"""A run that goes on from an older checkpoint never leaves the newer ones to pass for its own.

Train to 10 with checkpoints 3, 6, 9, 10; a new process restores 6 (`restore(6)`,
`restore_best()`) and trains another path to 10. The old 9 and 10 belong to the trajectory
it left: they are moved to `abandoned/`, this run's 9 and 10 are saved in their place, the
next resume restores this run's 10, and the logs hold this run's points (issue 35, item 2).
Real Orbax checkpoints and a real CSV log throughout.
"""

import os

import jax
import numpy as np
import pytest
from _tiny import MODELS, tiny_arrays, tiny_trainer

import loopax
from loopax import hooks

BATCH_SIZE = MODELS["regression"].batch_size


def make_dataset(scale=1.0):
    inputs, labels = tiny_arrays(3 * BATCH_SIZE)
    return loopax.ArrayDataset(inputs, scale * labels, batch_size=BATCH_SIZE, loop_forever=True)


def fake_evaluation(loop, metrics):
    # The best checkpoint by this metric is step 6's.
    loop.history.record(loop.trainer.global_step, {"eval/test/mean_loss": 0.0})


def attach(loop, directory, **kwargs):
    loop.on_step(
        "evaluation at 6",
        lambda lp, m: lp.trainer.global_step == 6 and fake_evaluation(lp, m),
        loopax.Priority.EVALUATE,
    )
    return hooks.checkpoint(
        loop, directory, every_n_steps=3, keep=None, best_metric="eval/test/mean_loss", **kwargs
    )


def logged_losses(log):
    return [
        (int(p["step"]), float(p["value"])) for p in log.file.read() if p["metric"] == "train/loss"
    ]


def kernel(params):
    return np.asarray(jax.device_get(params)["Dense_0"]["kernel"])


@pytest.mark.parametrize("how", ["restore(6)", "restore_best()"])
def test_a_run_from_an_older_checkpoint_moves_the_newer_ones_aside(tmp_path, how):
    directory = tmp_path / "ckpt"
    loop = loopax.Loop(tiny_trainer())
    log = hooks.metrics_log(loop, tmp_path / "log.csv", every_n_steps=1, learning_rate=False)
    first = attach(loop, directory)
    loop.run_to_step(make_dataset(), 10)
    first.wait()
    old_losses = logged_losses(log)
    assert first.all_steps() == [3, 6, 9, 10]
    old_ten = kernel(loop.trainer.params)

    # A new process goes back to step 6 and trains another path (other labels) to 10.
    trainer = tiny_trainer()
    loop = loopax.Loop(trainer)
    log = hooks.metrics_log(loop, tmp_path / "log.csv", every_n_steps=1, learning_rate=False)
    checkpointer = attach(loop, directory)
    assert checkpointer.restored_step == 10
    assert (checkpointer.restore(6) if how == "restore(6)" else checkpointer.restore_best()) == 6
    with pytest.warns(RuntimeWarning) as caught:
        loop.run_to_step(make_dataset(scale=-3.0), 10)
    checkpointer.wait()
    messages = [str(w.message) for w in caught if "abandoned" in str(w.message)]
    assert messages == [
        f"training goes on from step 6, before checkpoints [9, 10] in {str(directory)!r}: "
        "they hold another trajectory and will not be resumed from; moved to "
        f"{str(directory / 'abandoned')!r}"
    ]
    new_ten = kernel(trainer.params)
    assert not np.array_equal(new_ten, old_ten)  # another path indeed
    assert checkpointer.all_steps() == [3, 6, 9, 10]  # this run's 9 and 10, saved
    assert sorted(os.listdir(directory / "abandoned")) == ["10", "9"]
    np.testing.assert_array_equal(kernel(checkpointer.read(10)["params"]), new_ten)
    np.testing.assert_array_equal(
        loopax.load_params(directory / "abandoned")["Dense_0"]["kernel"],
        old_ten,  # its newest: 10
    )
    # The best kept is among this trajectory's checkpoints only.
    assert checkpointer.best_step() == 6

    # The next resume restores this run's 10, not the old one.
    resumed_trainer = tiny_trainer()
    resumed = attach(loopax.Loop(resumed_trainer), directory)
    assert resumed.restored_step == 10
    np.testing.assert_array_equal(kernel(resumed_trainer.params), new_ten)
    # The log holds this run's points after step 6, once each (as after a crash).
    losses = logged_losses(log)
    assert [step for step, _ in losses] == list(range(1, 11))
    assert losses[:6] == old_losses[:6] and losses[6:] != old_losses[6:]


def test_a_restore_without_a_run_after_it_moves_nothing(tmp_path):
    directory = tmp_path / "ckpt"
    loop = loopax.Loop(tiny_trainer())
    checkpointer = attach(loop, directory)
    loop.run_to_step(make_dataset(), 10)
    assert checkpointer.restore(6) == 6  # to look at step 6, say: the newer ones stay
    assert checkpointer.all_steps() == [3, 6, 9, 10]
    assert not (directory / "abandoned").exists()
    assert attach(loopax.Loop(tiny_trainer()), directory).restored_step == 10


def test_a_fresh_start_beside_checkpoints_does_not_take_them_for_its_own(tmp_path):
    directory = tmp_path / "ckpt"
    loop = loopax.Loop(tiny_trainer())
    attach(loop, directory)
    loop.run_to_step(make_dataset(), 4)
    fresh = loopax.Loop(tiny_trainer())
    checkpointer = attach(fresh, directory, restore="never")
    with pytest.warns(
        RuntimeWarning, match=r"from step 0, before checkpoints \[3, 4\] .*abandoned"
    ):
        fresh.run_to_step(make_dataset(scale=-3.0), 3)
    checkpointer.wait()
    assert checkpointer.all_steps() == [3]
    np.testing.assert_array_equal(
        kernel(checkpointer.read(3)["params"]), kernel(fresh.trainer.params)
    )


def test_a_restore_inside_a_run_moves_the_newer_ones_at_once(tmp_path):
    directory = tmp_path / "ckpt"
    loop = loopax.Loop(tiny_trainer())
    checkpointer = attach(loop, directory)
    went_back = []

    def back_to_three(loop, metrics):  # as a rollback to a given step would
        if loop.trainer.global_step == 8 and not went_back:
            went_back.append(checkpointer.restore(3))
            went_back.append(sorted(os.listdir(directory / "abandoned")))

    loop.on_step("back to 3", back_to_three, loopax.Priority.UI)
    with pytest.warns(RuntimeWarning, match=r"from step 3, before checkpoints \[6\]"):
        loop.run_to_step(make_dataset(), 10)
    checkpointer.wait()
    assert went_back == [3, ["6"]]
    assert checkpointer.all_steps() == [3, 6, 9, 10]  # this trajectory's 6, saved again
    resumed_trainer = tiny_trainer()
    assert attach(loopax.Loop(resumed_trainer), directory).restored_step == 10
    np.testing.assert_array_equal(kernel(resumed_trainer.params), kernel(loop.trainer.params))
