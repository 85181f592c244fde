"""A non-finite loss names what is wrong with its step's batch before blaming the rate.

The loop keeps the batches of the steps in flight; when it finds the first non-finite loss it
reads that step's batch on the host and names NaN or infinite inputs and labels and class ids
outside the model's output width (which input or label, how many values, the first's example),
with fused steps and on-device data too. A batch with none of them gets the learning-rate
advice alone: the data is not accused.
"""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import loopax

ONE_DEVICE = jax.devices()[:1]
BATCH_SIZE = 8
BATCHES = 24
CLASSES = 5
FEATURES = 4


def classifier(ctx, spec, inputs):
    return nn.Dense(CLASSES)(nn.relu(nn.Dense(16)(inputs[0])))


def regressor(ctx, spec, inputs):
    return nn.Dense(1)(nn.relu(nn.Dense(16)(inputs[0])))


def features():
    return np.random.default_rng(0).normal(size=(BATCHES * BATCH_SIZE, FEATURES)).astype(np.float32)


def classes(inputs):
    return (np.abs(inputs[:, 0]) * 3).astype(np.int32) % CLASSES


def sums(inputs):
    return inputs[:, :2].sum(axis=1, keepdims=True)


def classification(devices=ONE_DEVICE, optimizer=None, **kwargs):
    return loopax.Trainer(
        classifier,
        loopax.losses.sparse_categorical_crossentropy_logits,
        optimizer or optax.adam(0.01),
        devices=devices,
        **kwargs,
    )


def regression(optimizer=None, **kwargs):
    kwargs.setdefault("devices", ONE_DEVICE)
    return loopax.Trainer(
        regressor, loopax.losses.mean_squared_error, optimizer or optax.adam(0.01), **kwargs
    )


def in_order(inputs, labels, **kwargs):
    return loopax.ArrayDataset(
        inputs, labels, BATCH_SIZE, shuffle=False, loop_forever=True, name="train", **kwargs
    )


def failure(trainer, data, k, steps=BATCHES):
    loop = loopax.Loop(trainer, steps_per_execution=k)
    with pytest.raises(loopax.NonFiniteLossError) as raised:
        loop.run_steps(data, steps)
    return raised.value


@pytest.mark.parametrize("k", [1, 8])
def test_a_class_id_out_of_range_is_named(k):
    inputs = features()
    labels = classes(inputs)
    labels[13 * BATCH_SIZE + 3] = CLASSES + 2  # step 13, example 3: inside a group of 8
    error = failure(classification(), in_order(inputs, labels), k)
    assert error.step == 13
    message = str(error)
    assert "the loss is nan at step 13 (global step 14)" in message
    assert (
        f"Its batch holds bad values, check the data: labels[0] holds 1 class id outside "
        f"[0, {CLASSES}), the model's {CLASSES} outputs (e.g. {CLASSES + 2} in example 3 of the "
        "batch). If the data is right, lower the learning rate" in message
    )


def test_negative_class_ids_are_named_on_four_devices():
    # Four devices: each compiled step sees a quarter of the batch; the class axis is the same.
    inputs = features()
    labels = classes(inputs)
    labels[5 * BATCH_SIZE + 6] = -1
    labels[5 * BATCH_SIZE + 7] = -3
    error = failure(classification(devices=jax.devices()[:4]), in_order(inputs, labels), 1)
    assert error.step == 5
    assert (
        f"labels[0] holds 2 class ids outside [0, {CLASSES}), the model's {CLASSES} outputs "
        "(e.g. -1 in example 6 of the batch)" in str(error)
    )


@pytest.mark.parametrize("k", [1, 8])
def test_a_nan_input_is_named(k):
    inputs = features()
    labels = sums(inputs)
    inputs[11 * BATCH_SIZE + 5, 1:3] = np.nan
    error = failure(regression(), in_order(inputs, labels), k)
    assert error.step == 11
    assert (
        "Its batch holds bad values, check the data: inputs[0] holds 2 NaN values (the first in "
        "example 5 of the batch). If the data is right" in str(error)
    )


@pytest.mark.parametrize("k", [1, 8])
def test_an_infinite_label_is_named(k):
    inputs = features()
    labels = sums(inputs)
    labels[9 * BATCH_SIZE + 2] = -np.inf
    error = failure(regression(), in_order(inputs, labels), k)
    assert error.step == 9
    assert (
        "Its batch holds bad values, check the data: labels[0] holds 1 infinite value (the first "
        "in example 2 of the batch)" in str(error)
    )


def test_every_bad_array_is_named():
    inputs = features()
    labels = classes(inputs)
    inputs[4 * BATCH_SIZE + 1, 0] = np.inf
    inputs[4 * BATCH_SIZE + 2, :] = np.nan
    labels[4 * BATCH_SIZE + 7] = CLASSES
    error = failure(classification(), in_order(inputs, labels), 1)
    assert error.step == 4
    assert (
        "inputs[0] holds 4 NaN and 1 infinite values (the first in example 1 of the batch); "
        f"labels[0] holds 1 class id outside [0, {CLASSES})" in str(error)
    )


