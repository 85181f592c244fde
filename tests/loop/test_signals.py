"""SIGINT and SIGTERM during a run, in real subprocesses: one clean line, a saved checkpoint,
and a rerun that resumes exactly; a second signal exits at once without a broken checkpoint.
In this process: the end of a run a signal stopped writes no end-of-run points."""

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from _tiny import tiny_data, tiny_trainer

import loopax
from loopax import hooks

WORKER = Path(__file__).parent.parent / "hooks" / "checkpoint_worker.py"


def run_worker(tmp_path, directory, target, *flags):
    env = dict(
        os.environ,
        JAX_COMPILATION_CACHE_DIR=os.environ.get(
            "JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax-cache")
        ),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    return subprocess.run(
        [
            sys.executable,
            str(WORKER),
            str(directory),
            str(target),
            str(tmp_path / "out.npz"),
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )


def final_params(tmp_path):
    with np.load(tmp_path / "out.npz") as saved:
        return {name: saved[name] for name in saved.files}


@pytest.mark.parametrize("signal_name, status", [("INT", 130), ("TERM", 143)])
def test_first_signal_saves_runs_on_end_and_exits_with_one_line(tmp_path, signal_name, status):
    directory = tmp_path / "ckpt"
    interrupted = run_worker(tmp_path, directory, 20, "--signal-at", "7", "--signal", signal_name)
    assert interrupted.returncode == status, interrupted.stderr[-3000:]
    # The step it was in (loop step 7) finished: global step 8 is saved, and that is all it says.
    assert interrupted.stderr == "interrupted at step 8; saved checkpoint 8; run again to resume\n"
    assert "done" not in interrupted.stdout

    resumed = run_worker(tmp_path, directory, 20)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 8" in resumed.stdout and "done at step 20" in resumed.stdout
    resumed_params = final_params(tmp_path)
    reference = run_worker(tmp_path, tmp_path / "reference", 20)
    assert reference.returncode == 0, reference.stderr[-3000:]
    # Bit for bit the parameters of the uninterrupted run.
    uninterrupted = final_params(tmp_path)
    assert resumed_params.keys() == uninterrupted.keys()
    for name in uninterrupted:
        np.testing.assert_array_equal(resumed_params[name], uninterrupted[name])


def test_a_second_signal_during_the_save_exits_at_once_and_keeps_the_older_checkpoint(tmp_path):
    directory = tmp_path / "ckpt"
    interrupted = run_worker(
        tmp_path, directory, 20, "--every", "3", "--signal-at", "7", "--second-signal-in-commit"
    )
    assert interrupted.returncode == 130, interrupted.stderr[-3000:]
    assert interrupted.stderr == "loopax: second SIGINT: exiting now\n"
    # The save of step 8 was cut off in its commit: never a checkpoint. Step 6 is intact, and
    # the rerun says what it found instead of dropping it without a word.
    resumed = run_worker(tmp_path, directory, 20)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 6" in resumed.stdout and "done at step 20" in resumed.stdout
    assert "1 incomplete save(s)" in resumed.stderr and "'8.orbax-checkpoint-tmp" in resumed.stderr


def test_without_a_checkpoint_the_line_says_nothing_was_saved(tmp_path):
    interrupted = run_worker(
        tmp_path, tmp_path / "unused", 20, "--no-checkpoint", "--signal-at", "3"
    )
    assert interrupted.returncode == 130, interrupted.stderr[-3000:]
    assert interrupted.stderr == (
        "interrupted at step 4; no checkpoint hook is attached, so nothing was saved\n"
    )


# -- in this process: what the end of a run a signal stopped writes --------------------------


def _signal_at(global_step):
    """A hook that sends this process SIGTERM after `global_step`'s other hooks."""

    def send(loop, metrics):
        if loop.trainer.global_step == global_step:
            os.kill(os.getpid(), signal.SIGTERM)

    return send


def _run_with_logs(tmp_path, stop_at, steps=10):
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are only installed in the main thread")
    train = tiny_data(2)
    test = tiny_data(2, name="test", shuffle=False, loop_forever=False)
    loop = loopax.Loop(tiny_trainer())
    hooks.evaluate(loop, test, every_n_steps=4)
    log = hooks.metrics_log(loop, tmp_path / "log.csv", every_n_steps=2, learning_rate=False)
    ended = []
    hooks.every_n_steps(loop, 4, "every 4", lambda loop, m: None)
    hooks.periodic_callback(
        loop, 3600, "at the end", lambda loop, m: ended.append("callback"), call_on_end=True
    )
    loop.on_end("seen", lambda loop, m: ended.append(loop.interrupted))
    loop.on_step("signal", _signal_at(stop_at), loopax.Priority.UI + 1)
    with pytest.raises(SystemExit) as exited:
        loop.run_steps(train, steps)
    assert exited.value.code == 128 + signal.SIGTERM
    return loop, sorted({point["step"] for point in log.file.read()}), ended


def test_a_run_a_signal_stops_early_writes_no_end_of_run_points(tmp_path):
    loop, logged, ended = _run_with_logs(tmp_path, stop_at=7)
    assert loop.interrupted and loop.trainer.global_step == 7
    # What an uninterrupted run writes by step 7 and nothing more: no last evaluation, no
    # last train point, no call_on_end callback at step 7; its resumed run ends it.
    assert logged == [2, 4, 6]
    assert [step for step, _ in loop.history["eval/test/mean_loss"]] == [4]
    assert ended == [True]


def test_a_signal_in_the_last_step_leaves_the_run_complete(tmp_path):
    loop, logged, ended = _run_with_logs(tmp_path, stop_at=10)
    assert not loop.interrupted and loop.trainer.global_step == 10
    # The run reached its end: it ends as without the signal (the process still exits).
    assert logged == [2, 4, 6, 8, 10]
    assert [step for step, _ in loop.history["eval/test/mean_loss"]] == [4, 8, 10]
    assert ended == ["callback", False]
