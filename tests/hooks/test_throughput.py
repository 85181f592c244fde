"""`throughput`: steps/s and examples/s over windows of finished steps, free of compile time.

Each window is timed between steps the loop saw finished, never between dispatches (issue
35, item 3): the fake clock below advances with the steps finished, and a real step slowed
on the device checks every logged rate against when its steps really ran.
"""

import queue
import threading
import time

import flax.linen as nn
import jax
import numpy as np
import pytest
from observability_helpers import BATCH_SIZE, make_data, new_trainer

import loopax
from loopax import hooks

STEPS_FINISHED = "loopax.steps_finished"  # the loop.shared_data key hooks.throughput uses


class FakeClock:
    """`per_step` seconds per step, counted when the loop sees the steps finished."""

    def __init__(self, loop, per_step=0.5):
        self.now, self.per_step, self.done = 0.0, per_step, None
        loop.on_start("fake clock", self.start)
        # Registered before the meter: it reads the time after this clock moved on.
        loop.shared_data.setdefault(STEPS_FINISHED, []).append(self.finished)

    def start(self, loop, dataset):
        self.done = loop.trainer.global_step

    def finished(self, loop_step):
        self.now += self.per_step * (loop_step + 1 - self.done)
        self.done = loop_step + 1

    def __call__(self):
        return self.now


def metered_loop(tmp_path, peak_flops=None, every_n_steps=20, **loop_kwargs):
    loop = loopax.Loop(new_trainer(), **loop_kwargs)
    clock = FakeClock(loop)
    # Each compilation takes 100 s of the fake clock, which no rate may include.
    loop.trainer.on_exec_creation(lambda info: setattr(clock, "now", clock.now + 100.0))
    hooks.metrics_log(loop, tmp_path / "log.csv", every_n_steps=1000)
    meter = hooks.throughput(loop, every_n_steps=every_n_steps, peak_flops=peak_flops, clock=clock)
    return loop, meter


def test_rates_flops_and_mfu_reach_history_and_the_writers(tmp_path):
    loop, meter = metered_loop(tmp_path, peak_flops=1e9)
    # More steps than the loop keeps in flight (32 on one device): it waits for some.
    loop.run_steps(make_data(loop_forever=True), 100)
    # The first window starts after the compilation: only the time after it counts.
    steps_per_second = loop.history["train/steps_per_second"]
    assert [step for step, _ in steps_per_second] == [20, 40, 60, 80, 100]
    assert [value for _, value in steps_per_second] == pytest.approx([2.0] * 5)
    examples = loop.history["train/examples_per_second"]
    assert [value for _, value in examples] == pytest.approx([2.0 * BATCH_SIZE] * 5)
    # XLA's count for this model: a Dense(8) and a Dense(2) on 4 features, forward and
    # backward, at least the forward matmuls' 2 * batch * (4*8 + 8*2) FLOPs.
    flops = meter.flops_per_step
    assert flops >= 2 * BATCH_SIZE * (4 * 8 + 8 * 2)
    (_, mfu), *_ = loop.history["train/mfu"]
    assert mfu == pytest.approx(flops * 2.0 / 1e9)
    logged = (tmp_path / "log.csv").read_text()
    assert "train/steps_per_second,steps/s,throughput,20," in logged
    assert "train/mfu,mfu,utilization,100," in logged
    # Every window spans steps the loop saw finished, the first from the run's start.
    assert meter.windows[0][0] == 0
    assert all(last > first for first, last, _ in meter.windows)


def test_fused_steps_count_every_step_and_the_program_flops_per_step(tmp_path):
    single, single_meter = metered_loop(tmp_path / "one")
    single.run_steps(make_data(loop_forever=True), 8)
    fused, fused_meter = metered_loop(tmp_path / "fused", every_n_steps=4, steps_per_execution=4)
    # More groups than the loop keeps in flight (32), so that it waits for some.
    fused.run_steps(make_data(loop_forever=True), 200)
    # One step's FLOPs, whether it ran alone or 4 to a compiled call.
    assert fused_meter.flops_per_step == pytest.approx(single_meter.flops_per_step, rel=0.01)
    assert fused_meter.examples_per_step == BATCH_SIZE
    rates = fused.history["train/steps_per_second"]
    assert [step for step, _ in rates] == list(range(4, 201, 4))  # groups end at the logs
    assert [value for _, value in rates] == pytest.approx([2.0] * 50)
    assert "train/mfu" not in fused.history  # no peak known for a CPU


