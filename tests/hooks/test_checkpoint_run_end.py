"""What a run waits for at its end, and what a hook raising at a save's step keeps.

A run returns once its end-of-run save is copied off the device; Orbax commits it in the
background, and whatever touches the directory next waits for it (issue 25). A save taken
at a step whose later hook raises is still committed (issue 22, item 13). Real Orbax
checkpoints throughout; the slow disk is Orbax's own commit held back.
"""

import os
import subprocess
import sys
import textwrap
import threading

import jax
import numpy as np
import pytest
from _tiny import compiled, restart, tiny_data, tiny_trainer

import loopax
from loopax import hooks

HOLD_SECONDS = 20  # how long a held commit waits at most: a regression fails, never hangs


@pytest.fixture(scope="module")
def compiled_trainer():
    # Compiling costs seconds, a step well under a millisecond: one trainer for the module.
    return compiled(tiny_trainer())


@pytest.fixture
def trainer(compiled_trainer):
    """The shared trainer, back at its freshly initialized state (step 0)."""
    return restart(*compiled_trainer)


class HeldCommits:
    """Holds Orbax's commit (the rename into place) of every checkpoint until released."""

    def __init__(self, monkeypatch):
        from orbax.checkpoint._src.path import atomicity

        self.committing = threading.Event()
        self.released = threading.Event()
        self.held_too_long = False
        original = atomicity.AtomicRenameTemporaryPath.finalize

        async def held_finalize(path, *args, **kwargs):
            self.committing.set()
            if not self.released.wait(timeout=HOLD_SECONDS):
                self.held_too_long = True  # the caller waited for this commit
            return await original(path, *args, **kwargs)

        monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", held_finalize)


def steps_on_disk(directory):
    return sorted(int(entry) for entry in os.listdir(directory) if entry.isdigit())


def test_a_run_returns_while_its_end_of_run_save_commits_in_the_background(
    trainer, tmp_path, monkeypatch
):
    held = HeldCommits(monkeypatch)
    loop = loopax.Loop(trainer)
    checkpointer = hooks.checkpoint(loop, tmp_path, every_n_steps=100)  # only the end's save
    metrics = loop.run_steps(tiny_data(), 3)
    assert not held.held_too_long, "run_steps waited for its end-of-run save's commit"
    assert held.committing.wait(timeout=HOLD_SECONDS)  # under way, its state taken at step 3
    assert steps_on_disk(tmp_path) == [] and float(metrics["loss"]) > 0
    saved = trainer.state_dict()
    held.released.set()
    loop.run_steps(tiny_data(), 2)  # its save waits for the one in flight
    checkpointer.wait()
    assert not held.held_too_long
    assert steps_on_disk(tmp_path) == [3, 5]
    np.testing.assert_array_equal(
        checkpointer.read(3)["params"]["Dense_0"]["kernel"], saved["params"]["Dense_0"]["kernel"]
    )


def test_what_reads_the_directory_next_waits_for_the_end_of_run_save(
    trainer, tmp_path, monkeypatch
):
    held = HeldCommits(monkeypatch)
    loop = loopax.Loop(trainer)
    checkpointer = hooks.checkpoint(loop, tmp_path, every_n_steps=100)
    loop.run_steps(tiny_data(), 3)
    held.committing.wait(timeout=HOLD_SECONDS)
    threading.Timer(0.2, held.released.set).start()  # the slow disk finishes a bit later
    # Each of these sees checkpoint 3: they wait for the save in flight.
    assert checkpointer.all_steps() == [3] and checkpointer.latest_step() == 3
    assert not held.held_too_long
    params = loopax.load_params(tmp_path)
    np.testing.assert_array_equal(
        params["Dense_0"]["kernel"], jax.device_get(trainer.params)["Dense_0"]["kernel"]
    )
    resumed = hooks.checkpoint(loopax.Loop(tiny_trainer()), tmp_path)
    assert resumed.restored_step == 3


def test_load_params_waits_for_the_save_in_flight_of_its_directory(trainer, tmp_path, monkeypatch):
    held = HeldCommits(monkeypatch)
    loop = loopax.Loop(trainer)
    hooks.checkpoint(loop, tmp_path, every_n_steps=100)
    loop.run_steps(tiny_data(), 2)
    held.committing.wait(timeout=HOLD_SECONDS)
    threading.Timer(0.2, held.released.set).start()
    # Without the wait it would find no checkpoint at all (FileNotFoundError).
    params = loopax.load_params(tmp_path)
    np.testing.assert_array_equal(
        params["Dense_0"]["kernel"], jax.device_get(trainer.params)["Dense_0"]["kernel"]
    )


