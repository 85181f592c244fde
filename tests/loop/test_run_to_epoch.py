"""`Loop.run_to_epoch`: epochs counted in total across a checkpoint resume (Keras's
`fit(epochs=n)` with `BackupAndRestore`), with real Orbax checkpoints on disk.

A run is interrupted inside an epoch (a hook raising, or SIGKILL of a real subprocess);
a new Trainer and Loop restore the newest checkpoint and `run_to_epoch` finishes the
interrupted epoch from the saved dataset position, then runs the remaining ones: the
same number of epochs and the same steps, parameters and losses as an uninterrupted run.
"""

from __future__ import annotations

import signal
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from _tiny import MODELS, tiny_trainer

import loopax
from loopax import hooks

BATCH = MODELS["regression"].batch_size
EXAMPLES = 5 * BATCH  # 5 steps per epoch
EPOCHS = 4


def new_loop():
    return loopax.Loop(tiny_trainer())


def data():
    x = np.random.default_rng(0).normal(size=(EXAMPLES, 3)).astype(np.float32)
    return loopax.ArrayDataset(x, np.sin(x.sum(axis=1, keepdims=True)), BATCH, seed=3)


class Recorder(hooks.MetricWriter):
    """Every train metric at every step (through `loop.history`), and the epoch ends."""

    def __init__(self, loop):
        self.epoch_ends = []
        self.end_steps = []
        hooks.write_metrics(loop, self, every_n_steps=1, learning_rate=False)
        loop.on_epoch_end("epochs", lambda loop, m: self.epoch_ends.append(self.where(loop)))
        loop.on_step("end steps", lambda loop, m: self.end_steps.append(loop.end_step))

    @staticmethod
    def where(loop):
        return loop.epoch, loop.trainer.global_step, loop.epochs_done

    def write_scalars(self, step, scalars):
        pass


def assert_same_params(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def fail_at(loop, global_step):
    def fail(loop, metrics):
        if loop.trainer.global_step == global_step:
            raise RuntimeError("interrupted")

    loop.on_step("fail", fail)


@pytest.fixture(scope="module")
def uninterrupted():
    loop = new_loop()
    recorder = Recorder(loop)
    loop.run_to_epoch(data(), EPOCHS)
    return loop, recorder


def test_uninterrupted_run_to_epoch_is_run_epochs(uninterrupted):
    loop, recorder = uninterrupted
    assert loop.trainer.global_step == EPOCHS * 5 and loop.epochs_done == EPOCHS
    assert recorder.epoch_ends == [(0, 5, 1), (1, 10, 2), (2, 15, 3), (3, 20, 4)]
    plain = new_loop()
    plain.run_epochs(data(), EPOCHS)
    assert_same_params(plain.trainer.params, loop.trainer.params)
    assert plain.run_to_epoch(data(), EPOCHS) == {}  # already done: nothing runs
    assert plain.trainer.global_step == EPOCHS * 5


def test_an_epoch_interrupted_inside_finishes_and_the_total_is_as_asked(uninterrupted, tmp_path):
    whole, whole_recorder = uninterrupted
    first = new_loop()
    Recorder(first)
    checkpointer = hooks.checkpoint(first, tmp_path, every_n_steps=3)
    fail_at(first, 13)  # in the third epoch (global steps 11-15), after the save of step 12
    with pytest.raises(loopax.HookError, match="interrupted"):
        first.run_to_epoch(data(), EPOCHS)
    assert checkpointer.all_steps()[-1] == 12

    resumed = new_loop()
    hooks.checkpoint(resumed, tmp_path, every_n_steps=3)
    recorder = Recorder(resumed)
    assert (resumed.trainer.global_step, resumed.epochs_done) == (12, 2)
    resumed.run_to_epoch(data(), EPOCHS)
    assert (resumed.trainer.global_step, resumed.epochs_done) == (20, EPOCHS)
    # The interrupted epoch finished from its saved position, numbered as in the whole run.
    assert recorder.epoch_ends == [(2, 15, 3), (3, 20, 4)]
    # The run knew its end from its first step: the interrupted run's extrapolation.
    assert set(recorder.end_steps) == {20}
    assert_same_params(resumed.trainer.params, whole.trainer.params)
    for key in ("train/loss", "train/moving_average_loss"):
        assert resumed.history[key] == whole.history[key]


def test_fused_steps_resume_to_the_same_total(uninterrupted, tmp_path):
    whole, _ = uninterrupted

    def fused_loop():
        return loopax.Loop(new_loop().trainer, steps_per_execution=4)

    first = fused_loop()
    hooks.checkpoint(first, tmp_path, every_n_steps=3)

    def fail(loop, metrics):  # once per group of fused steps, at its last step
        if loop.trainer.global_step >= 13:
            raise RuntimeError("interrupted")

    first.on_step("fail", fail)
    with pytest.raises(loopax.HookError, match="interrupted"):
        first.run_to_epoch(data(), EPOCHS)
    resumed = fused_loop()
    hooks.checkpoint(resumed, tmp_path, every_n_steps=3)
    assert (resumed.trainer.global_step, resumed.epochs_done) == (12, 2)
    resumed.run_to_epoch(data(), EPOCHS)
    assert (resumed.trainer.global_step, resumed.epochs_done) == (20, EPOCHS)
    # Fused programs against single steps: equal to float tolerance (as tests/loop/test_fused).
    for got, want in zip(
        jax.tree.leaves(resumed.trainer.params), jax.tree.leaves(whole.trainer.params), strict=True
    ):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)


