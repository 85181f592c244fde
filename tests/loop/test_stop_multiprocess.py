"""One stop for all: a signal or `request_stop` on one of 2 processes stops both at one step."""

import signal
import time

import pytest

from loopax.testing import Processes, multiprocess

# Their processes fork from one pre-imported interpreter (conftest.py, tests/zygote.py).
pytestmark = pytest.mark.usefixtures("forked_processes")

FOREVER = 10**6


def _loop(loop_forever=True):
    import jax
    import numpy as np
    import optax

    import loopax

    trainer = loopax.Trainer(
        lambda ctx, spec, x: __import__("flax.linen").linen.Dense(1)(x[0]),
        loopax.losses.mean_squared_error,
        optax.sgd(0.01),
        devices=jax.devices(),
    )
    rng = np.random.default_rng(jax.process_index())
    x = rng.normal(size=(64, 3)).astype(np.float32)
    data = loopax.ArrayDataset(
        x, x.sum(axis=1, keepdims=True), batch_size=8, loop_forever=loop_forever
    )
    return loopax.Loop(trainer), data


def _say_running_at(loop, step):
    def say(loop, metrics):
        if loop.loop_step == step:
            print("running", flush=True)

    loop.on_step("say running", say)


def train_until_signalled(directory):
    import loopax

    loop, data = _loop()
    loopax.hooks.checkpoint(loop, directory, every_n_steps=FOREVER)
    _say_running_at(loop, 3)
    loop.run_steps(data, FOREVER)
    return "finished"


def train_until_interrupted():
    loop, data = _loop()
    _say_running_at(loop, 3)
    loop.run_steps(data, FOREVER)
    return "finished"


def resume(directory):
    import loopax

    loop, data = _loop()
    loopax.hooks.checkpoint(loop, directory, every_n_steps=FOREVER)
    restored = loop.trainer.global_step
    loop.run_steps(data, 2)
    return [restored, loop.trainer.global_step]


def stop_on_one_process(stop_at, late_watcher=False):
    """Three runs (a fresh key each): one step per call, fused groups of 4, then epochs.

    With `late_watcher`, process 0's stop watcher hears of the proposal a second late, as a
    thread left unscheduled on a loaded machine does: its steps run on meanwhile.
    """
    import jax

    import loopax

    if late_watcher and jax.process_index() == 0:
        from loopax.loop import _stop_agreement

        decode = _stop_agreement._decode

        def late_decode(value):
            time.sleep(1.0)
            return decode(value)

        _stop_agreement._decode = late_decode

    results = []
    for steps_per_execution, epochs in ((1, None), (4, None), (1, 100)):
        loop, data = _loop(loop_forever=epochs is None)
        loop = loopax.Loop(loop.trainer, steps_per_execution=steps_per_execution)
        start = loop.trainer.global_step

        def stop(loop, metrics, start=start):
            if jax.process_index() == 1 and loop.loop_step >= start + stop_at:
                loop.request_stop("enough on process 1")

        loop.on_step("stop", stop)
        if epochs is None:
            loop.run_steps(data, 1000)
        else:  # 8 batches an epoch: the agreed stop lies some epochs on
            loop.run_epochs(data, epochs)
        results.append({"steps": loop.trainer.global_step - start, "reason": loop.stop_reason})
    return results


def _signal_when_running(group, process_id, sig, timeout=60.0):
    deadline = time.monotonic() + timeout
    while "running" not in group.log(process_id):
        assert time.monotonic() < deadline, group.log(process_id)
        assert all(p.poll() is None for p in group.processes), group.log(process_id)
        time.sleep(0.05)
    signalled = time.monotonic()
    group.signal(process_id, sig)
    return signalled


def _interrupted_step(log):
    lines = [line for line in log.splitlines() if line.startswith("interrupted at step ")]
    assert len(lines) == 1, log
    return int(lines[0].split()[3].rstrip(";"))


def test_sigterm_to_one_process_stops_both_at_one_saved_step_and_both_resume(tmp_path):
    directory = str(tmp_path / "ckpt")
    with Processes(2, 2, train_until_signalled, directory, timeout=120) as group:
        signalled = _signal_when_running(group, 1, signal.SIGTERM)
        results = group.wait(60)
        took = time.monotonic() - signalled
    logs = [r.log for r in results]
    assert [r.returncode for r in results] == [143, 143], logs
    assert took < 20, (took, logs)
    steps = [_interrupted_step(log) for log in logs]
    assert steps[0] == steps[1], logs
    assert all(f"saved checkpoint {steps[0]}" in log for log in logs), logs

    resumed = multiprocess(2, 2, resume, directory, timeout=120)
    assert resumed == [[steps[0], steps[0] + 2]] * 2


def test_sigint_to_one_process_stops_both_with_130():
    with Processes(2, 2, train_until_interrupted, timeout=120) as group:
        _signal_when_running(group, 0, signal.SIGINT)
        results = group.wait(60)
    logs = [r.log for r in results]
    assert [r.returncode for r in results] == [130, 130], logs
    steps = [_interrupted_step(log) for log in logs]
    assert steps[0] == steps[1], logs
    assert all("nothing was saved" in log for log in logs), logs


def test_request_stop_on_one_process_stops_both_at_one_step():
    values = multiprocess(2, 2, stop_on_one_process, 7, timeout=120)
    assert values[0] == values[1], values
    for run in values[0]:
        assert run["reason"] == "enough on process 1"
        assert 7 < run["steps"] < 1000


def test_a_stop_heard_late_by_one_process_still_stops_both_at_one_step():
    # The stop step lies a margin of steps ahead; a watcher that hears of it late would find
    # its process's steps past it (both processes then hung in a collective that one of
    # them had left). The proposer waits until every watcher has seen its stop.
    values = multiprocess(2, 2, stop_on_one_process, 7, True, timeout=90)
    assert values[0] == values[1], values
    for run in values[0]:
        assert run["reason"] == "enough on process 1"
        assert 7 < run["steps"] < 1000
