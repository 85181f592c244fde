"""The trigger helpers through a real `loopax.Loop` and `loopax.Trainer`."""

import json
import re
import warnings

import numpy as np
import pytest
from _tiny import MODELS, compiled, restart, tiny_trainer
from hypothesis import example, given, settings
from hypothesis import strategies as st

import loopax
from loopax import hooks
from loopax.hooks import (
    AnyOf,
    AtSteps,
    EveryNEpochs,
    EveryNSteps,
    Exponential,
    FirstNSteps,
    NTimes,
    Periodic,
    at_steps,
    every_n_epochs,
    every_n_steps,
    exponential_callback,
    first_n_steps,
    n_times_during_loop,
    on_schedule,
    periodic_callback,
)

BATCH_SIZE = MODELS["regression"].batch_size


def make_dataset(batches, *, label=1.0, loop_forever=True):
    rows = batches * BATCH_SIZE
    return loopax.ArrayDataset(
        np.ones((rows, 3), np.float32),
        np.full((rows, 1), label, np.float32),
        batch_size=BATCH_SIZE,
        loop_forever=loop_forever,
    )


@pytest.fixture(scope="module")
def compiled_trainer():
    # One trainer for the whole module: compiling costs seconds, a step ~50 us.
    return compiled(tiny_trainer(), make_dataset(8))


@pytest.fixture
def trainer(compiled_trainer):
    return restart(*compiled_trainer)


@pytest.fixture
def loop(trainer):
    return loopax.Loop(trainer)


@pytest.fixture
def dataset():
    return make_dataset(8)


def recorder(fired, phase="OnStep"):
    def record(loop, metrics):
        fired.append(loop.loop_step if phase == "OnStep" else (phase, loop.loop_step))

    return record


# every_n_steps


def test_every_n_steps_fresh_run(loop, dataset):
    fired = []
    every_n_steps(loop, 10, "rec", recorder(fired))
    loop.run_steps(dataset, 35)
    assert fired == [9, 19, 29]


def test_every_n_steps_resumed_run_stays_aligned(loop, dataset):
    fired = []
    every_n_steps(loop, 10, "rec", recorder(fired))
    loop.run_steps(dataset, 25)
    assert fired == [9, 19]
    fired.clear()
    loop.run_steps(dataset, 30)
    assert fired == [29, 39, 49]


def test_every_n_steps_resumed_in_a_new_loop_stays_aligned(trainer, dataset):
    loopax.Loop(trainer).run_steps(dataset, 25)
    loop, fired = loopax.Loop(trainer), []
    every_n_steps(loop, 10, "rec", recorder(fired))
    loop.run_steps(dataset, 30)
    assert fired == [29, 39, 49]


def test_every_n_steps_never_fires_at_an_unaligned_last_step_nor_in_on_end(loop, dataset):
    fired = []
    every_n_steps(loop, 5, "rec", recorder(fired))
    loop.run_steps(dataset, 33)
    assert fired == [4, 9, 14, 19, 24, 29]
    assert loop.hooks("OnEnd") == []


# n_times_during_loop


@pytest.mark.parametrize(
    "n, steps, expected",
    [
        (10, 100, [9, 19, 29, 39, 49, 59, 69, 79, 89, 99]),
        (10, 95, [9, 18, 28, 37, 47, 56, 66, 75, 85, 94]),
        (3, 10, [3, 6, 9]),
        (10, 5, [0, 1, 2, 3, 4]),
    ],
)
def test_n_times_during_loop_fresh_run(loop, dataset, n, steps, expected):
    fired = []
    n_times_during_loop(loop, n, "rec", recorder(fired))
    loop.run_steps(dataset, steps)
    assert fired == expected


def test_n_times_during_loop_restarts_its_count_with_each_run(loop, dataset):
    fired = []
    n_times_during_loop(loop, 10, "rec", recorder(fired))
    loop.run_steps(dataset, 500)
    assert fired == list(range(49, 500, 50))
    fired.clear()
    loop.run_steps(dataset, 100)
    assert fired == list(range(509, 600, 10))


def test_n_times_during_loop_run_epochs_with_unknown_end(loop):
    # 300 batches per epoch, 3 epochs: the end is unknown for the first 300 steps (fires
    # after 128 and 256 of them), then known as step 900, whose even points are every 90.
    fired = []
    n_times_during_loop(loop, 10, "rec", recorder(fired))
    loop.run_epochs(make_dataset(300, loop_forever=False), 3)
    assert loop.loop_step == loop.end_step == 900
    assert fired == [127, 255] + [done - 1 for done in range(360, 901, 90)]


def test_n_times_during_loop_run_epochs_shorter_than_128_steps(loop):
    fired = []
    n_times_during_loop(loop, 4, "rec", recorder(fired))
    loop.run_epochs(make_dataset(10, loop_forever=False), 2)
    # The first epoch's end is unknown; then T = 20, points 5, 10, 15, 20.
    assert fired == [14, 19]


def test_n_times_during_loop_resumed_from_state_keeps_the_original_points(trainer, dataset):
    first_loop, fired = loopax.Loop(trainer), []
    trigger = n_times_during_loop(first_loop, 10, "rec", recorder(fired))

    def stop_at_step_49(loop, metrics):
        if loop.loop_step == 49:
            loop.request_stop("killed")

    first_loop.on_step("stop", stop_at_step_49)
    first_loop.run_steps(dataset, 100)
    assert fired == [9, 19, 29, 39, 49]
    state = json.loads(json.dumps(trigger.get_state()))
    assert state == {"start_step": 0, "end_step": 100}

    resumed_loop, fired = loopax.Loop(trainer), []
    resumed = n_times_during_loop(resumed_loop, 10, "rec", recorder(fired))
    resumed.set_state(state)
    resumed_loop.run_to_step(dataset, 100)
    assert fired == [59, 69, 79, 89, 99]


