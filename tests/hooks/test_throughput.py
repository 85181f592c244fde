"""`throughput`: steps/s and examples/s over windows free of compile time, FLOPs, MFU, writers."""

import pytest
from observability_helpers import BATCH_SIZE, make_data, new_trainer

import loopax
from loopax import hooks


class FakeClock:
    """`per_step` seconds per step (counted at each OnStep, before the loop's hooks)."""

    def __init__(self, loop, per_step=0.5):
        self.now, self.per_step, self.step = 0.0, per_step, None
        loop.on_start("fake clock", self.start)
        loop.on_step("fake clock", self.tick, priority=loopax.Priority.VALIDATE - 1)

    def start(self, loop, dataset):
        self.step = loop.loop_step

    def tick(self, loop, metrics):
        self.now += self.per_step * (loop.loop_step + 1 - self.step)
        self.step = loop.loop_step + 1

    def __call__(self):
        return self.now


def metered_loop(tmp_path, peak_flops=None, **loop_kwargs):
    loop = loopax.Loop(new_trainer(), **loop_kwargs)
    clock = FakeClock(loop)
    # Each compilation takes 100 s of the fake clock, which no rate may include.
    loop.trainer.on_exec_creation(lambda info: setattr(clock, "now", clock.now + 100.0))
    hooks.metrics_log(loop, tmp_path / "log.csv", every_n_steps=1000)
    meter = hooks.throughput(loop, every_n_steps=4, peak_flops=peak_flops, clock=clock)
    return loop, meter


def test_rates_flops_and_mfu_reach_history_and_the_writers(tmp_path):
    loop, meter = metered_loop(tmp_path, peak_flops=1e9)
    loop.run_steps(make_data(loop_forever=True), 12)
    # The first window (steps 1-4) holds the compilation: only the time after it counts.
    steps_per_second = loop.history["train/steps_per_second"]
    assert [step for step, _ in steps_per_second] == [4, 8, 12]
    assert [value for _, value in steps_per_second] == pytest.approx([2.0, 2.0, 2.0])
    examples = loop.history["train/examples_per_second"]
    assert [value for _, value in examples] == pytest.approx([2.0 * BATCH_SIZE] * 3)
    # XLA's count for this model: a Dense(8) and a Dense(2) on 4 features, forward and
    # backward, at least the forward matmuls' 2 * batch * (4*8 + 8*2) FLOPs.
    flops = meter.flops_per_step
    assert flops >= 2 * BATCH_SIZE * (4 * 8 + 8 * 2)
    (_, mfu), *_ = loop.history["train/mfu"]
    assert mfu == pytest.approx(flops * 2.0 / 1e9)
    logged = (tmp_path / "log.csv").read_text()
    assert "train/steps_per_second,steps/s,throughput,4," in logged
    assert "train/mfu,mfu,utilization,12," in logged


def test_fused_steps_count_every_step_and_the_program_flops_per_step(tmp_path):
    single, single_meter = metered_loop(tmp_path / "one")
    single.run_steps(make_data(loop_forever=True), 8)
    fused, fused_meter = metered_loop(tmp_path / "fused", steps_per_execution=4)
    fused.run_steps(make_data(loop_forever=True), 12)
    # One step's FLOPs, whether it ran alone or 4 to a compiled call.
    assert fused_meter.flops_per_step == pytest.approx(single_meter.flops_per_step, rel=0.01)
    assert fused_meter.examples_per_step == BATCH_SIZE
    rates = fused.history["train/steps_per_second"]
    assert [step for step, _ in rates] == [4, 8, 12]  # groups end at the logs
    assert [value for _, value in rates][1:] == pytest.approx([2.0, 2.0])
    assert "train/mfu" not in fused.history  # no peak known for a CPU


def test_rejects_bad_arguments():
    loop = loopax.Loop(new_trainer())
    with pytest.raises(ValueError, match="peak_flops must be > 0"):
        hooks.throughput(loop, peak_flops=0)
    with pytest.raises(ValueError, match="must be a positive int"):
        hooks.throughput(loop, every_n_steps=0)