def test_a_save_at_an_epochs_end_does_not_count_it_twice(uninterrupted, tmp_path):
    whole, _ = uninterrupted
    first = new_loop()
    hooks.checkpoint(first, tmp_path, every_n_epochs=1)
    fail_at(first, 12)  # the second step of the third epoch
    with pytest.raises(loopax.HookError, match="interrupted"):
        first.run_to_epoch(data(), EPOCHS)

    resumed = new_loop()
    hooks.checkpoint(resumed, tmp_path, every_n_epochs=1)
    assert (resumed.trainer.global_step, resumed.epochs_done) == (10, 2)
    resumed.run_to_epoch(data(), EPOCHS)
    assert (resumed.trainer.global_step, resumed.epochs_done) == (20, EPOCHS)
    assert_same_params(resumed.trainer.params, whole.trainer.params)


def test_run_epochs_after_a_resume_runs_that_many_more(tmp_path):
    first = new_loop()
    hooks.checkpoint(first, tmp_path, every_n_steps=3)
    fail_at(first, 8)
    with pytest.raises(loopax.HookError, match="interrupted"):
        first.run_epochs(data(), EPOCHS)

    resumed = new_loop()
    hooks.checkpoint(resumed, tmp_path, every_n_steps=3)
    assert (resumed.trainer.global_step, resumed.epochs_done) == (6, 1)
    resumed.run_epochs(data(), 2)  # GoMLX's RunEpochs: 2 more (the first one partial)
    assert (resumed.trainer.global_step, resumed.epochs_done) == (15, 3)
    with pytest.warns(RuntimeWarning, match=r"run_to_epoch\(2\): 3 epochs are already done"):
        assert resumed.run_to_epoch(data(), 2) == {}
    resumed.run_to_epoch(data(), EPOCHS)
    assert (resumed.trainer.global_step, resumed.epochs_done) == (20, EPOCHS)


def test_run_to_epoch_rejects_bad_arguments():
    loop = new_loop()
    with pytest.raises(ValueError, match="epochs"):
        loop.run_to_epoch(data(), -1)
    with pytest.raises(TypeError, match="run_to_epoch"):
        loop.run_to_epoch(iter([([np.ones((8, 3), np.float32)], [np.ones((8, 1))])]), 2)


# ---------------------------------------------------------------------------------------
# A real kill.

WORKER = textwrap.dedent(
    """
    import os, signal, sys
    sys.path[:0] = [{tests!r}, {tests_root!r}]  # this test module, and _tiny
    import jax
    import numpy as np
    from test_run_to_epoch import data, new_loop
    from loopax import hooks

    directory, kill_at = sys.argv[1], int(sys.argv[2])
    loop = new_loop()
    checkpointer = hooks.checkpoint(loop, directory, every_n_steps=3)

    def die(loop, metrics):
        if loop.trainer.global_step == kill_at:
            checkpointer.wait()  # the save of the step before is on disk
            os.kill(os.getpid(), signal.SIGKILL)

    loop.on_step("die", die, priority=10**6)
    loop.run_to_epoch(data(), {epochs})
    checkpointer.wait()
    np.savez(os.path.join(directory, "done.npz"), step=loop.trainer.global_step,
             epochs=loop.epochs_done, *jax.tree.leaves(loop.trainer.params))
    """
)


def test_a_killed_process_resumes_to_the_same_total(uninterrupted, tmp_path, zygote_server):
    whole, _ = uninterrupted
    script = tmp_path / "worker.py"
    script.write_text(
        WORKER.format(
            tests=str(Path(__file__).parent),
            tests_root=str(Path(__file__).parents[1]),
            epochs=EPOCHS,
        )
    )
    directory = tmp_path / "run"
    # Real processes (forked from the test session's zygote: JAX imported once), each
    # waited for at most 300 s, then killed by its pid.
    killed = zygote_server.run([script, directory, "8"], timeout=300)  # in the second epoch
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not (directory / "done.npz").exists()
    resumed = zygote_server.run([script, directory, "-1"], timeout=300)  # never killed
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    done = np.load(directory / "done.npz")
    assert (int(done["step"]), int(done["epochs"])) == (EPOCHS * 5, EPOCHS)
    for index, want in enumerate(jax.tree.leaves(whole.trainer.params)):
        np.testing.assert_array_equal(done[f"arr_{index}"], np.asarray(want))