def test_n_times_during_loop_state_of_another_run_is_ignored(trainer, dataset):
    loopax.Loop(trainer).run_steps(dataset, 50)
    loop, fired = loopax.Loop(trainer), []
    trigger = n_times_during_loop(loop, 10, "rec", recorder(fired))
    trigger.set_state({"start_step": 0, "end_step": 100})
    loop.run_steps(dataset, 60)  # ends at 110, not 100: a new run with its own points
    assert fired == list(range(55, 110, 6))


# exponential_callback


def test_exponential_callback_fresh_run(loop, dataset):
    fired = []
    exponential_callback(loop, 10, 1.2, "rec", recorder(fired))
    loop.run_steps(dataset, 254)
    assert fired == [10, 22, 36, 53, 73, 97, 126, 161, 203, 253]


def test_exponential_callback_100_and_200(trainer, dataset):
    loop, fired_100, fired_200 = loopax.Loop(trainer), [], []
    exponential_callback(loop, 100, 1.2, "a", recorder(fired_100))
    exponential_callback(loop, 200, 1.2, "b", recorder(fired_200))
    loop.run_steps(dataset, 2000)
    assert fired_100 == [100, 220, 364, 537, 745, 995, 1295, 1655]
    assert fired_200 == [200, 440, 728, 1074, 1489, 1987]


def test_exponential_callback_resumed_at_300_lands_on_the_grid(loop, dataset):
    fired = []
    exponential_callback(loop, 100, 1.2, "rec", recorder(fired))
    loop.run_steps(dataset, 300)
    assert fired == [100, 220]
    fired.clear()
    loop.run_steps(dataset, 500)
    assert fired == [364, 537, 745]


def test_exponential_callback_resumed_in_a_new_loop(trainer, dataset):
    loopax.Loop(trainer).run_steps(dataset, 300)
    loop, fired = loopax.Loop(trainer), []
    trigger = exponential_callback(loop, 100, 1.2, "rec", recorder(fired))
    assert trigger.get_state() == {}
    loop.run_steps(dataset, 500)
    assert fired == [364, 537, 745]


def test_exponential_callback_call_on_end_fires_once_in_on_end(loop, dataset):
    fired = []
    exponential_callback(loop, 10, 1.2, "rec", recorder(fired), call_on_end=True)
    loop.on_end("after", recorder(fired, "after"))
    loop.run_steps(dataset, 30)
    assert fired == [10, 22, 30, ("after", 30)]


# periodic_callback


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def one_second_per_step(loop, clock):
    # A VALIDATE-band hook runs before the trigger: step k happens at time k.
    def tick(loop, metrics):
        clock.now = float(loop.loop_step)

    loop.on_step("tick", tick, priority=loopax.Priority.VALIDATE)


def test_periodic_callback_first_step_only_starts_the_clock(loop, dataset):
    clock, fired = FakeClock(), []
    one_second_per_step(loop, clock)
    periodic_callback(loop, 3, "rec", recorder(fired), clock=clock)
    loop.run_steps(dataset, 12)
    assert fired == [3, 6, 9]
    fired.clear()
    loop.run_steps(dataset, 8)  # steps 12..19: step 12 restarts the clock
    assert fired == [15, 18]


def test_periodic_callback_does_not_catch_up_a_slow_callback(loop, dataset):
    clock, fired = FakeClock(), []
    offset = [0.0]

    def tick(loop, metrics):
        clock.now = loop.loop_step + offset[0]

    def slow(loop, metrics):
        fired.append(loop.loop_step)
        offset[0] += 5.0  # the callback takes 5 s
        clock.now += 5.0

    loop.on_step("tick", tick, priority=loopax.Priority.VALIDATE)
    periodic_callback(loop, 3, "slow", slow, clock=clock)
    loop.run_steps(dataset, 10)
    assert fired == [3, 6, 9]


def test_periodic_callback_call_on_end_fires_once_in_on_end(loop, dataset):
    clock, fired = FakeClock(), []
    one_second_per_step(loop, clock)
    trigger = periodic_callback(loop, 3, "rec", recorder(fired), call_on_end=True, clock=clock)
    loop.run_steps(dataset, 8)
    assert fired == [3, 6, 8]
    assert trigger.get_state() == {}


def test_periodic_callback_call_on_end_with_zero_epochs(loop, dataset):
    fired = []
    periodic_callback(loop, 3, "rec", recorder(fired, "end"), call_on_end=True, clock=FakeClock())
    loop.run_epochs(dataset, 0)
    assert fired == [("end", 0)]


# registration: names, priorities, errors, state


def test_hook_names_and_returned_triggers(loop):
    noop = lambda loop, metrics: None  # noqa: E731
    triggers = [
        every_n_steps(loop, 10, "eval", noop),
        n_times_during_loop(loop, 5, "plot", noop),
        periodic_callback(loop, 2.5, "log", noop, call_on_end=True),
        exponential_callback(loop, 100, 1.2, "save", noop, call_on_end=True),
    ]
    names = [
        "every_n_steps(10): eval",
        "n_times_during_loop(5): plot",
        "periodic_callback(2.5s): log",
        "exponential_callback(100, 1.2): save",
    ]
    assert [name for _, name in loop.hooks("OnStep")] == names
    assert [name for _, name in loop.hooks("OnEnd")] == names[2:]
    assert [trigger.name for trigger in triggers] == names
    assert [type(trigger.schedule) for trigger in triggers] == [
        hooks.EveryNSteps,
        hooks.NTimes,
        hooks.Periodic,
        hooks.Exponential,
    ]
    # Their positions are part of the loop's checkpointed state, under the hook names.
    assert list(loop.get_state()["hooks"]) == names
    # Default-band hooks do not wait for the loss check before they run.
    assert not any(trigger.check_finite for trigger in triggers)