@pytest.mark.parametrize("k", [1, 8])
def test_a_huge_learning_rate_with_sound_data_gets_the_rate_advice_alone(k):
    inputs = features()
    error = failure(regression(optax.sgd(1e6)), in_order(inputs, sums(inputs)), k)
    message = str(error)
    assert (
        "Its batch holds no NaN or infinite value: lower the learning rate, clip gradients "
        "(loopax.optimizers.adam(..., clip_global_norm=1.0)), or attach hooks.nan_guard" in message
    )
    assert "check the data" not in message and "bad values" not in message


def test_sound_class_ids_are_said_to_be_in_range():
    # A loss that overflows on sound data: the class ids are checked and found in range.
    def overflowing(labels, predictions):
        loss = loopax.losses.sparse_categorical_crossentropy_logits(labels, predictions)
        return loss * 1e38 * 1e38

    inputs = features()
    trainer = loopax.Trainer(classifier, overflowing, optax.adam(0.01), devices=ONE_DEVICE)
    error = failure(trainer, in_order(inputs, classes(inputs)), 1)
    assert error.step == 0
    assert (
        f"Its batch holds no NaN or infinite value and no class id outside [0, {CLASSES}): "
        "lower the learning rate" in str(error)
    )


@pytest.mark.parametrize("k", [1, 8])
def test_on_device_data_is_checked(k):
    # Shuffled on the devices. Fused (k=8), the steps take their batches from the devices'
    # arrays themselves: the batch is taken again from where it lies, and the message names
    # the example's index in the dataset, through the epoch's permutation.
    inputs = features()
    labels = sums(inputs)
    inputs[42, 2] = np.nan
    data = loopax.ArrayDataset(
        inputs, labels, BATCH_SIZE, seed=3, loop_forever=True, on_device=True, devices=ONE_DEVICE
    )
    message = str(failure(regression(), data, k))
    assert "Its batch holds bad values, check the data: inputs[0] holds 1 NaN value" in message
    if k > 1:
        assert "of the batch (example 42 of the dataset))" in message


def test_accumulated_micro_batches_are_named():
    inputs = features()
    labels = sums(inputs)
    # Two micro-batches a step: step 3 reads batches 6 and 7; the NaN is batch 7's example 4.
    inputs[7 * BATCH_SIZE + 4, 0] = np.nan
    error = failure(regression(accumulate_steps=2), in_order(inputs, labels), 4, BATCHES // 2)
    assert error.step == 3
    assert "inputs[0] holds 1 NaN value (the first in example 4 of micro-batch 1)" in str(error)


def test_a_batch_that_cannot_be_read_back_is_said_to_be_unchecked():
    # The dataset hands out device arrays and deletes each once its step ran: by the time
    # the loss is checked, its batch is gone. The error still names the step and says so.
    inputs = features()
    labels = sums(inputs)
    inputs[3 * BATCH_SIZE] = np.nan
    handed_out = []

    class Deleting:
        name = "deleting"

        def __init__(self):
            self.batch = 0

        def yield_batch(self):
            part = slice(self.batch * BATCH_SIZE, (self.batch + 1) * BATCH_SIZE)
            self.batch += 1
            batch = [jax.device_put(inputs[part])], [jax.device_put(labels[part])]
            handed_out.append(batch)
            return None, *batch

    loop = loopax.Loop(regression())
    loop.on_step("delete", lambda loop, metrics: [a.delete() for a in handed_out.pop()[0]])
    with pytest.raises(loopax.NonFiniteLossError) as raised:
        loop.run_steps(Deleting(), 10)
    assert raised.value.step == 3
    message = str(raised.value)
    assert "Its batch was not checked (RuntimeError: " in message
    assert "deleted" in message
    assert "check the data, or attach hooks.nan_guard" in message


@pytest.mark.cpu_devices
def test_exec_info_reports_the_predictions_shapes():
    infos = []
    trainer = classification(devices=jax.devices()[:4])
    trainer.on_exec_creation(infos.append)
    inputs = features()
    loopax.Loop(trainer).run_steps(in_order(inputs, classes(inputs)), 1)
    trainer.predict(inputs[:8])
    shapes = {info.graph_type: info.prediction_shapes for info in infos}
    # One device's share of the batch of 8, and the classes; prediction has no loss.
    assert shapes == {"train": ((BATCH_SIZE // 4, CLASSES),), "predict": ()}


@pytest.mark.parametrize("k", [1, 8])
def test_batches_over_the_held_budget_are_not_kept_and_the_error_says_so(monkeypatch, k):
    # An image model's batches of tens of MB, a window of 33 turns in flight: holding every
    # batch would hold gigabytes. Over the budget a turn's batches are not held.
    monkeypatch.setattr("loopax.loop._runner.HELD_BATCH_BYTES", 64)  # less than one batch
    inputs = features()
    labels = classes(inputs)
    inputs[11 * BATCH_SIZE + 2, 1] = np.nan
    error = failure(classification(), in_order(inputs, labels), k)
    assert "at step 11 " in str(error)
    assert "Its batch was not checked (LookupError: its batches were not kept" in str(error)
    assert "holds" not in str(error)  # nothing claimed about a batch it did not see
