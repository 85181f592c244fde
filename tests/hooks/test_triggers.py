"""The trigger helpers through a real `loopax.Loop` and `loopax.Trainer`."""

import json

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import loopax
from loopax import hooks
from loopax.hooks import (
    every_n_steps,
    exponential_callback,
    n_times_during_loop,
    periodic_callback,
)

BATCH_SIZE = 8


def model_fn(ctx, spec, inputs):
    return nn.Dense(1)(inputs[0])


def loss_fn(labels, predictions):
    return ((labels[0] - predictions[0]) ** 2).mean()


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
    trainer = loopax.Trainer(model_fn, loss_fn, optax.sgd(0.01))
    loopax.Loop(trainer).run_steps(make_dataset(8), 1)
    # A host copy: the step donates the device buffers of the state it is given.
    return trainer, jax.device_get(trainer.state)


@pytest.fixture
def trainer(compiled_trainer):
    trainer, initial_state = compiled_trainer
    fresh_state = jax.tree.map(np.array, initial_state)
    trainer.state = fresh_state.replace(step=np.zeros_like(fresh_state.step))
    assert trainer.global_step == 0
    return trainer


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
        hooks.EveryNSteps, hooks.NTimes, hooks.Periodic, hooks.Exponential]
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
        (0, "plain"), (0, "ckpt"), (0, "ui"),
        (1, "eval"), (1, "plain"), (1, "ckpt"), (1, "ui"),
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