def test_hook_error_names_the_trigger_hook(loop, dataset):
    def boom(loop, metrics):
        raise KeyError("boom")

    every_n_steps(loop, 4, "boom", boom)
    with pytest.raises(loopax.HookError, match=r"'every_n_steps\(4\): boom' failed at step 3"):
        loop.run_steps(dataset, 10)


def test_triggers_run_in_priority_order(loop, dataset):
    order = []
    P = loopax.Priority

    def record(name):
        return lambda loop, metrics: order.append((loop.loop_step, name))

    every_n_steps(loop, 1, "ui", record("ui"), priority=P.UI)
    loop.on_step("plain", record("plain"))
    n_times_during_loop(loop, 5, "ckpt", record("ckpt"), priority=P.CHECKPOINT)
    exponential_callback(loop, 1, 2.0, "eval", record("eval"), priority=P.EVALUATE)
    loop.run_steps(dataset, 2)
    assert order == [
        (0, "plain"),
        (0, "ckpt"),
        (0, "ui"),
        (1, "eval"),
        (1, "plain"),
        (1, "ckpt"),
        (1, "ui"),
    ]
    assert [priority for priority, _ in loop.hooks("OnStep")] == [P.EVALUATE, 0, P.CHECKPOINT, P.UI]


@pytest.mark.parametrize(
    "register, message",
    [
        (lambda loop, fn: every_n_steps(loop, 0, "x", fn), r"n must be a positive int, got n=0"),
        (lambda loop, fn: every_n_steps(loop, 2.5, "x", fn), r"n must be a positive int, got 2.5"),
        (lambda loop, fn: n_times_during_loop(loop, -3, "x", fn), r"got n=-3"),
        (lambda loop, fn: n_times_during_loop(loop, "10", "x", fn), r"got '10'"),
        (lambda loop, fn: periodic_callback(loop, 0, "x", fn), r"got period_seconds=0"),
        (lambda loop, fn: periodic_callback(loop, -1.5, "x", fn), r"got period_seconds=-1.5"),
        (lambda loop, fn: exponential_callback(loop, 0, 1.2, "x", fn), r"got start_step=0"),
        (lambda loop, fn: exponential_callback(loop, 10, 1.0, "x", fn), r"got factor=1.0"),
        (lambda loop, fn: exponential_callback(loop, 10, 0.5, "x", fn), r"got factor=0.5"),
    ],
)
def test_invalid_arguments_raise_at_registration(loop, register, message):
    with pytest.raises(ValueError, match=message):
        register(loop, lambda loop, metrics: None)
    assert loop.hooks("OnStep") == [] and loop.hooks("OnEnd") == []
    assert loop.get_state()["hooks"] == {}


def test_trigger_states_are_json_serializable(loop, dataset):
    noop = lambda loop, metrics: None  # noqa: E731
    every_n_steps(loop, 10, "a", noop)
    n_times_during_loop(loop, 5, "b", noop)
    periodic_callback(loop, 1, "c", noop, clock=FakeClock())
    exponential_callback(loop, 10, 1.5, "d", noop)
    loop.run_steps(dataset, 7)
    states = loop.get_state()["hooks"]
    assert json.loads(json.dumps(states)) == {
        "every_n_steps(10): a": {},
        "n_times_during_loop(5): b": {"start_step": 0, "end_step": 7},
        "periodic_callback(1s): c": {},
        "exponential_callback(10, 1.5): d": {},
    }
    loop.set_state({"hooks": states})


# the lazy finite-loss check


def test_checkpoint_band_trigger_checks_the_loss_only_when_it_fires(loop, dataset):
    checked_at, fired = [], []
    check_finite = loop.check_finite

    def counting_check_finite():
        checked_at.append(loop.loop_step)
        check_finite()

    loop.check_finite = counting_check_finite
    every_n_steps(loop, 10, "ckpt", recorder(fired), priority=loopax.Priority.CHECKPOINT)
    every_n_steps(loop, 10, "plain", lambda loop, metrics: None)
    loop.run_steps(dataset, 35)
    assert fired == [9, 19, 29]
    assert checked_at == [9, 19, 29]


def test_checkpoint_band_trigger_refuses_a_non_finite_loss(loop):
    fired = []
    every_n_steps(loop, 10, "ckpt", recorder(fired), priority=loopax.Priority.CHECKPOINT)
    with pytest.raises(Exception) as error:
        loop.run_steps(make_dataset(8, label=float("nan")), 35)
    assert fired == []
    # The error raised from inside the hook may come wrapped in a HookError.
    non_finite = error.value
    if not isinstance(non_finite, loopax.NonFiniteLossError):
        non_finite = non_finite.__cause__
    assert isinstance(non_finite, loopax.NonFiniteLossError)
    # It names the first bad step, not the step where it was noticed.
    assert "at step 0 " in str(non_finite) and non_finite.step == 0


def test_default_band_trigger_does_not_wait_for_the_check_but_the_run_still_stops(loop):
    fired = []
    every_n_steps(loop, 10, "plain", recorder(fired))
    with pytest.raises(loopax.NonFiniteLossError, match="at step 0 ") as error:
        loop.run_steps(make_dataset(8, label=float("nan")), 100)
    assert error.value.step == 0
    # Noticed when the loop waited for the steps in flight (at most 8 on several devices, 32
    # on one), and the plain hook ran on the steps before it without waiting.
    assert loop.loop_step <= 33
    assert fired == [step for step in (9, 19, 29) if step < loop.loop_step]


def test_non_int_priority_is_rejected_at_registration(loop):
    with pytest.raises(TypeError, match=r"priority must be an int"):
        every_n_steps(loop, 10, "x", lambda loop, metrics: None, priority=2.5)
    assert loop.hooks("OnStep") == [] and loop.get_state()["hooks"] == {}


# at_steps


def global_step_recorder(fired):
    def record(loop, metrics):
        fired.append((loop.loop_step, loop.trainer.global_step))

    return record


