"""`time_limit`: a wall-time budget that stops the run and keeps the work; fake clock."""

import pytest
from observability_helpers import make_data, new_trainer

import loopax
from loopax import hooks


class FakeClock:
    """Advances `per_step` seconds per step, before the loop's other hooks run.

    Under fused execution the OnStep hooks run once per group: it counts the group's steps.
    """

    def __init__(self, loop, per_step=1.0):
        self.now = 0.0
        self.per_step = per_step
        self.step = None
        loop.on_start("fake clock", self.start)
        loop.on_step("fake clock", self.tick, priority=loopax.Priority.VALIDATE - 1)

    def start(self, loop, dataset):
        self.step = loop.loop_step

    def tick(self, loop, metrics):
        done = loop.loop_step + 1
        self.now += self.per_step * (done - self.step)
        self.step = done

    def __call__(self):
        return self.now


def limited_loop(seconds, **loop_kwargs):
    loop = loopax.Loop(new_trainer(), **loop_kwargs)
    clock = FakeClock(loop)
    limit = hooks.time_limit(loop, seconds, clock=clock)
    return loop, clock, limit


def test_stops_at_the_first_step_past_the_budget_and_the_checkpoint_keeps_it(tmp_path):
    loop, _, limit = limited_loop(10.5)
    checkpointer = hooks.checkpoint(loop, tmp_path, every_n_steps=1000)
    loop.run_steps(make_data(loop_forever=True), 100)
    assert loop.trainer.global_step == limit.stopped_step == 11  # 11 s > 10.5 s
    assert loop.stop_reason == "time limit: 10.5 s of wall time spent at step 11"
    checkpointer.wait()
    assert checkpointer.latest_step() == 11  # the end-of-run save

    # A resumed job (a new process: a new loop and clock) gets a fresh budget.
    resumed, _, again = limited_loop(5.5)
    hooks.checkpoint(resumed, tmp_path, every_n_steps=1000)
    assert resumed.trainer.global_step == 11
    resumed.run_steps(make_data(loop_forever=True), 100)
    assert resumed.trainer.global_step == again.stopped_step == 17


def test_the_budget_spans_every_run_of_the_process():
    loop, clock, limit = limited_loop(8.5)
    loop.run_steps(make_data(loop_forever=True), 5)
    assert loop.stop_reason is None and limit.remaining == pytest.approx(3.5)
    loop.run_steps(make_data(loop_forever=True), 5)
    assert loop.trainer.global_step == limit.stopped_step == 9
    # Spent: the next run stops before its first step.
    loop.run_steps(make_data(loop_forever=True), 5)
    assert loop.trainer.global_step == 9
    assert loop.stop_reason.startswith("time limit")
    assert clock.now == 9.0


def test_with_fused_steps_it_stops_at_the_end_of_a_group():
    loop, _, limit = limited_loop(10.5, steps_per_execution=4)
    loop.run_steps(make_data(loop_forever=True), 100)
    # The clock's hook, like every time-based hook, runs at group ends: steps 4, 8, 12.
    assert loop.trainer.global_step == limit.stopped_step == 12


def test_rejects_bad_arguments():
    loop = loopax.Loop(new_trainer())
    for seconds in (0, -1, float("inf"), "60", True):
        with pytest.raises(ValueError, match="seconds must be a number > 0"):
            hooks.time_limit(loop, seconds)
    with pytest.raises(TypeError, match="clock must be a callable"):
        hooks.time_limit(loop, 10, clock=3)
