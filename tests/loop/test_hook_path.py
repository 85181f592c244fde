"""The README's hooks cost the steps where none of them fires next to nothing.

On an accelerator fed by the host every µs of Python a step counts. A scheduled hook not due
must cost the loop at most a comparison against its next firing step, and a clock (the
progress bar's refresh, a checkpoint every 60 s) a clock reading every few steps: no walk
over every hook. Counted deterministically in Python calls (`sys.setprofile`), by loop step,
with the README's hooks (progress bar, TensorBoard, checkpoint every 60 s) attached against
the same loop without them, over a stretch of steps where none of them fires. Clocks are
injected: they advance 1 ms a step.
"""

import collections
import io
import sys

import pytest

from loopax import ArrayDataset, Loop, hooks
from tests._tiny import python_calls_by_step, tiny_data, tiny_trainer

# A first run (steps 0-199) compiles and warms; the counted run is steps 200-399. TensorBoard
# writes after loop steps 299 and 399 (every 100 steps), its log of step 299 is read at the
# next in-flight wait (at most 17 steps later); the progress bar refreshes at the run's first
# step and 0.2 s (200 steps) later; the checkpoint (every 60 s) never. Between: nothing fires.
FIRST_RUN, COUNTED_RUN = 200, 200
QUIET = range(324, 396)  # 72 steps: 9 whole groups of 8 (300, 308, ... start them)
TENSORBOARD_STEP = 299
# Python calls a step that the README's hooks may add where none fires: their two clocks
# are read every 32 steps at most (`ClockSchedule.MAX_AHEAD`), the bar's more often as its
# refresh nears, each reading a handful of calls (0.64 a step, 3.2 a group here). A walk over
# every hook at each reading cost 2.4 a step, 10 a group.
EXTRA_CALLS_PER_STEP = 1.0
EXTRA_CALLS_PER_GROUP = 5.0  # the same with groups of 8 fused steps


def _loop(tmp_path, readme: bool, steps_per_execution: int) -> tuple[Loop, ArrayDataset]:
    trainer = tiny_trainer()
    loop = Loop(trainer, steps_per_execution=steps_per_execution)

    def clock() -> float:
        return loop.loop_step * 1e-3

    if readme:
        hooks.progress_bar(loop, clock=clock, file=io.StringIO(), lines=False)
        hooks.tensorboard(loop, tmp_path / "tensorboard")
        hooks.checkpoint(loop, tmp_path / "checkpoints", period_seconds=60, clock=clock)
    data = tiny_data(shuffle=False, on_device=True, devices=trainer.devices)
    loop.run_steps(data, FIRST_RUN)
    return loop, data


def _calls_by_step(loop: Loop, data: ArrayDataset) -> collections.Counter:
    """Python calls made during the counted run, by the loop step they were made at."""
    return python_calls_by_step(loop, data, COUNTED_RUN)


@pytest.mark.parametrize("steps_per_execution", [1, 8])
def test_readme_hooks_cost_quiet_steps_few_calls(tmp_path, steps_per_execution):
    counted = {}
    for readme in (False, True):
        loop, data = _loop(tmp_path / str(readme), readme, steps_per_execution)
        counted[readme] = _calls_by_step(loop, data)
    bare, readme = counted[False], counted[True]
    # The count sees the hooks' work: TensorBoard's write at its step.
    assert readme[TENSORBOARD_STEP] - bare[TENSORBOARD_STEP] > 10, (bare, readme)
    bare_calls = sum(bare[step] for step in QUIET)
    extra = sum(readme[step] for step in QUIET) - bare_calls
    assert bare_calls > 10 * len(QUIET)  # every step's reading and dispatch were counted
    if steps_per_execution == 1:
        per_step = extra / len(QUIET)
        assert per_step <= EXTRA_CALLS_PER_STEP, (
            f"the README's hooks add {per_step:.2f} Python calls a step where none fires "
            f"(over {bare_calls / len(QUIET):.1f} of the bare loop); at most "
            f"{EXTRA_CALLS_PER_STEP} expected"
        )
    else:
        per_group = extra / (len(QUIET) / steps_per_execution)
        assert per_group <= EXTRA_CALLS_PER_GROUP, (
            f"the README's hooks add {per_group:.2f} Python calls a fused group of "
            f"{steps_per_execution} where none fires; at most {EXTRA_CALLS_PER_GROUP} expected"
        )


@pytest.mark.parametrize("steps_per_execution", [1, 8])
def test_hooks_dispatched_only_at_steps_one_is_due(tmp_path, steps_per_execution):
    # A loop with no hook, then one with a hook every 50 steps: the hook dispatch (the
    # registry's `step_hooks`) is entered only at the steps a hook fires at, not at every step.
    fired = []
    for every in (None, 50):
        trainer = tiny_trainer()
        loop = Loop(trainer, steps_per_execution=steps_per_execution)
        if every is not None:
            hooks.every_n_steps(
                loop, every, "x", lambda loop, metrics: fired.append(loop.loop_step)
            )
        data = tiny_data(shuffle=False, on_device=True, devices=trainer.devices)
        loop.run_steps(data, FIRST_RUN)
        entered: list[int] = []

        def profile(frame, event, arg, loop=loop, entered=entered):
            if event == "call" and frame.f_code.co_name == "step_hooks":
                entered.append(loop.loop_step)

        sys.setprofile(profile)
        try:
            loop.run_steps(data, COUNTED_RUN)
        finally:
            sys.setprofile(None)
        expected = [] if every is None else [249, 299, 349, 399]
        assert entered == expected
    assert fired[-4:] == [249, 299, 349, 399]