def test_at_steps_fires_after_the_steps_that_reach_the_global_steps(loop, dataset):
    fired = []
    hook = at_steps(loop, [1, 5, 20], "rec", global_step_recorder(fired))
    assert hook.name == "at_steps(1, 5, 20): rec" and isinstance(hook.schedule, AtSteps)
    loop.run_steps(dataset, 20)
    # The first and the last step of the run included; loop_step = global step - 1.
    assert fired == [(0, 1), (4, 5), (19, 20)]


def test_at_steps_sorts_and_drops_duplicates(loop, dataset):
    fired = []
    hook = at_steps(loop, [12, 3, 12, 7, 3], "rec", recorder(fired))
    assert hook.name == "at_steps(3, 7, 12): rec"
    loop.run_steps(dataset, 15)
    assert fired == [2, 6, 11]


def test_at_steps_accepts_any_iterable_of_ints(loop, dataset):
    fired = []
    at_steps(loop, (step for step in np.array([9, 2, 6, 1, 4, 5])), "rec", recorder(fired))
    assert loop.hooks("OnStep") == [(0, "at_steps(1, 2, 4, 5, 6, ...): rec")]
    loop.run_steps(dataset, 10)
    assert fired == [0, 1, 3, 4, 5, 8]


def test_at_steps_past_the_end_of_a_run_fire_in_a_later_run(loop, dataset):
    fired = []
    at_steps(loop, [5, 30, 1000], "rec", recorder(fired))
    loop.run_steps(dataset, 10)
    assert fired == [4]
    loop.run_steps(dataset, 25)
    assert fired == [4, 29]


def test_at_steps_resumed_run_skips_the_steps_already_reached(loop, dataset):
    fired = []
    at_steps(loop, [5, 20, 21, 30], "rec", global_step_recorder(fired))
    loop.run_steps(dataset, 20)
    assert fired == [(4, 5), (19, 20)]
    fired.clear()
    loop.run_steps(dataset, 15)
    assert fired == [(20, 21), (29, 30)]


def test_at_steps_resumed_in_a_new_loop_skips_the_steps_already_reached(trainer, dataset):
    loopax.Loop(trainer).run_steps(dataset, 20)
    loop, fired = loopax.Loop(trainer), []
    at_steps(loop, [5, 20, 21, 30], "rec", global_step_recorder(fired))
    loop.run_steps(dataset, 15)
    # Global step 20 was reached by the run before: it does not fire again.
    assert fired == [(20, 21), (29, 30)]


@pytest.mark.parametrize(
    "steps, message",
    [
        ([], r"at least one global step"),
        ((step for step in ()), r"at least one global step"),
        ([0], r"got steps=0"),
        ([5, -3], r"got steps=-3"),
        ([2.5], r"got 2.5 of type float"),
        ([10, "20"], r"got '20' of type str"),
        ([True], r"got True of type bool"),
        ([None], r"got None of type NoneType"),
        (100, r"steps must be a list of global steps.*got 100"),
        ("100", r"steps must be a list of global steps.*got '100'"),
    ],
)
def test_at_steps_rejects_bad_steps_at_registration(loop, steps, message):
    with pytest.raises(ValueError, match=message):
        at_steps(loop, steps, "x", lambda loop, metrics: None)
    assert loop.hooks("OnStep") == [] and loop.get_state()["hooks"] == {}


# first_n_steps


def test_first_n_steps_fires_at_the_first_steps_of_every_run(loop, dataset):
    fired = []
    hook = first_n_steps(loop, 3, "rec", recorder(fired))
    assert hook.name == "first_n_steps(3): rec"
    loop.run_steps(dataset, 10)
    assert fired == [0, 1, 2]
    loop.run_steps(dataset, 5)
    assert fired == [0, 1, 2, 10, 11, 12]
    loop.run_steps(dataset, 2)  # a run shorter than n: every step
    assert fired == [0, 1, 2, 10, 11, 12, 15, 16]


def test_first_n_steps_of_a_resumed_trainer(trainer, dataset):
    loopax.Loop(trainer).run_steps(dataset, 100)
    loop, fired = loopax.Loop(trainer), []
    first_n_steps(loop, 2, "rec", recorder(fired))
    loop.run_steps(dataset, 5)
    assert fired == [100, 101]


def test_first_n_steps_counts_the_steps_of_the_run_not_of_each_epoch(loop):
    fired = []
    first_n_steps(loop, 6, "rec", recorder(fired))
    loop.run_epochs(make_dataset(4, loop_forever=False), 3)
    assert fired == [0, 1, 2, 3, 4, 5]


def test_first_n_steps_of_process_counts_across_the_runs_of_the_loop(loop, dataset):
    fired, per_run = [], []
    hook = first_n_steps(loop, 4, "rec", recorder(fired), of_process=True)
    first_n_steps(loop, 4, "per run", recorder(per_run))
    assert hook.name == "first_n_steps(4, of_process=True): rec"
    loop.run_steps(dataset, 3)
    assert fired == [0, 1, 2]
    loop.run_steps(dataset, 5)
    assert fired == [0, 1, 2, 3]  # 4 steps in all
    loop.run_steps(dataset, 5)
    assert fired == [0, 1, 2, 3]
    assert per_run == [0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11]


def test_first_n_steps_of_process_counts_only_the_steps_a_stopped_run_ran(loop, dataset):
    fired = []
    first_n_steps(loop, 4, "rec", recorder(fired), of_process=True)

    def stop_after_step_1(loop, metrics):
        if loop.loop_step == 1:
            loop.request_stop("stopped")

    loop.on_step("stop", stop_after_step_1)
    loop.run_steps(dataset, 10)
    assert loop.loop_step == 2 and fired == [0, 1]
    loop.run_epochs(make_dataset(3, loop_forever=False), 2)
    assert fired == [0, 1, 2, 3]


