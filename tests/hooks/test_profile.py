"""`profile`: a jax.profiler trace of exactly the steps asked for, in TensorBoard's layout."""

import gzip
import json

import pytest
from observability_helpers import make_data, make_trainer

import loopax
from loopax import hooks


def trace_files(logdir):
    return sorted((logdir / "plugins" / "profile").glob("*/*.trace.json.gz"))


def trace_events(path):
    return json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]


@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_traces_exactly_the_window_and_writes_where_tensorboard_looks(
    tmp_path, steps_per_execution
):
    loop = loopax.Loop(make_trainer(), steps_per_execution=steps_per_execution)
    profiler = hooks.profile(loop, tmp_path, steps=(6, 9))
    seen = []
    loop.on_step("groups", lambda loop, metrics: seen.append(loop.trainer.global_step))
    loop.run_steps(make_data(loop_forever=True), 16)
    assert profiler.traced == [(6, 9)] and not profiler.tracing
    # Fused groups end at both edges of the window, so the window is exact.
    assert 5 in seen and 9 in seen
    (trace,) = trace_files(tmp_path)
    assert trace_events(trace)
    assert list(trace.parent.glob("*.xplane.pb"))  # what the profile plugin reads


def test_a_run_ending_inside_the_window_closes_the_trace_once(tmp_path):
    loop = loopax.Loop(make_trainer())
    profiler = hooks.profile(loop, tmp_path, steps=(3, 50))
    loop.run_steps(make_data(loop_forever=True), 5)
    assert profiler.traced == [(3, 5)] and not profiler.tracing
    loop.run_steps(make_data(loop_forever=True), 5)  # a window is traced once
    assert profiler.traced == [(3, 5)]
    assert len(trace_files(tmp_path)) == 1


def test_a_failing_run_never_leaves_the_profiler_running(tmp_path):
    loop = loopax.Loop(make_trainer())
    profiler = hooks.profile(loop, tmp_path, steps=(1, 10))

    def fail(loop, metrics):
        if loop.trainer.global_step == 3:
            raise RuntimeError("boom")

    loop.on_step("fail", fail)
    with pytest.raises(loopax.HookError, match="boom"):
        loop.run_steps(make_data(loop_forever=True), 10)
    assert not profiler.tracing
    # The profiler is free again: another trace can start.
    other_loop = loopax.Loop(make_trainer())
    again = hooks.profile(other_loop, tmp_path / "again", steps=(1, 2))
    other_loop.run_steps(make_data(loop_forever=True), 3)
    assert again.traced == [(1, 2)]


@pytest.mark.parametrize("steps", [(0, 5), (5, 4), (1,), "1-5", (1.0, 2)])
def test_rejects_bad_windows(tmp_path, steps):
    with pytest.raises(ValueError, match=r"steps must be \(start, stop\)"):
        hooks.profile(loopax.Loop(make_trainer()), tmp_path, steps=steps)
