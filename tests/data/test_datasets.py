"""ArrayDataset and IterableDataset through the public API (no compilation needed)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import loopax


def rows(num_examples, width=2):
    """Row `i` holds the values `i*width ... i*width + width-1`, so a batch names its rows."""
    return np.arange(num_examples * width, dtype=np.float32).reshape(num_examples, width)


def row_ids(batch_inputs):
    return (batch_inputs[0][:, 0] // batch_inputs[0].shape[1]).astype(int).tolist()


def take(dataset, count):
    return [dataset.yield_batch() for _ in range(count)]


def epoch_of(dataset):
    """Every batch until StopIteration, as lists of row ids."""
    batches = []
    while True:
        try:
            _, inputs, _ = dataset.yield_batch()
        except StopIteration:
            return batches
        batches.append(row_ids(inputs))


# -- ArrayDataset ---------------------------------------------------------------------------


def test_array_dataset_follows_the_dataset_protocol():
    dataset = loopax.ArrayDataset(rows(4), np.zeros(4), batch_size=2, name="train")
    assert isinstance(dataset, loopax.Dataset)
    assert dataset.name == "train"
    spec, inputs, labels = dataset.yield_batch()
    assert spec is None
    assert isinstance(inputs, list) and isinstance(labels, list)
    assert len(inputs) == 1 and len(labels) == 1


def test_array_dataset_yields_its_spec():
    dataset = loopax.ArrayDataset(rows(4), np.zeros(4), batch_size=2, spec=("small", 4))
    assert dataset.yield_batch()[0] == ("small", 4)


def test_unshuffled_batches_are_in_order_and_labels_follow_inputs():
    labels = np.arange(10) * 10
    dataset = loopax.ArrayDataset(rows(10), labels, batch_size=4, shuffle=False)
    _, inputs, batch_labels = dataset.yield_batch()
    assert row_ids(inputs) == [0, 1, 2, 3]
    assert batch_labels[0].tolist() == [0, 10, 20, 30]


def test_shuffled_epoch_visits_every_example_once_and_labels_stay_aligned():
    labels = np.arange(12)
    dataset = loopax.ArrayDataset(rows(12), labels, batch_size=3, seed=5)
    seen = []
    while True:
        try:
            _, inputs, batch_labels = dataset.yield_batch()
        except StopIteration:
            break
        assert row_ids(inputs) == batch_labels[0].tolist()
        seen += batch_labels[0].tolist()
    assert sorted(seen) == list(range(12))
    assert seen != list(range(12)), "shuffle=True should not keep the original order"


def test_shuffle_is_deterministic_from_seed_and_differs_per_epoch():
    def two_epochs(seed):
        dataset = loopax.ArrayDataset(
            rows(16), np.zeros(16), batch_size=4, seed=seed, loop_forever=True
        )
        return [row_ids(inputs) for _, inputs, _ in take(dataset, 8)]

    first = two_epochs(seed=1)
    assert first == two_epochs(seed=1)
    assert first != two_epochs(seed=2)
    epoch0, epoch1 = first[:4], first[4:]
    assert sorted(sum(epoch0, [])) == sorted(sum(epoch1, [])) == list(range(16))
    assert epoch0 != epoch1, "each epoch reshuffles"


def test_reset_after_an_epoch_starts_a_new_shuffled_epoch_like_loop_forever():
    forever = loopax.ArrayDataset(rows(8), np.zeros(8), batch_size=4, seed=3, loop_forever=True)
    expected = [row_ids(inputs) for _, inputs, _ in take(forever, 4)]
    dataset = loopax.ArrayDataset(rows(8), np.zeros(8), batch_size=4, seed=3)
    first_epoch = epoch_of(dataset)
    dataset.reset()
    assert first_epoch + epoch_of(dataset) == expected


def test_reset_mid_epoch_starts_over_and_reset_at_start_is_a_no_op():
    dataset = loopax.ArrayDataset(rows(8), np.zeros(8), batch_size=2, shuffle=False)
    dataset.reset()  # nothing consumed: stays at the start
    assert row_ids(dataset.yield_batch()[1]) == [0, 1]
    dataset.yield_batch()
    dataset.reset()
    assert row_ids(dataset.yield_batch()[1]) == [0, 1]


def test_without_loop_forever_the_epoch_ends_with_stop_iteration():
    dataset = loopax.ArrayDataset(rows(8), np.zeros(8), batch_size=4)
    take(dataset, 2)
    with pytest.raises(StopIteration):
        dataset.yield_batch()
    with pytest.raises(StopIteration):
        dataset.yield_batch()  # stays ended until reset


def test_loop_forever_never_ends():
    dataset = loopax.ArrayDataset(rows(6), np.zeros(6), batch_size=3, loop_forever=True)
    batches = take(dataset, 7)
    assert all(inputs[0].shape == (3, 2) for _, inputs, _ in batches)


@pytest.mark.parametrize("drop_remainder, sizes", [(True, [4, 4]), (False, [4, 4, 2])])
def test_drop_remainder(drop_remainder, sizes):
    dataset = loopax.ArrayDataset(
        rows(10), np.zeros(10), batch_size=4, shuffle=False, drop_remainder=drop_remainder
    )
    assert [len(batch) for batch in epoch_of(dataset)] == sizes


def test_drop_remainder_false_with_loop_forever_keeps_the_short_batch():
    dataset = loopax.ArrayDataset(
        rows(5), np.zeros(5), batch_size=2, shuffle=False, drop_remainder=False, loop_forever=True
    )
    assert [len(row_ids(inputs)) for _, inputs, _ in take(dataset, 6)] == [2, 2, 1, 2, 2, 1]


def test_single_array_and_list_of_arrays():
    x, z = rows(6), rows(6, width=3)
    single = loopax.ArrayDataset(x, np.zeros(6), batch_size=3, shuffle=False)
    several = loopax.ArrayDataset([x, z], [np.zeros(6), np.ones(6)], batch_size=3, shuffle=False)
    _, inputs, labels = single.yield_batch()
    assert len(inputs) == 1 and len(labels) == 1
    np.testing.assert_array_equal(inputs[0], x[:3])
    _, inputs, labels = several.yield_batch()
    assert [a.shape for a in inputs] == [(3, 2), (3, 3)]
    assert [a.shape for a in labels] == [(3,), (3,)]
    np.testing.assert_array_equal(inputs[1], z[:3])


@pytest.mark.parametrize("labels", [(), [], None])
def test_empty_labels(labels):
    dataset = loopax.ArrayDataset(rows(4), labels, batch_size=2)
    _, inputs, batch_labels = dataset.yield_batch()
    assert batch_labels == []
    assert inputs[0].shape == (2, 2)


def test_jax_arrays_are_accepted():
    import jax.numpy as jnp

    dataset = loopax.ArrayDataset(
        jnp.arange(8.0).reshape(4, 2), jnp.zeros(4), batch_size=2, shuffle=False
    )
    _, inputs, _ = dataset.yield_batch()
    np.testing.assert_array_equal(np.asarray(inputs[0]), [[0.0, 1.0], [2.0, 3.0]])


def test_array_dataset_rejects_bad_arguments():
    with pytest.raises(ValueError, match="first dimension"):
        loopax.ArrayDataset(rows(4), np.zeros(5), batch_size=2)
    with pytest.raises(TypeError, match="not an array"):
        loopax.ArrayDataset([[1.0, 2.0]], np.zeros(1), batch_size=1)
    with pytest.raises(ValueError, match="batch_size"):
        loopax.ArrayDataset(rows(4), np.zeros(4), batch_size=0)
    with pytest.raises(ValueError, match="larger than its 4 examples"):
        loopax.ArrayDataset(rows(4), np.zeros(4), batch_size=5)
    with pytest.raises(ValueError, match="scalar"):
        loopax.ArrayDataset(np.float32(1.0), (), batch_size=1)


def test_batch_larger_than_data_is_allowed_without_drop_remainder():
    dataset = loopax.ArrayDataset(rows(3), np.zeros(3), batch_size=5, drop_remainder=False)
    assert [len(batch) for batch in epoch_of(dataset)] == [3]


def test_get_state_set_state_continues_exactly():
    def make():
        return loopax.ArrayDataset(rows(10), np.arange(10), batch_size=3, seed=7, loop_forever=True)

    uninterrupted = make()
    take(uninterrupted, 5)  # into the second epoch
    state = uninterrupted.get_state()
    expected = [row_ids(inputs) for _, inputs, _ in take(uninterrupted, 6)]
    resumed = make()
    take(resumed, 1)  # wherever it is, set_state moves it
    resumed.set_state(state)
    assert [row_ids(inputs) for _, inputs, _ in take(resumed, 6)] == expected


def test_state_is_json_serializable():
    import json

    dataset = loopax.ArrayDataset(rows(10), np.arange(10), batch_size=3, seed=7)
    take(dataset, 2)
    state = json.loads(json.dumps(dataset.get_state()))
    restored = loopax.ArrayDataset(rows(10), np.arange(10), batch_size=3, seed=7)
    restored.set_state(state)
    assert epoch_of(restored) == epoch_of(dataset)


def test_set_state_with_another_seed_raises():
    saved = loopax.ArrayDataset(rows(10), np.arange(10), batch_size=3, seed=1)
    take(saved, 1)
    other = loopax.ArrayDataset(rows(10), np.arange(10), batch_size=3, seed=2)
    with pytest.raises(ValueError, match="seed"):
        other.set_state(saved.get_state())


def test_set_state_out_of_range_raises():
    dataset = loopax.ArrayDataset(rows(4), np.arange(4), batch_size=2, seed=0)
    with pytest.raises(ValueError, match="position"):
        dataset.set_state({"epoch": 0, "position": 99, "seed": 0})


@settings(max_examples=40, deadline=None)
@given(
    num_examples=st.integers(1, 12),
    batch_size=st.integers(1, 5),
    consumed=st.integers(0, 12),
    drop_remainder=st.booleans(),
    shuffle=st.booleans(),
)
def test_resume_property(num_examples, batch_size, consumed, drop_remainder, shuffle):
    """After any number of batches, a restored copy yields the same batches from there."""
    if drop_remainder and batch_size > num_examples:
        return

    def make():
        return loopax.ArrayDataset(
            rows(num_examples),
            np.arange(num_examples),
            batch_size=batch_size,
            seed=11,
            shuffle=shuffle,
            drop_remainder=drop_remainder,
            loop_forever=True,
        )

    uninterrupted = make()
    take(uninterrupted, consumed)
    state = uninterrupted.get_state()
    resumed = make()
    resumed.set_state(state)
    for _ in range(6):
        _, expected_inputs, expected_labels = uninterrupted.yield_batch()
        _, inputs, labels = resumed.yield_batch()
        np.testing.assert_array_equal(inputs[0], expected_inputs[0])
        np.testing.assert_array_equal(labels[0], expected_labels[0])


# -- IterableDataset ------------------------------------------------------------------------


def test_iterable_dataset_with_inputs_and_labels():
    x, y = rows(2), np.zeros(2)
    dataset = loopax.IterableDataset(lambda: iter([(x, y), ([x, x], [])]), name="pairs")
    assert isinstance(dataset, loopax.Dataset)
    assert dataset.name == "pairs"
    spec, inputs, labels = dataset.yield_batch()
    assert spec is None and len(inputs) == 1 and len(labels) == 1
    np.testing.assert_array_equal(inputs[0], x)
    spec, inputs, labels = dataset.yield_batch()
    assert len(inputs) == 2 and labels == []
    with pytest.raises(StopIteration):
        dataset.yield_batch()


def test_iterable_dataset_with_spec_inputs_and_labels():
    x, y = rows(2), np.zeros(2)
    dataset = loopax.IterableDataset(lambda: iter([("short", [x], [y])]), name="specs")
    spec, inputs, labels = dataset.yield_batch()
    assert spec == "short"
    assert len(inputs) == 1 and len(labels) == 1


def test_iterable_dataset_reset_calls_make_iterator_again():
    calls = []

    def make_iterator():
        calls.append(1)
        return iter([(rows(1), np.zeros(1)), (rows(2), np.zeros(2))])

    dataset = loopax.IterableDataset(make_iterator, name="counted")
    first = dataset.yield_batch()
    dataset.yield_batch()
    with pytest.raises(StopIteration):
        dataset.yield_batch()
    calls_before_reset = len(calls)
    dataset.reset()
    assert len(calls) == calls_before_reset + 1
    np.testing.assert_array_equal(dataset.yield_batch()[1][0], first[1][0])


def test_iterable_dataset_accepts_a_generator_function():
    def batches():
        for size in (1, 2):
            yield rows(size), np.zeros(size)

    dataset = loopax.IterableDataset(batches, name="gen")
    assert dataset.yield_batch()[1][0].shape == (1, 2)
    assert dataset.yield_batch()[1][0].shape == (2, 2)
    dataset.reset()
    assert dataset.yield_batch()[1][0].shape == (1, 2)


def test_iterable_dataset_rejects_bad_items_and_arguments():
    with pytest.raises(TypeError, match="callable"):
        loopax.IterableDataset(iter([]), name="not callable")
    dataset = loopax.IterableDataset(lambda: iter([rows(1)]), name="bad")
    with pytest.raises(ValueError, match="bad"):
        dataset.yield_batch()


def test_shard_by_process_on_one_process_yields_whole_batches_with_a_global_position():
    x, y = np.arange(12.0), np.arange(12)
    sharded = loopax.ArrayDataset(x, y, 4, seed=3, shard_by_process=True)
    plain = loopax.ArrayDataset(x, y, 4, seed=3)
    for _ in range(3):
        np.testing.assert_array_equal(sharded.yield_batch()[1][0], plain.yield_batch()[1][0])
    assert sharded.get_state() == {**plain.get_state(), "process_independent": True}
    stacked = loopax.ArrayDataset(x, y, 4, shuffle=False, shard_by_process=True)
    assert stacked.yield_batches(2)[1][0].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="on_device=True holds every row.*one or the other"):
        loopax.ArrayDataset(x, y, 4, on_device=True, shard_by_process=True)
