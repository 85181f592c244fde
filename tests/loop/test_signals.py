"""SIGINT and SIGTERM during a run, in real subprocesses: one clean line, a saved checkpoint,
and a rerun that resumes exactly; a second signal exits at once without a broken checkpoint."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

WORKER = Path(__file__).parent.parent / "hooks" / "checkpoint_worker.py"


def run_worker(tmp_path, directory, target, *flags):
    env = dict(
        os.environ,
        JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax-cache"),
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