@pytest.mark.parametrize("n", [0, -1, 2.5, "3", None])
def test_first_n_steps_rejects_a_bad_n_at_registration(loop, n):
    with pytest.raises(ValueError, match=r"n must be a positive int"):
        first_n_steps(loop, n, "x", lambda loop, metrics: None)
    assert loop.hooks("OnStep") == [] and loop.get_state()["hooks"] == {}


# schedules combined with |


def test_combined_schedules_fire_once_at_the_union_of_their_steps(loop, dataset):
    fired = []
    when = EveryNSteps(10) | AtSteps([3, 10, 15]) | FirstNSteps(3)
    hook = on_schedule(loop, when, "rec", recorder(fired))
    assert hook.name == "every_n_steps(10) | at_steps(3, 10, 15) | first_n_steps(3): rec"
    assert isinstance(hook.schedule, AnyOf) and len(hook.schedule.schedules) == 3
    loop.run_steps(dataset, 30)
    # Step 2 is both a first step and global step 3; step 9 both every 10 and global step 10.
    assert fired == [0, 1, 2, 9, 14, 19, 29]
    fired.clear()
    loop.run_steps(dataset, 12)
    assert fired == [30, 31, 32, 39]


def test_combined_schedule_passed_as_when(loop, dataset):
    fired = []
    loop.on_step("rec", recorder(fired), when=AtSteps([2]) | EveryNSteps(4))
    loop.run_steps(dataset, 9)
    assert fired == [1, 3, 7]


@pytest.mark.parametrize(
    "when, expected",
    [
        # The other part fires first on the exponential grid points 10 and 22: the exponential
        # part is still asked there, so it advances and does not fire again at 11 and 23.
        (AtSteps([11, 23]) | Exponential(10, 1.2), [10, 22, 36]),
        (EveryNSteps(11) | Exponential(10, 1.2), [10, 21, 22, 32, 36]),
        (Exponential(10, 1.2) | Exponential(5, 2.0), [5, 10, 15, 22, 35, 36]),
    ],
)
def test_every_part_of_a_combined_schedule_advances(loop, dataset, when, expected):
    fired = []
    on_schedule(loop, when, "rec", recorder(fired))
    loop.run_steps(dataset, 40)
    assert fired == expected


def test_combined_schedule_with_a_clock(loop, dataset):
    clock, fired = FakeClock(), []
    one_second_per_step(loop, clock)
    hook = on_schedule(loop, Periodic(3, clock) | EveryNSteps(5), "rec", recorder(fired))
    assert hook.name == "periodic_callback(3s) | every_n_steps(5): rec"
    # The clock is read only every few steps, from how fast it runs per step.
    assert not hook.schedule.checks_every_step
    loop.run_steps(dataset, 12)
    # Step 0 starts the clock; the period then counts from the hook's last call, whichever
    # part made it run (every part's `fired` runs): 3 (clock), 4 (every 5), 7 (clock), 9.
    assert fired == [3, 4, 7, 9]
    fired.clear()
    loop.run_steps(dataset, 8)  # steps 12..19: step 12 starts the clock again
    assert fired == [14, 17, 19]


def test_combined_schedule_with_a_clock_fires_once_when_both_fire(loop, dataset):
    clock, fired = FakeClock(), []
    one_second_per_step(loop, clock)
    on_schedule(loop, Periodic(2, clock) | AtSteps([3, 5, 7]), "rec", recorder(fired))
    loop.run_steps(dataset, 9)
    # Steps 2, 4 and 6 are both global steps 3, 5, 7 and two seconds after the last call.
    assert fired == [2, 4, 6, 8]


@pytest.mark.parametrize("register_first", [True, False])
def test_combined_n_times_state_round_trips_through_the_loop_state(
    trainer, dataset, register_first
):
    first_loop, fired = loopax.Loop(trainer), []
    hook = on_schedule(first_loop, EveryNSteps(25) | NTimes(10), "rec", recorder(fired))

    def stop_at_step_49(loop, metrics):
        if loop.loop_step == 49:
            loop.request_stop("killed")

    first_loop.on_step("stop", stop_at_step_49)
    first_loop.run_steps(dataset, 100)
    assert fired == [9, 19, 24, 29, 39, 49]
    state = json.loads(json.dumps(first_loop.get_state()))
    assert state["hooks"][hook.name] == {"1": {"start_step": 0, "end_step": 100}}

    resumed_loop, fired = loopax.Loop(trainer), []
    if not register_first:  # a state waits for the hook of its name
        resumed_loop.set_state(state)
    on_schedule(resumed_loop, EveryNSteps(25) | NTimes(10), "rec", recorder(fired))
    if register_first:
        resumed_loop.set_state(state)
    resumed_loop.run_to_step(dataset, 100)
    # The original run's points, not those of a new 50-step run (54, 59, 64, ...).
    assert fired == [59, 69, 74, 79, 89, 99]


def test_combined_state_of_stateless_parts_is_empty(loop, dataset):
    hook = on_schedule(loop, EveryNSteps(3) | AtSteps([2]) | NTimes(2), "rec", recorder([]))
    assert hook.get_state() == {}
    loop.run_steps(dataset, 4)
    assert hook.get_state() == {"2": {"start_step": 0, "end_step": 4}}


@pytest.mark.parametrize(
    "combine",
    [
        lambda: EveryNSteps(10) | 5,
        lambda: EveryNSteps(10) | None,
        lambda: EveryNSteps(10) | (lambda loop: True),
        lambda: 5 | EveryNSteps(10),
        lambda: AnyOf(EveryNSteps(1), "every step"),
    ],
)
def test_only_schedules_combine(combine):
    with pytest.raises(TypeError):
        combine()


def test_or_with_a_non_schedule_names_the_culprit():
    with pytest.raises(TypeError, match=r"only schedules combine with \|, got int"):
        EveryNSteps(10) | 5


