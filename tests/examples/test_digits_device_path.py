"""The README's main job takes an accelerator's path: no copy from the host, fused steps.

On an accelerator each host-to-device copy inside a run is a transfer and a wait, and each
dispatch is host time; a CPU run shows neither in its timings. So `examples/digits.py` runs
here, in this process, watched over a window of its steady state (the evaluations of both
splits, the checkpoint and the logs at the window's end included): no batch or anything else
is copied from the host implicitly, nothing compiles, and the steps run in fused groups.
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

# From step 200 on, every program the job needs has compiled (a program per power-of-two group
# size, compiled ahead in the background as the first 200 steps meet them).
WINDOW = (200, 300)


def test_the_main_jobs_steady_state_copies_nothing_from_the_host(tmp_path, monkeypatch):
    window = contextlib.ExitStack()
    seen = {"steps": [], "dispatched": [], "compilations": None}

    def watch(loop, metrics):
        del metrics
        step = loop.trainer.global_step
        seen["steps"].append(step)
        if step == WINDOW[0]:
            # "disallow": an implicit copy (a host array handed to a program) raises here
            window.enter_context(jax.transfer_guard_host_to_device("disallow"))
            seen["compilations"] = window.enter_context(count_compilations())
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

    monkeypatch.setattr(loopax.Loop, "run_to_step", watched_run_to_step)
    monkeypatch.setattr(loopax.Trainer, "run", counted_run)
    try:
        accuracy = digits.main(["--steps", str(WINDOW[1]), "--dir", str(tmp_path), "--no-progress"])
    finally:
        window.close()
    assert seen["steps"] == list(WINDOW)
    assert 0.0 < accuracy <= 1.0
    assert seen["compilations"].count == 0, seen["compilations"].names
    # Every step of the window in groups of at most 16 steps, each a power-of-two program;
    # a group ends where a hook fires by steps (the evaluations, the plot's train points).
    dispatched = seen["dispatched"]
    assert sum(dispatched) == WINDOW[1] - WINDOW[0]
    assert set(dispatched) <= {1, 2, 4, 8, 16} and len(dispatched) <= 12, dispatched