def test_a_run_shorter_than_the_steps_in_flight_is_timed_whole(tmp_path):
    # The loop waits for its steps only at the run's end: one window, the whole run's.
    loop, meter = metered_loop(tmp_path, every_n_steps=4)
    loop.run_steps(make_data(loop_forever=True), 12)
    rates = loop.history["train/steps_per_second"]
    assert [step for step, _ in rates] == [4, 8, 12]
    assert [value for _, value in rates] == pytest.approx([2.0] * 3)
    assert meter.windows == [(0, 12, 6.0)]


# -- the real clock: steps long enough that the dispatches run far ahead of the device ------

RUN_STEPS = 200
WIDTH = 1024  # a few ms a step on a CPU: the loop dispatches up to 32 steps ahead


def heavy_model(ctx, spec, inputs):
    hidden = inputs[0]
    for _ in range(3):
        hidden = nn.relu(nn.Dense(WIDTH)(hidden))
    return nn.Dense(2)(hidden)


class FinishTimes:
    """When each logged step finished, seen by a thread of the test's own, apart from the loop.

    An OnStep hook hands each step's loss (on the device) to the thread, which waits for it
    and notes the time: the loop itself never waits for it (one hook per group when fused).
    """

    def __init__(self, loop):
        self.times, self._queue = {}, queue.Queue()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        loop.on_step("finish times", self._hand_over)

    def _hand_over(self, loop, metrics):
        self._queue.put((loop.trainer.global_step, metrics["loss"]))

    def _watch(self):
        while (item := self._queue.get()) is not None:
            step, loss = item
            loss.block_until_ready()
            self.times[step] = time.perf_counter()

    def close(self):
        self._queue.put(None)
        self._thread.join(timeout=60)


@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_every_rate_is_the_rate_the_steps_ran_at_first_window_included(steps_per_execution):
    trainer = loopax.Trainer(
        heavy_model,
        loopax.losses.sparse_categorical_crossentropy_logits,
        loopax.optimizers.sgd(0.01),
        devices=jax.devices()[:1],
    )
    loop = loopax.Loop(trainer, steps_per_execution=steps_per_execution)
    meter = hooks.throughput(loop, every_n_steps=40, clock=time.perf_counter)
    compiled = []  # when the first program was reported: where the run's first window starts
    trainer.on_exec_creation(lambda info: compiled.append(time.perf_counter()))
    finish = FinishTimes(loop)
    inputs = np.random.default_rng(0).normal(size=(1024, WIDTH)).astype(np.float32)
    data = loopax.ArrayDataset(inputs, (inputs[:, 0] > 0).astype(np.int32), 128, loop_forever=True)
    try:
        loop.run_steps(data, RUN_STEPS)
    finally:
        finish.close()
    rates = loop.history["train/steps_per_second"]
    assert [step for step, _ in rates] == [40, 80, 120, 160, 200]
    assert {rate for _, rate in rates} == {(b - a) / s for a, b, s in meter.windows}
    assert meter.windows[0][0] == 0  # the first window: from the run's start
    for first, last, seconds in meter.windows:
        # The same steps, timed by the test's thread: the rate they really ran at. Both
        # ends are read within a step of the step finishing, in windows of 30+ steps.
        began = compiled[0] if first == 0 else finish.times[first]
        ran_at = (last - first) / (finish.times[last] - began)
        assert (last - first) / seconds == pytest.approx(ran_at, rel=0.10), meter.windows


def test_rejects_bad_arguments():
    loop = loopax.Loop(new_trainer())
    with pytest.raises(ValueError, match="peak_flops must be > 0"):
        hooks.throughput(loop, peak_flops=0)
    with pytest.raises(ValueError, match="must be a positive int"):
        hooks.throughput(loop, every_n_steps=0)