def test_a_failed_end_of_run_save_raises_at_wait_and_at_the_next_run(trainer, tmp_path):
    directory = tmp_path / "ckpt"
    loop = loopax.Loop(trainer)
    checkpointer = hooks.checkpoint(loop, directory, every_n_steps=100)
    loop.run_steps(tiny_data(), 1)
    checkpointer.wait()
    os.rename(directory, tmp_path / "moved")
    directory.write_text("not a directory any more")  # every write under it now fails
    loop.run_steps(tiny_data(), 1)  # returns: the save fails in the background
    with pytest.raises(hooks.BackgroundSaveError, match=r"saving a checkpoint to '.*ckpt'"):
        checkpointer.wait()
    with pytest.raises(hooks.BackgroundSaveError, match=r"saving a checkpoint to '.*ckpt'"):
        loop.run_steps(tiny_data(), 1)  # named at the next run's start
    assert trainer.global_step == 2


def test_a_run_stopped_early_waits_for_its_end_of_run_save(trainer, tmp_path, monkeypatch):
    held = HeldCommits(monkeypatch)
    loop = loopax.Loop(trainer)
    hooks.checkpoint(loop, tmp_path, every_n_steps=100)
    loop.on_step("stop", lambda loop, metrics: loop.loop_step == 1 and loop.request_stop("done"))
    threading.Timer(0.2, held.released.set).start()
    loop.run_steps(tiny_data(), 10)
    # The program usually ends after a stop: the save is on disk when the run returns.
    assert steps_on_disk(tmp_path) == [2] and loop.checkpointed_step == 2


def test_the_interpreter_exit_waits_for_the_end_of_run_save(tmp_path):
    script = textwrap.dedent(
        f"""
        import asyncio, jax, numpy as np, optax, flax.linen as nn, loopax
        from orbax.checkpoint._src.path import atomicity

        original = atomicity.AtomicRenameTemporaryPath.finalize

        async def slow_finalize(self, *args, **kwargs):
            await asyncio.sleep(1.0)  # a slow disk: the commit ends long after the run
            return await original(self, *args, **kwargs)

        atomicity.AtomicRenameTemporaryPath.finalize = slow_finalize
        trainer = loopax.Trainer(lambda ctx, spec, x: nn.Dense(1)(x[0]),
            loopax.losses.mean_squared_error, optax.sgd(0.1), devices=jax.devices()[:1])
        loop = loopax.Loop(trainer)
        loopax.hooks.checkpoint(loop, {str(tmp_path)!r}, every_n_steps=100)
        x = np.ones((8, 2), np.float32)
        loop.run_steps(loopax.ArrayDataset(x, x[:, :1], 4, loop_forever=True), 3)
        print("returned", flush=True)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "returned" in done.stdout
    assert steps_on_disk(tmp_path) == [3]
    assert not [entry for entry in os.listdir(tmp_path) if "tmp" in entry]


# -- a hook raising at a save's step (issue 22, item 13) -------------------------------------


def test_a_save_is_committed_when_a_later_hook_of_its_step_raises(trainer, tmp_path):
    loop = loopax.Loop(trainer)
    checkpointer = hooks.checkpoint(loop, tmp_path / "ckpt", every_n_steps=3)
    log = hooks.metrics_log(loop, tmp_path / "log.csv", every_n_steps=1, learning_rate=False)

    def fail(loop, metrics):
        if loop.trainer.global_step == 3:
            raise RuntimeError("a bug in a UI hook")

    loop.on_step("fail", fail, loopax.Priority.UI)
    with pytest.raises(loopax.HookError, match="a bug in a UI hook"):
        loop.run_steps(tiny_data(), 10)
    saved = trainer.state_dict()  # the state of step 3: the run stopped there
    assert checkpointer.all_steps() == [3]
    # Its logs went out before it committed, as without the error.
    points = log.file.read()
    assert sorted({point["step"] for point in points}) == [1, 2, 3]

    resumed_trainer = tiny_trainer()
    resumed = hooks.checkpoint(loopax.Loop(resumed_trainer), tmp_path / "ckpt")
    assert resumed.restored_step == 3
    np.testing.assert_array_equal(
        resumed_trainer.state_dict()["params"]["Dense_0"]["kernel"],
        saved["params"]["Dense_0"]["kernel"],
    )


def test_the_end_of_run_save_is_committed_when_a_later_end_hook_raises(trainer, tmp_path):
    loop = loopax.Loop(trainer)
    checkpointer = hooks.checkpoint(loop, tmp_path, every_n_steps=100)

    def fail(loop, metrics):
        raise RuntimeError("a bug in an end hook")

    loop.on_end("fail", fail, loopax.Priority.UI)
    with pytest.raises(loopax.HookError, match="a bug in an end hook"):
        loop.run_steps(tiny_data(), 4)
    assert checkpointer.all_steps() == [4]


def test_a_step_that_raises_before_the_save_saves_nothing(trainer, tmp_path):
    loop = loopax.Loop(trainer)
    checkpointer = hooks.checkpoint(loop, tmp_path, every_n_steps=3)

    def fail(loop, metrics):
        if loop.trainer.global_step == 3:
            raise RuntimeError("a bug in an evaluation")

    loop.on_step("fail", fail, loopax.Priority.EVALUATE)  # before the checkpoint's band
    with pytest.raises(loopax.HookError, match="a bug in an evaluation"):
        loop.run_steps(tiny_data(), 10)
    assert checkpointer.all_steps() == []
