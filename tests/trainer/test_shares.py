"""The pieces of an uneven evaluation round, as pure integer logic: every process computes the
same calls, every example counts once, and each device's shard is all real or all padding."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from loopax.trainer._shares import Batch, Round, masked_pieces


def pieces_of(sizes, process, local_devices):
    rows = np.arange(max(sizes[process], 1)) + 100 * process  # example ids, distinct
    batch = Batch(None, [rows], [rows])
    return list(masked_pieces(Round(batch, np.asarray(sizes), process), local_devices))


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=4).filter(any),
    local_devices=st.integers(1, 4),
)
def test_every_example_counts_once_in_calls_every_process_makes(sizes, local_devices):
    shapes = None
    for process, size in enumerate(sizes):
        pieces = pieces_of(sizes, process, local_devices)
        # The same calls, with the same shapes, on every process.
        these = [(inputs[0].shape, valid.shape) for inputs, _, valid in pieces]
        assert shapes is None or these == shapes
        shapes = these
        counted = []
        for inputs, labels, valid in pieces:
            np.testing.assert_array_equal(inputs[0], labels[0])
            shards = inputs[0].reshape(local_devices, -1)
            counted += [
                example
                for shard, real in zip(shards, valid, strict=True)
                for example in shard
                if real
            ]
        assert sorted(counted) == list(100 * process + np.arange(size))
    # Few calls: the shard size shrinks by the device count at least each time.
    assert len(shapes) <= 1 + int(np.log2(max(sizes))) + 1


def test_the_issue_case_seven_and_three_in_batches_of_four_on_two_devices():
    # The first batch: 4 and 3 examples. One call of 2 per device, then one of 1 per device.
    first = pieces_of([4, 3], 1, 2)
    assert [(p[0][0].shape, p[2].tolist()) for p in first] == [
        ((4,), [True, False]),
        ((2,), [True, False]),
    ]
    # The second: 3 and none; the process with none feeds padding only.
    second = pieces_of([3, 0], 1, 2)
    assert [p[2].tolist() for p in second] == [[False, False], [False, False]]
