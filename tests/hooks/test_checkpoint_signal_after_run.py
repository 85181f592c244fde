"""A signal after a run returned, while its end-of-run save still commits (issue 35, item 5).

The save finishes, one line names it, and the process exits 130 / 143, whether the program
was doing other work or already exiting. Real interpreters (their exit is what is tested),
real signals, real Orbax checkpoints; Orbax's commit is held until the child's main thread
is inside a Python signal handler, so the signal always comes during the commit, with no
sleep to tune.
"""

import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

TIMEOUT = 180  # seconds a child may take at most; it is killed after

CHILD = textwrap.dedent(
    """
    import asyncio, sys, threading
    import flax.linen as nn, jax, numpy as np, optax, loopax
    from orbax.checkpoint._src.path import atomicity

    directory, mode = sys.argv[1], sys.argv[2]
    main = threading.main_thread().ident


    def in_signal_handler():
        # The main thread runs a Python signal handler: a frame taking (signum, frame).
        frame = sys._current_frames().get(main)
        while frame is not None:
            names = frame.f_code.co_varnames[:3]
            if "signum" in names and "frame" in names:
                return True
            frame = frame.f_back
        return False


    original = atomicity.AtomicRenameTemporaryPath.finalize


    async def held_finalize(self, *args, **kwargs):
        print("committing", flush=True)
        for _ in range(6000):  # 60 s at most: a process the signal killed never gets here
            if in_signal_handler():
                break
            await asyncio.sleep(0.01)
        return await original(self, *args, **kwargs)


    if mode != "waited":
        atomicity.AtomicRenameTemporaryPath.finalize = held_finalize
    trainer = loopax.Trainer(lambda ctx, spec, x: nn.Dense(1)(x[0]),
        loopax.losses.mean_squared_error, optax.sgd(0.1), devices=jax.devices()[:1])
    loop = loopax.Loop(trainer)
    checkpointer = loopax.hooks.checkpoint(loop, directory, every_n_steps=100)
    x = np.ones((8, 2), np.float32)
    loop.run_steps(loopax.ArrayDataset(x, x[:, :1], 4, loop_forever=True), 3)
    if mode == "waited":
        checkpointer.wait()
    print("returned", flush=True)
    if mode != "exit":
        threading.Event().wait(120)  # the program's other work after training
    """
)


def run_child(directory, mode, signum):
    """Starts the child, signals it once it commits (and returned); returns (rc, stderr)."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(directory), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in child.stdout], daemon=True).start()
    try:
        wanted = {"returned"} if mode == "waited" else {"committing", "returned"}
        while wanted:
            wanted.discard(lines.get(timeout=TIMEOUT).strip())
        child.send_signal(signum)
        _, stderr = child.communicate(timeout=TIMEOUT)
        return child.returncode, stderr
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()


def steps_on_disk(directory):
    return sorted(int(entry) for entry in os.listdir(directory) if entry.isdigit())


@pytest.mark.parametrize(
    ("signum", "mode"),
    [
        (signal.SIGTERM, "work"),
        (signal.SIGINT, "work"),
        (signal.SIGTERM, "exit"),
        (signal.SIGINT, "exit"),
    ],
)
def test_a_signal_during_the_end_of_run_commit_keeps_the_save(tmp_path, signum, mode):
    returncode, stderr = run_child(tmp_path, mode, signum)
    assert returncode == 128 + signum, stderr[-3000:]
    assert "interrupted at step 3; saved checkpoint 3; run again to resume" in stderr
    assert "Traceback" not in stderr, stderr[-3000:]
    assert steps_on_disk(tmp_path) == [3]
    assert not [entry for entry in os.listdir(tmp_path) if "tmp" in entry]


def test_with_no_save_in_flight_a_signal_does_what_it_did(tmp_path):
    # Ctrl-C in the program's other work, every save committed: a KeyboardInterrupt, as ever.
    returncode, stderr = run_child(tmp_path, "waited", signal.SIGINT)
    assert "KeyboardInterrupt" in stderr and "interrupted at step" not in stderr
    assert returncode == -signal.SIGINT
    assert steps_on_disk(tmp_path) == [3]