@pytest.mark.parametrize(
    "register, message",
    [
        (lambda loop, fn: loop.on_step("x", fn, when=EveryNEpochs(2)), r"loop.on_epoch_end"),
        (lambda loop, fn: loop.on_step("x", fn, when=lambda loop: True), r"when= must be"),
        (lambda loop, fn: loop.on_epoch_end("x", fn, when=EveryNSteps(2)), r"loop.on_step"),
        (lambda loop, fn: loop.on_epoch_end("x", fn, when=FirstNSteps(2)), r"loop.on_step"),
        (
            lambda loop, fn: loop.on_epoch_end("x", fn, when=EveryNSteps(2) | AtSteps([3])),
            r"loop.on_step",
        ),
    ],
)
def test_a_schedule_in_the_wrong_phase_raises_at_registration(loop, register, message):
    with pytest.raises(TypeError, match=message):
        register(loop, lambda loop, metrics: None)
    assert loop.hooks("OnStep") == [] and loop.hooks("OnEpochEnd") == []
    assert loop.get_state()["hooks"] == {}


def test_an_epoch_schedule_combined_with_a_step_schedule_raises(loop):
    # Refused where they are combined: an epoch part would otherwise be asked at every step.
    with pytest.raises(TypeError, match=r"cannot combine epoch-end and step schedules.*two hooks"):
        EveryNSteps(3) | EveryNEpochs(2)
    with pytest.raises(TypeError, match=r"cannot combine epoch-end and step schedules"):
        on_schedule(loop, EveryNEpochs(2) | AtSteps([3]), "rec", lambda loop, metrics: None)
    assert loop.hooks("OnStep") == [] and loop.hooks("OnEpochEnd") == []


def test_epoch_schedules_combine_with_each_other(loop):
    fired = []
    on_schedule(loop, EveryNEpochs(2) | EveryNEpochs(3), "rec", recorder(fired))
    loop.run_epochs(make_dataset(2, loop_forever=False), 6)
    # Ends of epochs 1, 2, 3 and 5 (0-based, 2 steps each), where loop_step is one past the
    # epoch's last step, as in OnEnd.
    assert fired == [4, 6, 8, 12]


# every_n_epochs


def test_every_n_epochs_fires_after_the_step_hooks_of_the_epochs_last_step(loop):
    events, step_metrics = [], []

    def on_step(loop, metrics):
        events.append(("step", loop.loop_step))
        step_metrics.append(metrics)

    def on_epoch_end(loop, metrics):
        last_step_metrics = metrics is step_metrics[-1] and metrics is loop.metrics
        events.append(
            ("epoch", loop.epoch, loop.trainer.global_step, loop.end_step, last_step_metrics)
        )

    loop.on_step("steps", on_step, priority=loopax.Priority.UI)
    hook = every_n_epochs(loop, 2, "rec", on_epoch_end, priority=loopax.Priority.VALIDATE)
    assert hook.name == "every_n_epochs(2): rec" and hook.phase == "OnEpochEnd"
    assert loop.hooks("OnEpochEnd") == [(loopax.Priority.VALIDATE, "every_n_epochs(2): rec")]
    assert loop.hooks("OnStep") == [(loopax.Priority.UI, "steps")]
    loop.run_epochs(make_dataset(4, loop_forever=False), 5)
    epoch_events = [event for event in events if event[0] == "epoch"]
    assert epoch_events == [("epoch", 1, 8, 20, True), ("epoch", 3, 16, 20, True)]
    # After every OnStep hook of the epoch's last step (even one of a later band), before
    # the next epoch's first step.
    for event, last_step in zip(epoch_events, (7, 15), strict=True):
        at = events.index(event)
        assert events[at - 1] == ("step", last_step)
        assert events[at + 1] == ("step", last_step + 1)


def test_every_n_epochs_knows_the_end_step_at_the_first_epoch_end(loop):
    fired = []

    def record(loop, metrics):
        fired.append((loop.epoch, loop.trainer.global_step, loop.end_step))

    every_n_epochs(loop, 1, "rec", record)
    loop.run_epochs(make_dataset(4, loop_forever=False), 3)
    assert fired == [(0, 4, 12), (1, 8, 12), (2, 12, 12)]


def test_every_n_epochs_counts_the_epochs_of_each_run(loop):
    fired = []

    def record(loop, metrics):
        fired.append((loop.epoch, loop.trainer.global_step))

    every_n_epochs(loop, 2, "rec", record)
    data = make_dataset(3, loop_forever=False)
    loop.run_epochs(data, 3)
    loop.run_epochs(data, 3)
    assert fired == [(1, 6), (1, 15)]


def test_every_n_epochs_warns_when_the_loop_runs_steps(loop, dataset):
    fired = []
    every_n_epochs(loop, 1, "rec", recorder(fired))
    with pytest.warns(RuntimeWarning, match=r"every_n_epochs\(1\): rec.*only run_epochs has"):
        loop.run_steps(dataset, 10)
    assert fired == []


@pytest.mark.parametrize("n", [0, -2, 1.5, None])
def test_every_n_epochs_rejects_a_bad_n_at_registration(loop, n):
    with pytest.raises(ValueError, match=r"n must be a positive int"):
        every_n_epochs(loop, n, "x", lambda loop, metrics: None)
    assert loop.hooks("OnEpochEnd") == [] and loop.get_state()["hooks"] == {}


def named_dataset(name, batches):
    rows = batches * BATCH_SIZE
    return loopax.ArrayDataset(
        np.ones((rows, 3), np.float32),
        np.ones((rows, 1), np.float32),
        batch_size=BATCH_SIZE,
        name=name,
        shuffle=False,
    )


def test_evaluate_every_n_epochs_evaluates_once_per_epoch(loop):
    evaluator = hooks.evaluate(loop, named_dataset("test", 2), every_n_epochs=1, call_on_end=False)
    loop.run_epochs(make_dataset(4, loop_forever=False), 3)
    assert [step for step, _ in loop.history["eval/test/mean_loss"]] == [4, 8, 12]
    assert [step for step, _ in evaluator.history] == [4, 8, 12]


