"""`nan_guard`: poisoned batches skipped, rollbacks to real Orbax checkpoints, then the stop."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tiny import MODELS, tiny_trainer

import loopax
from loopax import hooks
from loopax.trainer._inflight import limit_for

BATCH_SIZE, FEATURES = MODELS["regression"].batch_size, MODELS["regression"].features


class PoisonedDataset:
    """Batches of a small regression task; the batches listed in `bad` hold NaN inputs.

    The batch index keeps counting after a rollback (the loop does not rewind the data), so
    the bad batches are not replayed.
    """

    name = "poisoned"

    def __init__(self, bad=()):
        rng = np.random.default_rng(0)
        self.inputs = rng.normal(size=(50 * BATCH_SIZE, FEATURES)).astype(np.float32)
        self.labels = self.inputs.sum(axis=1, keepdims=True)
        self.bad = bad
        self.index = 0

    def yield_batch(self):
        index, self.index = self.index, self.index + 1
        start = (index * BATCH_SIZE) % len(self.inputs)
        inputs = self.inputs[start : start + BATCH_SIZE].copy()
        if index in self.bad:
            inputs[:] = np.nan
        return None, [inputs], [self.labels[start : start + BATCH_SIZE]]

    def reset(self):
        pass

    def get_state(self):
        return {"index": self.index}

    def set_state(self, state):
        self.index = state["index"]


class From:
    """`index in From(20)`: every batch from 20 on."""

    def __init__(self, first):
        self.first = first

    def __contains__(self, index):
        return index >= self.first


def make_loop(tmp_path, devices=1, checkpoint=True, optimizer=None):
    loop = loopax.Loop(tiny_trainer(devices, optimizer=optimizer))
    if checkpoint:
        hooks.checkpoint(loop, tmp_path / "ckpt", every_n_steps=5)
    return loop


def finite(tree):
    return all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(tree))


@pytest.mark.parametrize("devices", [1, 4])
def test_isolated_bad_batches_are_skipped_and_counted(tmp_path, devices):
    loop = make_loop(tmp_path, devices)
    guard = hooks.nan_guard(loop, max_skips=3)
    hooks.metrics_log(loop, tmp_path / "log.jsonl", every_n_steps=1)
    loop.run_steps(PoisonedDataset(bad={3, 9, 40}), 60)
    assert guard.skipped_steps == [3, 9, 40] and guard.rollbacks == 0
    assert loop.trainer.global_step == 60 and finite(loop.trainer.params)
    counts = dict(loop.history["train/skipped_steps"])
    # Counted from the skipped step on (global step = loop step + 1), in every writer.
    assert [counts[step] for step in (3, 4, 9, 10, 40, 41, 60)] == [0, 1, 1, 2, 2, 3, 3]
    # The moving average of the loss never saw a NaN.
    assert all(np.isfinite(value) for _, value in loop.history["train/moving_average_loss"])


@pytest.mark.parametrize("devices", [1, 4])
def test_a_streak_rolls_back_to_the_newest_good_checkpoint_and_lowers_the_rate(tmp_path, devices):
    loop = make_loop(tmp_path, devices)
    guard = hooks.nan_guard(loop, max_skips=3, lr_factor=0.5)
    restored = []
    loop.on_restore("record", lambda loop, step: restored.append(step))
    hooks.metrics_log(loop, tmp_path / "log.jsonl", every_n_steps=1)
    loop.run_steps(PoisonedDataset(bad={20, 21, 22, 23}), 60)
    # Checkpoints every 5 steps: the newest one before the streak (loop steps 20-23) is 20.
    assert restored == [20] and guard.rolled_back_to == [20] and guard.rollbacks == 1
    assert loop.trainer.learning_rate == pytest.approx(0.005)
    assert loop.trainer.global_step == 60 and finite(loop.trainer.params)
    # The history was cut at the restored step and written again: one value per step.
    steps = [step for step, _ in loop.history["train/loss"]]
    assert steps == list(range(1, 61))
    assert finite([value for _, value in loop.history["train/loss"]])


def test_a_lasting_fault_stops_after_max_rollbacks(tmp_path):
    loop = make_loop(tmp_path)
    guard = hooks.nan_guard(loop, max_skips=3, max_rollbacks=2)
    with pytest.raises(
        loopax.NonFiniteLossError, match=r"after 2 rollback\(s\) \(max_rollbacks=2\)"
    ):
        loop.run_steps(PoisonedDataset(bad=From(20)), 200)
    assert guard.rollbacks == 2 and guard.rolled_back_to == [20, 20]
    assert loop.trainer.learning_rate == pytest.approx(0.0025)
    checkpointer = loop.shared_data["checkpointers"][0]
    checkpointer.wait()
    # Every checkpoint kept holds finite values: the skipped steps never changed the state.
    for step in checkpointer.all_steps():
        checkpointer.restore(step)
        assert finite(loop.trainer.state_dict())


def test_without_rollback_it_stops_after_max_skips(tmp_path):
    loop = make_loop(tmp_path, checkpoint=False)
    hooks.nan_guard(loop, max_skips=3, rollback=False)
    with pytest.raises(
        loopax.NonFiniteLossError,
        match=r"not finite for \d steps in a row "
        r"\(steps 10 to 1\d\).*rollback=False",
    ) as error:
        loop.run_steps(PoisonedDataset(bad={10, 11, 12, 13, 14}), 60)
    assert error.value.step == 10


@pytest.mark.parametrize(
    "devices, steps_per_execution, first_bad",
    [(1, 1, 5), (1, 1, 16), (4, 1, 5), (1, 4, 5)],  # 16: the streak straddles two windows
)
def test_without_rollback_the_stop_names_where_the_limit_passed_where_it_stopped_and_the_skips(
    tmp_path, devices, steps_per_execution, first_bad
):
    loop = loopax.Loop(tiny_trainer(devices), steps_per_execution=steps_per_execution)
    guard = hooks.nan_guard(loop, max_skips=2, rollback=False)
    with pytest.raises(loopax.NonFiniteLossError) as error:
        loop.run_steps(PoisonedDataset(bad=From(first_bad)), 400)
    limit_step = first_bad + 1  # the 2nd bad step in a row: where max_skips=2 was passed
    stop = loop.trainer.global_step - 1  # the newest step dispatched, and run
    # The loop hears of skips when it waits for its steps in flight: the stop comes at most
    # the in-flight bound of dispatches after the limit (the documented bound).
    assert limit_step <= stop <= limit_step + limit_for(loop.trainer.devices) * steps_per_execution
    assert error.value.step == first_bad
    message = str(error.value)
    assert f"not finite for 2 steps in a row (steps {first_bad} to {limit_step})" in message
    assert "rollback=False" in message
    assert f"stopped after step {stop} (global step {stop + 1})" in message
    assert f"{stop - limit_step} step(s) past step {limit_step}" in message
    skipped = stop - first_bad + 1  # every step from the first bad one on
    assert f"all {skipped} steps from step {first_bad} on were skipped" in message
    # The count the message gives is the trainer's own, and the guard's.
    assert int(jax.device_get(loop.metrics["skipped_steps"])) == skipped
    assert guard.skipped_steps == list(range(first_bad, stop + 1))


def test_without_rollback_a_streak_that_ended_stops_the_run_counting_its_skips(tmp_path):
    loop = make_loop(tmp_path, checkpoint=False)
    hooks.nan_guard(loop, max_skips=2, rollback=False)
    loop.run_steps(PoisonedDataset(bad={3, 9}), 20)  # one at a time: under max_skips, no stop
    assert loop.trainer.global_step == 20
    with pytest.raises(loopax.NonFiniteLossError) as error:
        loop.run_steps(PoisonedDataset(bad={10, 11}), 200)
    first = 30  # the second run's batch 10, after 20 global steps
    stop = loop.trainer.global_step - 1
    assert first + 1 <= stop < 219 and error.value.step == first
    message = str(error.value)
    assert f"(steps {first} to {first + 1})" in message
    assert (
        f"stopped after step {stop} (global step {stop + 1}), {stop - first - 1} step(s) past "
        f"step {first + 1}, and 2 of the {stop - first + 1} steps from step {first} on were "
        f"skipped, the last at step {first + 1}"
    ) in message
    assert int(jax.device_get(loop.metrics["skipped_steps"])) == 2  # this run's, as counted


def test_attached_alone_it_skips_and_stops_naming_the_missing_checkpoint_hook(tmp_path):
    loop = make_loop(tmp_path, checkpoint=False)
    guard = hooks.nan_guard(loop, max_skips=3)
    loop.run_steps(PoisonedDataset(bad={3, 4}), 8)  # two skips: no rollback is called for
    assert guard.skipped_steps == [3, 4] and loop.trainer.global_step == 8
    with pytest.raises(
        loopax.NonFiniteLossError,
        match=r"not finite for \d steps in a row \(steps 18 to.*no checkpoint to roll back "
        r"to: no "
        r"hooks.checkpoint is attached.*rollback=False",
    ) as error:
        loop.run_steps(PoisonedDataset(bad={10, 11, 12, 13}), 20)
    assert error.value.step == 18  # the second run's batch 10, after 8 global steps


def test_the_learning_rate_must_be_changeable_for_lr_factor(tmp_path):
    loop = make_loop(tmp_path, optimizer=optax.sgd(0.01))
    with pytest.raises(ValueError, match="keeps no learning rate in its state.*inject_hyperparams"):
        hooks.nan_guard(loop)
    hooks.nan_guard(loop, lr_factor=1.0)  # keeping the rate needs no injectable one


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"max_skips": 0}, "max_skips must be a positive int"),
        ({"max_rollbacks": -1}, "max_rollbacks must be a positive int"),
        ({"lr_factor": 2.0}, r"lr_factor must be a number in \(0, 1\]"),
        ({"lr_factor": 0}, r"lr_factor must be a number in \(0, 1\]"),
    ],
)
def test_bad_arguments_raise_at_registration(tmp_path, arguments, message):
    with pytest.raises(ValueError, match=message):
        hooks.nan_guard(make_loop(tmp_path, checkpoint=False), **arguments)


def test_the_rollback_count_survives_a_resume(tmp_path):
    loop = make_loop(tmp_path)
    hooks.nan_guard(loop, max_skips=3, max_rollbacks=3)
    loop.run_steps(PoisonedDataset(bad={20, 21, 22, 23}), 40)
    resumed = make_loop(tmp_path)  # a new process: the checkpoint of step 40 comes back
    guard = hooks.nan_guard(resumed, max_skips=3, max_rollbacks=3)
    assert resumed.trainer.global_step == 40 and guard.rollbacks == 1


# -- with a dynamic loss scale: overflow skips are routine, non-finite losses are not --------


@jax.custom_vjp
def overflow_gradient_if(x, flag):
    """Identity on `x`; its gradient is +inf wherever `flag` is set (a float16 overflow of the
    scaled gradient injected in the backward pass, the loss staying finite)."""
    return x


def _overflow_forward(x, flag):
    return x, flag


def _overflow_backward(flag, cotangent):
    blown = jnp.where(flag[:, None] > 0, jnp.asarray(jnp.inf, cotangent.dtype), cotangent)
    return blown, jnp.zeros_like(flag)


overflow_gradient_if.defvjp(_overflow_forward, _overflow_backward)


class OverflowingDataset(PoisonedDataset):
    """`PoisonedDataset` with a second input: the batches in `overflow` overflow the float16
    gradient; those in `bad` hold NaN inputs (a non-finite loss)."""

    name = "overflowing"

    def __init__(self, bad=(), overflow=()):
        super().__init__(bad)
        self.overflow = overflow
        # Small enough that no float16 gradient overflows but the injected ones.
        self.inputs, self.labels = self.inputs * 1e-2, self.labels * 1e-2

    def yield_batch(self):
        index = self.index
        spec, inputs, labels = super().yield_batch()
        flag = np.full((BATCH_SIZE,), 1.0 if index in self.overflow else 0.0, np.float32)
        return spec, [inputs[0], flag], labels


def make_dynamic_loop(tmp_path):
    def model_fn(ctx, spec, inputs):
        return nn.Dense(1)(overflow_gradient_if(nn.Dense(4)(inputs[0]), inputs[1]))

    trainer = loopax.Trainer(
        model_fn,
        loopax.losses.mean_squared_error,
        loopax.optimizers.sgd(0.01),
        devices=jax.devices()[:1],
        compute_dtype=jnp.float16,
        loss_scale="dynamic",
    )
    loop = loopax.Loop(trainer)
    hooks.checkpoint(loop, tmp_path / "ckpt", every_n_steps=5)
    hooks.metrics_log(loop, tmp_path / "log.jsonl", every_n_steps=1)
    return loop


def test_overflow_skips_of_a_dynamic_loss_scale_never_roll_back(tmp_path):
    loop = make_dynamic_loop(tmp_path)
    guard = hooks.nan_guard(loop, max_skips=2)
    # Four overflows in a row, as when training starts at a scale too high for the model.
    loop.run_steps(OverflowingDataset(overflow={6, 7, 8, 9}), 30)
    assert guard.rollbacks == 0 and guard.skipped_steps == []
    history = loop.history
    # Reported apart: skipped, and counted as overflows; the scale halved four times.
    assert dict(history["train/skipped_steps"])[30] == 4
    assert dict(history["train/overflow_steps"])[30] == 4
    assert [count for _, count in history["train/overflow_steps"]][5:11] == [0, 1, 2, 3, 4, 4]
    scales = dict(history["train/loss_scale"])
    assert scales[10] == scales[6] / 16
    assert loop.trainer.global_step == 30 and finite(loop.trainer.params)


def test_non_finite_losses_still_roll_back_under_a_dynamic_loss_scale(tmp_path):
    loop = make_dynamic_loop(tmp_path)
    guard = hooks.nan_guard(loop, max_skips=2, lr_factor=1.0)
    loop.run_steps(OverflowingDataset(bad={12, 13}, overflow={3, 4, 5}), 30)
    # The overflows (loop steps 3-5) are routine; the NaN batches (12, 13) are a streak.
    assert guard.skipped_steps == [12, 13] and guard.rolled_back_to == [10]
    assert dict(loop.history["train/overflow_steps"])[30] == 3
    assert loop.trainer.global_step == 30 and finite(loop.trainer.params)


def test_a_gradient_still_not_finite_at_the_smallest_scale_is_not_an_overflow(tmp_path):
    loop = make_dynamic_loop(tmp_path)
    guard = hooks.nan_guard(loop, max_skips=3, max_rollbacks=1, lr_factor=1.0)
    # The gradient overflows at every scale: 15 halvings reach the smallest scale (1),
    # where the skips count as non-finite, and their streak rolls back, then stops.
    with pytest.raises(loopax.NonFiniteLossError, match=r"after 1 rollback\(s\)"):
        loop.run_steps(OverflowingDataset(overflow=From(2)), 80)
    assert guard.rollbacks == 1
    # Loop steps 2-16 overflowed at the scales 2**15 down to 2; from 17 on, at 1, they count.
    assert guard.skipped_steps[:3] == [17, 18, 19]
    assert dict(loop.history["train/overflow_steps"])[15] == 13


# -- a learning rate that is not finite ------------------------------------------------------


@pytest.mark.parametrize("rollback", [False, True])
def test_a_non_finite_learning_rate_is_named_first_with_the_one_fix_that_applies(
    tmp_path, rollback
):
    # The rate set to NaN after the checkpoint of step 5: the update of loop step 6 makes the
    # parameters NaN, and every step from 7 on is skipped. Neither a rollback (it would go on
    # with the same rate, times lr_factor) nor a lower rate can help: nan_guard says so.
    loop = make_loop(tmp_path, checkpoint=rollback, optimizer=loopax.optimizers.adam(0.01))
    guard = hooks.nan_guard(loop, max_skips=2, rollback=rollback)

    def poison_the_rate(loop, metrics):
        if loop.trainer.global_step == 6:
            loop.trainer.set_learning_rate(float("nan"))

    loop.on_step("poison the rate", poison_the_rate)
    with pytest.raises(loopax.NonFiniteLossError) as raised:
        loop.run_steps(PoisonedDataset(), 30)
    message = str(raised.value)
    assert message.startswith(
        "the learning rate is nan at step 6 (global step 7): the optimizer's learning rate is "
        "nan (a value set with set_learning_rate, or injected so)"
    ), message
    assert "Set a finite learning rate" in message and "steps 7 to" in message
    assert "Lower the learning rate" not in message and "check the data" not in message
    assert guard.rollbacks == 0 and guard.skipped_steps[0] == 7
