"""`StepReader`: a dataset's batches as the typed dispatches `Trainer.run` takes."""

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import loopax
from loopax.data._datasets import BadBatchError
from loopax.data._reader import (
    OnDevice,
    OneStep,
    Stacked,
    StepReader,
    group_sizes,
    power_of_two_at_most,
    with_count,
)

EXAMPLES = 40


def make_dataset(batch_size=4, **kwargs):
    inputs = np.arange(EXAMPLES * 2, dtype=np.float32).reshape(EXAMPLES, 2)
    labels = np.arange(EXAMPLES, dtype=np.float32)
    return loopax.ArrayDataset(inputs, labels, batch_size, shuffle=False, **kwargs)


def gathers_anywhere(devices):
    return True


def test_a_read_of_one_step_is_the_batch_as_yielded():
    dataset = make_dataset()
    yielded = make_dataset().yield_batch()
    dispatches, ended = StepReader(dataset).read(1)
    assert not ended and len(dispatches) == 1
    (dispatch,) = dispatches
    assert isinstance(dispatch, OneStep) and dispatch.count == 1
    assert dispatch.spec is None
    np.testing.assert_array_equal(dispatch.inputs[0], yielded[1][0])
    np.testing.assert_array_equal(dispatch.labels[0], yielded[2][0])


def test_a_group_is_split_into_power_of_two_chunks_largest_first():
    reader = StepReader(make_dataset(), steps_per_read=8)
    dispatches, ended = reader.read(7)
    assert not ended
    assert [type(d) for d in dispatches] == [Stacked, Stacked, OneStep]
    assert [d.count for d in dispatches] == [4, 2, 1]
    assert dispatches[0].inputs[0].shape == (4, 4, 2)
    # The steps follow each other: 7 batches of 4 examples from example 0 on.
    first_labels = [np.asarray(d.labels[0]).reshape(-1)[0] for d in dispatches]
    assert first_labels == [0.0, 16.0, 24.0]


def test_a_group_ends_with_the_data():
    reader = StepReader(make_dataset(), steps_per_read=16)
    dispatches, ended = reader.read(16)  # 10 batches an epoch
    assert ended and sum(d.count for d in dispatches) == 10
    with pytest.raises(StopIteration):
        reader.read(16)


def test_an_on_device_dataset_is_read_where_its_batches_lie():
    devices = jax.devices()[:1]
    dataset = make_dataset(on_device=True, devices=devices, loop_forever=True)
    dispatches, ended = StepReader(dataset, 8, gathers_on=gathers_anywhere).read(8)
    assert not ended
    assert [type(d) for d in dispatches] == [OnDevice] and dispatches[0].count == 8
    # Steps that cross an epoch end stay one dispatch.
    dispatches, _ = StepReader(dataset, 8, gathers_on=gathers_anywhere).read(4)
    assert [d.count for d in dispatches] == [4]


def test_an_on_device_dataset_the_trainer_cannot_gather_from_is_stacked():
    devices = jax.devices()[:1]
    dataset = make_dataset(on_device=True, devices=devices, loop_forever=True)
    dispatches, _ = StepReader(dataset, 8, gathers_on=lambda devices: False).read(8)
    assert [type(d) for d in dispatches] == [Stacked]


@pytest.mark.parametrize("steps_per_read", [1, 4])
def test_a_batch_that_is_not_spec_inputs_labels_is_named(steps_per_read):
    class Pairs:
        name = "pairs"

        def yield_batch(self):
            return np.ones((4, 2)), np.ones(4)

        def reset(self):
            pass

    with pytest.raises(BadBatchError, match=r"dataset 'pairs' yielded a tuple of 2 items"):
        StepReader(Pairs(), steps_per_read).read(steps_per_read)


@given(steps=st.integers(0, 10_000), most=st.integers(1, 300))
def test_group_sizes_are_the_sizes_the_loop_reads_the_steps_in(steps, most):
    read = set()
    left = steps
    while left > 0:  # as the loop asks: the largest power of two within `most` and the rest
        size = power_of_two_at_most(min(most, left))
        read.add(size)
        left -= size
    assert group_sizes(steps, most) == read


def test_group_sizes_of_a_long_run_take_no_time_per_group():
    assert group_sizes(10**15 + 3, 10) == {8, 2, 1}


@pytest.mark.parametrize("count", [1, 2, 4])
def test_with_count_gives_the_shapes_of_a_group_of_another_size(count):
    inputs, labels = [np.zeros((8, 3, 2), np.float32)], [np.zeros((8, 3), np.int32)]
    for dispatch in (
        Stacked(8, "spec", inputs, labels),
        OneStep("spec", [inputs[0][0]], [labels[0][0]]),
    ):
        resized = with_count(dispatch, count)
        assert resized.count == count and resized.spec == "spec"
        leading = (count,) if count > 1 else ()
        assert isinstance(resized, Stacked if count > 1 else OneStep)
        assert resized.inputs == [jax.ShapeDtypeStruct((*leading, 3, 2), np.float32)]
        assert resized.labels == [jax.ShapeDtypeStruct((*leading, 3), np.int32)]


def test_with_count_of_an_on_device_group_keeps_its_arrays():
    dataset = make_dataset(on_device=True, devices=jax.devices()[:1], loop_forever=True)
    reader = StepReader(dataset, steps_per_read=8, gathers_on=gathers_anywhere)
    (dispatch,), _ = reader.read(8)
    resized = with_count(dispatch, 2)
    assert isinstance(resized, OnDevice) and resized.count == 2
    assert resized.chunk.source is dispatch.chunk.source
    assert resized.chunk.start == dispatch.chunk.start