def test_evaluate_every_2_epochs_and_on_end(loop):
    evaluated = []
    loop.on_evaluation("listener", lambda loop, evaluation: evaluated.append(evaluation.step))
    hooks.evaluate(loop, named_dataset("test", 2), every_n_epochs=2)
    loop.run_epochs(make_dataset(4, loop_forever=False), 4)
    # The end of epoch 3 is the end of the run: one evaluation serves both.
    assert [step for step, _ in loop.history["eval/test/mean_loss"]] == [8, 16]
    assert evaluated == [8, 16]


# exponential_callback resumed on a grid point


def test_exponential_callback_resumed_on_a_grid_point_fires_there(loop, dataset):
    fired = []
    exponential_callback(loop, 10, 1.2, "rec", recorder(fired))
    loop.run_steps(dataset, 10)  # steps 0..9: the first grid point, 10, is the next step
    assert fired == []
    loop.run_steps(dataset, 12)  # steps 10..21
    assert fired == [10]
    loop.run_steps(dataset, 14)  # steps 22..35
    assert fired == [10, 22]
    loop.run_steps(dataset, 1)  # step 36 alone
    assert fired == [10, 22, 36]


def test_exponential_callback_resumed_on_a_grid_point_in_a_new_loop(trainer, dataset):
    loopax.Loop(trainer).run_steps(dataset, 22)
    loop, fired = loopax.Loop(trainer), []
    exponential_callback(loop, 10, 1.2, "rec", recorder(fired))
    loop.run_steps(dataset, 15)  # steps 22..36
    assert fired == [22, 36]


def test_exponential_callback_stopped_and_resumed_on_a_grid_point(trainer, dataset):
    uninterrupted, fired = loopax.Loop(trainer), []
    exponential_callback(uninterrupted, 100, 1.2, "rec", recorder(fired))
    uninterrupted.run_steps(dataset, 400)
    assert fired == [100, 220, 364]
    # The same steps in runs cut at every grid point, each in a new loop.
    trainer.state = trainer.state.replace(step=np.zeros_like(np.asarray(trainer.state.step)))
    fired_in_parts = []
    for end in (100, 220, 364, 400):
        loop = loopax.Loop(trainer)
        exponential_callback(loop, 100, 1.2, "rec", recorder(fired_in_parts))
        loop.run_to_step(dataset, end)
    assert fired_in_parts == fired


# hooks registered while a run is in progress


def test_triggers_registered_during_a_run_fire_from_the_next_step(loop, dataset):
    fired = {}
    registrations = {
        "every": lambda loop, fn: every_n_steps(loop, 10, "every", fn),
        "at": lambda loop, fn: at_steps(loop, [10, 20, 50], "at", fn),
        "n_times": lambda loop, fn: n_times_during_loop(loop, 4, "n_times", fn),
        "exponential": lambda loop, fn: exponential_callback(loop, 10, 1.2, "exponential", fn),
        "first": lambda loop, fn: first_n_steps(loop, 20, "first", fn),
        "combined": lambda loop, fn: on_schedule(
            loop, Exponential(5, 2.0) | AtSteps([30]), "combined", fn
        ),
    }

    def register_at_step_14(loop, metrics):
        if loop.loop_step == 14:
            for name, register in registrations.items():
                fired[name] = []
                register(loop, recorder(fired[name]))

    loop.on_step("registrar", register_at_step_14)
    loop.run_steps(dataset, 100)
    assert fired == {
        "every": [19, 29, 39, 49, 59, 69, 79, 89, 99],
        "at": [19, 49],  # global step 10 was reached before
        "n_times": [24, 49, 74, 99],  # the points of the run, which started at 0
        "exponential": [22, 36, 53, 73, 97],  # the grid points after 14, none caught up
        "first": [15, 16, 17, 18, 19],  # the first 20 steps of the run
        "combined": [15, 29, 35, 75],  # grid 5, 15, 35, 75 and global step 30
    }


def test_exponential_registered_by_a_scheduled_hook_starts_on_its_grid(loop, dataset):
    fired = []

    def register_at_step_39(loop, metrics):
        if loop.loop_step == 39:
            exponential_callback(loop, 10, 1.2, "rec", recorder(fired), priority=loopax.Priority.UI)

    every_n_steps(loop, 20, "registrar", register_at_step_39)
    loop.run_steps(dataset, 100)
    assert fired == [53, 73, 97]


def test_registering_an_earlier_hook_during_a_step_does_not_rerun_the_current_one(loop, dataset):
    calls, fired = [], []

    def register_once(loop, metrics):
        calls.append(loop.loop_step)
        if not fired and loop.loop_step == 4:
            fired.append("registered")
            at_steps(loop, [8], "late", recorder(fired), priority=loopax.Priority.EVALUATE)

    every_n_steps(loop, 5, "registrar", register_once)
    loop.run_steps(dataset, 10)
    assert fired == ["registered", 7]
    assert calls == [4, 9]


# the loop's skipping by next_step against asking every schedule at every step


def reset_trainer(compiled_trainer, global_step):
    return restart(*compiled_trainer, step=global_step)


def build_schedule(spec, clock):
    kind, *args = spec
    if kind == "every":
        return EveryNSteps(*args)
    if kind == "n_times":
        return NTimes(*args)
    if kind == "exponential":
        return Exponential(*args)
    if kind == "at":
        return AtSteps(*args)
    if kind == "first":
        n, of_process = args
        return FirstNSteps(n, of_process=of_process)
    assert kind == "periodic"
    return Periodic(*args, clock=clock)


class FakeLoop:
    """What the schedules read of a `Loop`, for the brute-force reference."""

    def __init__(self, global_step):
        self.loop_step = self.start_step = global_step
        self.end_step = -1
        self.epoch = 0


