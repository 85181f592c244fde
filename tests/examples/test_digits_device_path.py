"""The README's main job takes an accelerator's path: nothing copied from the host, a call a step.

On an accelerator each host-to-device copy inside a run is a transfer and a wait, and each
program call is host time; a CPU run shows neither in its timings. So `examples/digits.py`
runs here, in this process, watched over a window of its steady state (the evaluations of both
splits, the checkpoint and the logs at the window's end included): nothing is copied from the
host implicitly (a host batch handed to a program would be), nothing compiles, and each step
is one call of a program that reads its own batch from the devices.
"""

import contextlib
import importlib.util
from pathlib import Path

import jax
import pytest

import loopax
from loopax import hooks
from loopax.testing import count_compilations

pytest.importorskip("sklearn")
_SPEC = importlib.util.spec_from_file_location(
    "digits_example", Path(__file__).resolve().parents[2] / "examples" / "digits.py"
)
digits = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(digits)

# From step 100 on, every program the job runs has compiled (its first evaluation's at step 100).
WINDOW = (100, 200)


def test_the_main_jobs_steady_state_copies_nothing_from_the_host(tmp_path, monkeypatch):
    window = contextlib.ExitStack()
    seen = {"steps": [], "dispatched": [], "step programs": 0, "compilations": None}
    reads = {}  # yield_batch calls in the window, by dataset name

    def counted(run):
        def counting(*args):
            seen["step programs"] += 1
            return run(*args)

        return counting

    def watch(loop, metrics):
        del metrics
        step = loop.trainer.global_step
        seen["steps"].append(step)
        if step == WINDOW[0]:
            # "disallow": an implicit copy (a host array handed to a program) raises here
            window.enter_context(jax.transfer_guard_host_to_device("disallow"))
            seen["compilations"] = window.enter_context(count_compilations())
            for executor in loop.trainer.executors():
                if executor.info.steps:  # the train programs (not evaluation's)
                    executor.run = counted(executor.run)
        else:
            window.close()

    run_to_step = loopax.Loop.run_to_step

    def watched_run_to_step(loop, dataset, step):
        # After the job's own hooks at the window's steps: its last evaluation is inside.
        hooks.at_steps(loop, WINDOW, "steady state", watch, priority=loopax.Priority.UI + 1)
        return run_to_step(loop, dataset, step)

    run = loopax.Trainer.run

    def counted_run(trainer, dispatch):
        if seen["steps"] == [WINDOW[0]]:
            seen["dispatched"].append(dispatch.count)
        return run(trainer, dispatch)

    yield_batch = loopax.ArrayDataset.yield_batch

    def counted_yield_batch(dataset):
        if seen["steps"] == [WINDOW[0]]:
            reads[dataset.name] = reads.get(dataset.name, 0) + 1
        return yield_batch(dataset)

    monkeypatch.setattr(loopax.Loop, "run_to_step", watched_run_to_step)
    monkeypatch.setattr(loopax.ArrayDataset, "yield_batch", counted_yield_batch)
    monkeypatch.setattr(loopax.Trainer, "run", counted_run)
    try:
        accuracy = digits.main(["--steps", str(WINDOW[1]), "--dir", str(tmp_path), "--no-progress"])
    finally:
        window.close()
    assert seen["steps"] == list(WINDOW)
    assert 0.0 < accuracy <= 1.0
    assert seen["compilations"].count == 0, seen["compilations"].names
    steps = WINDOW[1] - WINDOW[0]
    # One dispatch a step, one program call each, which reads its batch itself: the training
    # set is never asked for a batch (that would be a gather, a program call of its own).
    assert seen["dispatched"] == [1] * steps
    assert seen["step programs"] == steps
    assert "train" not in reads and reads["val"] > 0 and reads["test"] > 0, reads
