"""The Loop: runs, hooks and their order, errors, stopping, timing and non-finite losses."""

import jax
import numpy as np
import pytest
from _tiny import MODELS, compiled, restart, tiny_trainer

import loopax
from loopax import Priority

BATCH_SIZE = MODELS["regression"].batch_size


def make_dataset(batches, *, loop_forever=True, label=1.0, name="train"):
    size = batches * BATCH_SIZE
    return loopax.ArrayDataset(
        np.ones((size, 3), np.float32),
        np.full((size, 1), label, np.float32),
        batch_size=BATCH_SIZE,
        loop_forever=loop_forever,
        name=name,
    )


class CountingDataset:
    """Wraps a dataset and counts reset() calls and batches, to check when the Loop resets."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.name = dataset.name
        self.resets = 0
        self.batches = 0

    def yield_batch(self):
        batch = self.dataset.yield_batch()
        self.batches += 1
        return batch

    def reset(self):
        self.resets += 1
        self.dataset.reset()


@pytest.fixture(scope="module")
def compiled_trainer():
    # One trainer for the module: compiling costs about a second, a step much less.
    return compiled(tiny_trainer(), make_dataset(1))


@pytest.fixture
def trainer(compiled_trainer):
    return restart(*compiled_trainer)


@pytest.fixture
def loop(trainer):
    return loopax.Loop(trainer)


class Recorder:
    """Hooks that record (phase, name, loop_step, end_step, epoch)."""

    def __init__(self, loop):
        self.loop = loop
        self.calls = []

    def hook(self, phase, name="record"):
        def record(loop, argument):
            self.calls.append((phase, name, loop.loop_step, loop.end_step, loop.epoch))

        return record

    def attach_all(self):
        self.loop.on_start("start", self.hook("OnStart"))
        self.loop.on_step("step", self.hook("OnStep"))
        self.loop.on_end("end", self.hook("OnEnd"))
        return self

    def phases(self):
        return [call[0] for call in self.calls]

    def steps(self, phase="OnStep"):
        return [call[2] for call in self.calls if call[0] == phase]


# -- run_steps ------------------------------------------------------------------------------


def test_run_steps_zero_returns_at_once_without_hooks(loop):
    recorder = Recorder(loop).attach_all()
    assert loop.run_steps(make_dataset(1, loop_forever=False), 0) == {}
    assert recorder.calls == []
    assert loop.trainer.global_step == 0


def test_run_steps_hook_order_and_steps(loop):
    recorder = Recorder(loop).attach_all()
    start_arguments, end_arguments = [], []
    loop.on_start("dataset", lambda loop, dataset: start_arguments.append(dataset))
    loop.on_end("metrics", lambda loop, metrics: end_arguments.append(metrics))
    step_metrics = []
    loop.on_step("metrics", lambda loop, metrics: step_metrics.append(metrics))
    dataset = make_dataset(2)
    result = loop.run_steps(dataset, 3)
    assert recorder.phases() == ["OnStart", "OnStep", "OnStep", "OnStep", "OnEnd"]
    assert recorder.calls[0] == ("OnStart", "record", 0, 3, 0)
    assert recorder.steps() == [0, 1, 2]
    assert recorder.steps("OnEnd") == [3]
    assert loop.loop_step == loop.end_step == 3 and loop.start_step == 0
    assert loop.trainer.global_step == 3
    assert start_arguments == [dataset]
    assert result is end_arguments[0] is step_metrics[-1]
    assert list(result) == ["loss", "moving_average_loss"]


def test_global_step_inside_on_step_is_loop_step_plus_one(loop):
    seen = []
    loop.on_step(
        "global", lambda loop, metrics: seen.append((loop.loop_step, loop.trainer.global_step))
    )
    loop.run_steps(make_dataset(1), 3)
    assert seen == [(0, 1), (1, 2), (2, 3)]


def test_second_run_steps_continues_from_the_current_step(loop):
    recorder = Recorder(loop).attach_all()
    dataset = make_dataset(2)
    loop.run_steps(dataset, 2)
    recorder.calls.clear()
    loop.run_steps(dataset, 3)
    assert recorder.calls[0] == ("OnStart", "record", 2, 5, 0)
    assert recorder.steps() == [2, 3, 4]
    assert loop.start_step == 2 and loop.loop_step == loop.end_step == 5
    assert loop.trainer.global_step == 5


def test_a_new_loop_starts_at_the_trainer_global_step(loop):
    loop.run_steps(make_dataset(1), 4)
    fresh = loopax.Loop(loop.trainer)
    assert fresh.loop_step == 4
    recorder = Recorder(fresh).attach_all()
    fresh.run_steps(make_dataset(1), 1)
    assert recorder.steps() == [4] and fresh.start_step == 4


def test_run_steps_resets_train_metrics_at_its_start(loop):
    first_metrics = []
    loop.on_step(
        "first",
        lambda loop, metrics: (
            first_metrics.append(metrics) if loop.loop_step == loop.start_step else None
        ),
    )
    loop.run_steps(make_dataset(1), 3)
    loop.run_steps(make_dataset(1, label=50.0), 2)  # another loss: a carried average would lag
    values = jax.device_get(first_metrics[-1])
    assert values["moving_average_loss"] == pytest.approx(values["loss"], rel=1e-6)


def test_dataset_ending_early_raises_and_skips_on_end(loop):
    recorder = Recorder(loop).attach_all()
    with pytest.raises(RuntimeError, match=r"after 2 of 5 steps") as info:
        loop.run_steps(make_dataset(2, loop_forever=False, name="short"), 5)
    message = str(info.value)
    assert "'short'" in message and "run_epochs" in message
    assert recorder.phases() == ["OnStart", "OnStep", "OnStep"]
    assert loop.trainer.global_step == 2


def test_a_dataset_that_raises_stops_the_run_naming_it(loop):
    def broken():
        yield make_dataset(1).yield_batch()[1:]
        raise OSError("read failed")

    with pytest.raises(RuntimeError, match="'flaky'") as info:
        loop.run_steps(loopax.IterableDataset(broken, name="flaky"), 3)
    assert "read failed" in str(info.value) and "step 1" in str(info.value)
    assert isinstance(info.value.__cause__, OSError)


@pytest.mark.parametrize("steps", [-1, 1.5, "3", True])
def test_run_steps_rejects_bad_step_counts(loop, steps):
    with pytest.raises(ValueError, match="steps"):
        loop.run_steps(make_dataset(1), steps)


def test_run_steps_accepts_numpy_ints(loop):
    loop.run_steps(make_dataset(1), np.int64(2))
    assert loop.trainer.global_step == 2


def test_loop_needs_a_trainer():
    with pytest.raises(TypeError, match="Trainer"):
        loopax.Loop(object())


# -- run_to_step ----------------------------------------------------------------------------


def test_run_to_step_runs_only_the_remaining_steps(loop):
    dataset = make_dataset(1)
    loop.run_steps(dataset, 3)
    recorder = Recorder(loop).attach_all()
    loop.run_to_step(dataset, 5)
    assert recorder.steps() == [3, 4]
    assert loop.trainer.global_step == 5 and loop.loop_step == 5
    recorder.calls.clear()
    assert loop.run_to_step(dataset, 5) == {}
    with pytest.warns(RuntimeWarning, match=r"already at global step 5, past the target"):
        assert loop.run_to_step(dataset, 2) == {}
    with pytest.raises(ValueError, match=r"global_step must be an int >= 0, got global_step=-5"):
        loop.run_to_step(dataset, -5)
    assert recorder.calls == []
    assert loop.trainer.global_step == 5 and loop.loop_step == 5


# -- run_epochs -----------------------------------------------------------------------------


def test_run_epochs_resets_after_each_epoch_not_before_the_first(loop):
    recorder = Recorder(loop).attach_all()
    dataset = CountingDataset(make_dataset(3, loop_forever=False))
    resets_seen = []
    loop.on_start("resets", lambda loop, ds: resets_seen.append(("OnStart", dataset.resets)))
    loop.on_step("resets", lambda loop, m: resets_seen.append((loop.loop_step, dataset.resets)))
    loop.run_epochs(dataset, 2)
    assert resets_seen == [("OnStart", 0), (0, 0), (1, 0), (2, 0), (3, 1), (4, 1), (5, 1)]
    assert dataset.resets == 2  # the last epoch is followed by a reset too
    assert dataset.batches == 6
    steps = [
        (step, end_step, epoch)
        for phase, _, step, end_step, epoch in recorder.calls
        if phase == "OnStep"
    ]
    # end_step is unknown (-1) in the first epoch, then loop_step + batches * epochs left.
    assert steps == [(0, -1, 0), (1, -1, 0), (2, -1, 0), (3, 6, 1), (4, 6, 1), (5, 6, 1)]
    assert recorder.calls[0] == ("OnStart", "record", 0, -1, 0)
    assert recorder.calls[-1] == ("OnEnd", "record", 6, 6, 2)
    assert loop.loop_step == loop.end_step == 6 and loop.epoch == 2


def test_run_epochs_extrapolates_end_step_from_the_first_epoch(loop):
    end_steps = []
    loop.on_step("end", lambda loop, m: end_steps.append(loop.end_step))
    loop.run_steps(make_dataset(1), 1)  # a run_epochs later starts at step 1
    loop.run_epochs(make_dataset(2, loop_forever=False), 3)
    assert end_steps[1:] == [-1, -1, 7, 7, 7, 7]
    assert loop.start_step == 1 and loop.loop_step == 7


def test_run_epochs_first_epoch_starts_where_the_dataset_is(loop):
    dataset = CountingDataset(make_dataset(3, loop_forever=False))
    dataset.yield_batch()  # one batch already consumed: the first epoch has 2 left
    loop.run_epochs(dataset, 1)
    assert loop.trainer.global_step == 2
    assert dataset.resets == 1


def test_run_epochs_zero_runs_on_start_and_on_end_with_no_metrics(loop):
    recorder = Recorder(loop).attach_all()
    end_metrics = []
    loop.on_end("metrics", lambda loop, metrics: end_metrics.append(metrics))
    dataset = CountingDataset(make_dataset(1, loop_forever=False))
    assert loop.run_epochs(dataset, 0) == {}
    assert recorder.phases() == ["OnStart", "OnEnd"]
    assert end_metrics == [{}]
    assert dataset.batches == 0 and dataset.resets == 0
    assert loop.trainer.global_step == 0


def test_run_epochs_resets_train_metrics_and_continues_with_a_second_call(loop):
    dataset = make_dataset(2, loop_forever=False)
    loop.run_epochs(dataset, 1)
    loop.run_epochs(dataset, 2)
    assert loop.trainer.global_step == 6 and loop.epoch == 2


def test_run_epochs_with_an_empty_epoch_raises(loop):
    empty = loopax.IterableDataset(lambda: iter([]), name="nothing")
    with pytest.raises(ValueError, match="nothing"):
        loop.run_epochs(empty, 1)


@pytest.mark.parametrize("epochs", [-1, 2.0])
def test_run_epochs_rejects_bad_epoch_counts(loop, epochs):
    with pytest.raises(ValueError, match="epochs"):
        loop.run_epochs(make_dataset(1, loop_forever=False), epochs)


# -- request_stop ---------------------------------------------------------------------------


def test_request_stop_ends_after_the_current_step_hooks(loop):
    recorder = Recorder(loop)
    loop.on_step(
        "stopper", lambda loop, m: loop.request_stop("enough") if loop.loop_step == 2 else None
    )
    loop.on_step("after", recorder.hook("OnStep", "after"))
    loop.on_end("end", recorder.hook("OnEnd", "end"))
    loop.run_steps(make_dataset(1), 10)
    assert recorder.steps() == [0, 1, 2]  # the other hooks of step 2 still ran
    assert recorder.steps("OnEnd") == [3]
    assert loop.stop_reason == "enough"
    assert loop.trainer.global_step == 3
    # The next run starts afresh.
    loop.run_steps(make_dataset(1), 2)
    assert loop.stop_reason is None
    assert loop.trainer.global_step == 5


def test_request_stop_in_run_epochs(loop):
    recorder = Recorder(loop).attach_all()
    loop.on_step(
        "stopper",
        lambda loop, m: loop.request_stop("early stopping") if loop.loop_step == 3 else None,
    )
    loop.run_epochs(make_dataset(2, loop_forever=False), 5)
    assert recorder.steps() == [0, 1, 2, 3]
    assert recorder.phases()[-1] == "OnEnd"
    assert loop.stop_reason == "early stopping"


@pytest.mark.parametrize("run", ["run_steps", "run_epochs"])
def test_request_stop_in_on_start_runs_no_step(loop, run):
    recorder = Recorder(loop).attach_all()
    loop.on_start("stopper", lambda loop, ds: loop.request_stop("not needed"))
    dataset = CountingDataset(make_dataset(1, loop_forever=run == "run_steps"))
    assert getattr(loop, run)(dataset, 3) == {}
    assert recorder.phases() == ["OnStart", "OnEnd"]
    assert dataset.batches == 0
    assert loop.trainer.global_step == 0 and loop.loop_step == 0
    assert loop.stop_reason == "not needed"


# -- hook priorities and errors -------------------------------------------------------------


def test_hooks_run_in_ascending_priority_ties_in_registration_order(loop):
    order = []
    registrations = [
        ("ui", Priority.UI),
        ("default-1", Priority.DEFAULT),
        ("validate", Priority.VALIDATE),
        ("default-2", 0),
        ("checkpoint", Priority.CHECKPOINT),
        ("just-after-default", 1),
        ("log", Priority.LOG),
        ("evaluate", Priority.EVALUATE),
        ("default-3", Priority.DEFAULT),
    ]
    for name, priority in registrations:
        loop.on_step(name, lambda loop, m, name=name: order.append(name), priority=priority)
        loop.on_start(name, lambda loop, ds, name=name: order.append(name), priority=priority)
        loop.on_end(name, lambda loop, m, name=name: order.append(name), priority=priority)
    expected = [
        "validate",
        "evaluate",
        "default-1",
        "default-2",
        "default-3",
        "just-after-default",
        "checkpoint",
        "log",
        "ui",
    ]
    assert [name for _, name in loop.hooks("OnStep")] == expected
    loop.run_steps(make_dataset(1), 1)
    assert order == expected * 3
    assert Priority.VALIDATE < Priority.EVALUATE < Priority.DEFAULT == 0
    assert Priority.DEFAULT < Priority.CHECKPOINT < Priority.LOG < Priority.UI


def test_bad_hook_registrations_raise(loop):
    with pytest.raises(ValueError):
        loop.on_step("", lambda loop, m: None)
    with pytest.raises(TypeError):
        loop.on_step("not callable", None)
    with pytest.raises(TypeError):
        loop.on_step("float priority", lambda loop, m: None, priority=1.5)


@pytest.mark.parametrize("phase", ["OnStart", "OnStep", "OnEnd"])
def test_a_failing_hook_raises_hook_error_naming_phase_hook_and_step(loop, phase):
    original = KeyError("missing")
    after = []

    def failing(loop, argument):
        if phase != "OnStep" or loop.loop_step == 1:
            raise original

    register = {"OnStart": loop.on_start, "OnStep": loop.on_step, "OnEnd": loop.on_end}[phase]
    register("exploder", failing)
    register("after", lambda loop, argument: after.append(loop.loop_step))
    with pytest.raises(loopax.HookError) as info:
        loop.run_steps(make_dataset(1), 3)
    error = info.value
    step = {"OnStart": 0, "OnStep": 1, "OnEnd": 3}[phase]
    message = str(error)
    assert phase in message and "exploder" in message and f"step {step}" in message
    assert error.__cause__ is original
    assert (error.phase, error.hook_name, error.step) == (phase, "exploder", step)
    assert after == ([0] if phase == "OnStep" else [])  # the rest of that phase is skipped
    assert isinstance(error, RuntimeError)


@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_a_hook_error_names_the_global_step_the_hook_saw_beside_the_loop_step(
    trainer, steps_per_execution
):
    loop = loopax.Loop(trainer, steps_per_execution=steps_per_execution)

    def fails_at_global_step_8(loop, metrics):
        if loop.trainer.global_step == 8:
            raise ValueError("checked at global step 8")

    loop.on_step("check", fails_at_global_step_8, when=loopax.hooks.EveryNSteps(4))
    with pytest.raises(loopax.HookError) as info:
        loop.run_steps(make_dataset(1), 12)
    # The hook ran after loop step 7, which made the global step 8: both are named.
    assert str(info.value).startswith(
        "OnStep hook 'check' failed at step 7 (global step 8): ValueError: checked at"
    )
    assert (info.value.step, info.value.global_step) == (7, 8)
    # At the end of a run the loop step is the global step: one number.
    loop = loopax.Loop(trainer)
    loop.on_end("at the end", lambda loop, metrics: 1 / 0)
    with pytest.raises(loopax.HookError) as info:
        loop.run_steps(make_dataset(1), 2)
    assert str(info.value).startswith("OnEnd hook 'at the end' failed at step 10: Zero")
    assert (info.value.step, info.value.global_step) == (10, 10)


# -- step durations -------------------------------------------------------------------------


def test_median_train_step_duration(loop):
    assert loop.median_train_step_duration() == 1e-3
    loop.run_steps(make_dataset(1), 5)
    durations = list(loop.train_step_durations)
    assert len(durations) == 5 and all(d > 0 for d in durations)
    assert loop.median_train_step_duration() == sorted(durations)[len(durations) // 2]


def test_step_durations_stay_bounded_on_long_runs(loop):
    loop.run_steps(make_dataset(4), 1100)
    assert len(loop.train_step_durations) == 1024
    assert loop.median_train_step_duration() == sorted(loop.train_step_durations)[512]
    assert loop.trainer.global_step == 1100


# -- non-finite loss ------------------------------------------------------------------------


def nan_at(step, steps):
    """A dataset whose labels are NaN from `step` on (so the loss is NaN there)."""

    def batches():
        for index in range(steps):
            _, inputs, labels = make_dataset(1).yield_batch()
            if index >= step:
                labels = [np.full_like(labels[0], np.nan)]
            yield inputs, labels

    return loopax.IterableDataset(batches, name="nan")


def test_non_finite_loss_stops_before_checkpoint_priority_hooks(loop):
    calls = []
    for name, priority in [
        ("default", Priority.DEFAULT),
        ("below", Priority.CHECKPOINT - 1),
        ("checkpoint", Priority.CHECKPOINT),
        ("ui", Priority.UI),
    ]:
        loop.on_step(
            name, lambda loop, m, name=name: calls.append((name, loop.loop_step)), priority=priority
        )
    ended = []
    loop.on_end("save", lambda loop, m: ended.append(loop.loop_step), priority=Priority.CHECKPOINT)
    with pytest.raises(loopax.NonFiniteLossError, match="step 2"):
        loop.run_steps(nan_at(2, 5), 5)
    at_step_2 = [name for name, step in calls if step == 2]
    assert at_step_2 == ["default", "below"]
    assert [name for name, step in calls if step == 1] == ["default", "below", "checkpoint", "ui"]
    assert ended == []


def test_non_finite_loss_at_the_last_step_stops_before_on_end_checkpoints(loop):
    ended = []
    loop.on_end("save", lambda loop, m: ended.append(loop.loop_step), priority=Priority.CHECKPOINT)
    with pytest.raises(loopax.NonFiniteLossError, match="step 2"):
        loop.run_steps(nan_at(2, 3), 3)
    assert ended == []


def test_hooks_registered_without_the_check_are_not_preceded_by_it(loop):
    calls = []

    def lazy_checkpoint(loop, metrics):
        calls.append(("lazy", loop.loop_step))

    loop.on_step("lazy", lazy_checkpoint, priority=Priority.CHECKPOINT, check_finite=False)
    loop.on_step(
        "ui",
        lambda loop, m: calls.append(("ui", loop.loop_step)),
        priority=Priority.UI,
        check_finite=False,
    )
    with pytest.raises(loopax.NonFiniteLossError, match="step 1"):
        loop.run_steps(nan_at(1, 3), 3)
    # They ran at every step; the run still stopped before OnEnd, naming the first bad step.
    assert calls == [("lazy", 0), ("ui", 0), ("lazy", 1), ("ui", 1), ("lazy", 2), ("ui", 2)]


def test_a_default_band_hook_can_ask_for_the_check(loop):
    calls = []
    loop.on_step("careful", lambda loop, m: calls.append(loop.loop_step), check_finite=True)
    with pytest.raises(loopax.NonFiniteLossError, match="step 1"):
        loop.run_steps(nan_at(1, 3), 3)
    assert calls == [0]


def test_a_hook_raising_non_finite_loss_error_is_not_wrapped(loop):
    def lazy_check(loop, metrics):
        if loop.loop_step == 1:
            raise loopax.NonFiniteLossError("found by the hook at step 1")

    loop.on_step("lazy", lazy_check, priority=Priority.CHECKPOINT, check_finite=False)
    with pytest.raises(loopax.NonFiniteLossError, match="step 1"):
        loop.run_steps(make_dataset(1), 3)


def test_non_finite_loss_stops_a_run_without_any_hook_naming_the_first_bad_step(loop):
    # The losses are read when the loop waits for its steps in flight: no sync per step.
    with pytest.raises(loopax.NonFiniteLossError, match=r"at step 4 \(global step 5\)") as error:
        loop.run_steps(nan_at(4, 80), 80)
    assert error.value.step == 4
    assert loop.trainer.global_step <= 4 + 33  # within one in-flight window of it


def test_a_short_run_is_checked_at_its_end(loop):
    with pytest.raises(loopax.NonFiniteLossError, match="step 1"):
        loop.run_steps(nan_at(1, 3), 3)


def test_check_finite_is_public_and_names_the_first_bad_step(loop):
    errors = []

    def probe(loop, metrics):
        if loop.loop_step == 6:
            try:
                loop.check_finite()
            except loopax.NonFiniteLossError as err:
                errors.append(err.step)
                loop.request_stop("found")

    loop.on_step("probe", probe)
    with pytest.raises(loopax.NonFiniteLossError):
        loop.run_steps(nan_at(3, 10), 10)
    assert errors == [3]


def test_infinite_loss_is_caught_too(loop):
    loop.on_step("checkpoint", lambda loop, m: None, priority=Priority.CHECKPOINT)

    def batches():
        _, inputs, labels = make_dataset(1).yield_batch()
        yield inputs, [np.full_like(labels[0], np.inf)]

    with pytest.raises(loopax.NonFiniteLossError, match="step 0"):
        loop.run_steps(loopax.IterableDataset(batches, name="inf"), 1)


# -- shared data ----------------------------------------------------------------------------


def test_shared_data_is_a_dict_hooks_share(loop):
    loop.on_step("writer", lambda loop, m: loop.shared_data.__setitem__("last", loop.loop_step))
    read = []
    loop.on_end("reader", lambda loop, m: read.append(loop.shared_data["last"]))
    loop.run_steps(make_dataset(1), 2)
    assert read == [1]