def brute_force_firings(hook_specs, epoch_period, runs, first_step, new_loop_per_run):
    """Asks every part of every hook at every step, as if nothing were ever skipped."""
    fake = FakeLoop(first_step)

    def clock():  # one second per step
        return float(fake.loop_step)

    def build():
        parts = [[build_schedule(spec, clock) for spec in specs] for specs in hook_specs]
        return parts, EveryNEpochs(epoch_period) if epoch_period else None

    def start_run(end_step):
        fake.start_step, fake.end_step, fake.epoch = fake.loop_step, end_step, 0
        for hook_parts in hook_parts_list:
            for part in hook_parts:
                part.start_run(fake)

    def visit(step):
        fake.loop_step = step
        for hook_parts, hook_fired in zip(hook_parts_list, fired, strict=True):
            answers = [part.should_fire(fake) for part in hook_parts]  # no short-circuit
            if any(answers):
                hook_fired.append(step)
                for part in hook_parts:
                    part.fired(fake)

    fired, epoch_fired = [[] for _ in hook_specs], []
    hook_parts_list, epoch_schedule = build()
    for index, run in enumerate(runs):
        if new_loop_per_run and index:
            hook_parts_list, epoch_schedule = build()
        first = fake.loop_step
        if run[0] == "steps":
            if run[1] == 0:
                continue  # run_steps(0) starts no run
            start_run(first + run[1])
            for step in range(first, first + run[1]):
                visit(step)
            fake.loop_step = first + run[1]
            continue
        _, batches, epochs = run
        start_run(-1)
        for epoch in range(epochs):
            fake.epoch = epoch
            for step in range(first + epoch * batches, first + (epoch + 1) * batches):
                visit(step)
            fake.loop_step = first + (epoch + 1) * batches
            fake.end_step = fake.loop_step + batches * (epochs - epoch - 1)
            if epoch_schedule is not None and epoch_schedule.should_fire(fake):
                epoch_fired.append((epoch, fake.loop_step))
    return fired, epoch_fired


def loop_firings(trainer, hook_specs, epoch_period, runs, new_loop_per_run):
    fired, epoch_fired = [[] for _ in hook_specs], []

    def record_epoch(loop, metrics):
        epoch_fired.append((loop.epoch, loop.trainer.global_step))

    def new_loop():
        loop = loopax.Loop(trainer)

        def clock():  # one second per step
            return float(loop.loop_step)

        for index, specs in enumerate(hook_specs):
            parts = [build_schedule(spec, clock) for spec in specs]
            when = parts[0] if len(parts) == 1 else AnyOf(*parts)
            loop.on_step(f"hook {index}", recorder(fired[index]), when=when)
        if epoch_period:
            every_n_epochs(loop, epoch_period, "epochs", record_epoch)
        return loop

    loop, forever = new_loop(), make_dataset(8)
    # A loop with an epoch hook warns once, at its first run_steps that runs a step.
    loop_number, loops_that_warn = 0, set()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for index, run in enumerate(runs):
            if new_loop_per_run and index:
                loop, loop_number = new_loop(), loop_number + 1
            if run[0] == "steps":
                if epoch_period and run[1]:
                    loops_that_warn.add(loop_number)
                loop.run_steps(forever, run[1])
            else:
                loop.run_epochs(make_dataset(run[1], loop_forever=False), run[2])
    messages = [str(warning.message) for warning in caught]
    assert len(messages) == len(loops_that_warn), messages
    assert all(re.search(r"hooks .* run at epoch ends", message) for message in messages)
    return fired, epoch_fired


schedule_specs = st.one_of(
    st.tuples(st.just("every"), st.integers(1, 40)),
    st.tuples(st.just("n_times"), st.integers(1, 12)),
    st.tuples(st.just("exponential"), st.integers(1, 40), st.sampled_from([1.2, 1.5, 2.0])),
    st.tuples(st.just("at"), st.lists(st.integers(1, 450), min_size=1, max_size=6)),
    st.tuples(st.just("first"), st.integers(1, 10), st.booleans()),
    st.tuples(st.just("periodic"), st.sampled_from([2.0, 3.5])),
)
run_specs = st.one_of(
    st.tuples(st.just("steps"), st.integers(0, 100)),
    st.tuples(st.just("epochs"), st.integers(1, 25), st.integers(0, 3)),
)


@settings(max_examples=50, deadline=None)
@given(
    hook_specs=st.lists(st.lists(schedule_specs, min_size=1, max_size=3), min_size=1, max_size=3),
    epoch_period=st.none() | st.integers(1, 3),
    runs=st.lists(run_specs, min_size=1, max_size=3),
    first_step=st.integers(0, 300),
    new_loop_per_run=st.booleans(),
)
@example(  # NTimes while the end is unknown (fires after 128 steps), then known
    hook_specs=[[("n_times", 5)], [("exponential", 10, 1.2), ("first", 3, True)], [("at", [129])]],
    epoch_period=1,
    runs=[("epochs", 130, 2), ("steps", 40)],
    first_step=0,
    new_loop_per_run=False,
)
@example(  # the same inside a combination, in a one-epoch run whose end is known too late
    hook_specs=[[("n_times", 3), ("every", 50)], [("periodic", 3.5), ("at", [200])]],
    epoch_period=None,
    runs=[("steps", 30), ("epochs", 129, 1), ("steps", 0), ("epochs", 10, 2)],
    first_step=7,
    new_loop_per_run=True,
)
def test_the_loop_fires_where_asking_at_every_step_fires(
    compiled_trainer, hook_specs, epoch_period, runs, first_step, new_loop_per_run
):
    trainer = reset_trainer(compiled_trainer, first_step)
    expected = brute_force_firings(hook_specs, epoch_period, runs, first_step, new_loop_per_run)
    assert loop_firings(trainer, hook_specs, epoch_period, runs, new_loop_per_run) == expected
