"""Plain iterables of batches (lists, generators, iterators with get_state) as training and
evaluation data: what each kind does, its position in checkpoints, and the messages."""

import gc
import json
import warnings
import weakref

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import loopax
from loopax import hooks

BATCH_SIZE = 4


def model_fn(ctx, spec, inputs):
    return nn.Dense(1)(inputs[0])


def batches(count, start=0):
    """`count` (inputs, labels) pairs; batch k's inputs are all k, so a batch names itself."""
    return [
        (np.full((BATCH_SIZE, 3), k, np.float32), np.full((BATCH_SIZE, 1), 0.1 * k, np.float32))
        for k in range(start, start + count)
    ]


@pytest.fixture(scope="module")
def compiled_trainer():
    trainer = loopax.Trainer(
        model_fn, loopax.losses.mean_squared_error, optax.sgd(0.01), devices=jax.devices()[:1]
    )
    initial = []
    trainer.add_state_initializer(lambda state: initial.append(jax.device_get(state)) or state)
    loopax.Loop(trainer).run_steps(batches(1), 1)
    return trainer, initial[0]


@pytest.fixture
def trainer(compiled_trainer):
    trainer, initial = compiled_trainer
    trainer.__dict__.pop("run", None)
    trainer.state = jax.tree.map(np.array, initial)
    return trainer


@pytest.fixture
def seen(trainer):
    """The batches the trainer steps on, each as its number."""
    steps = []
    run = type(trainer).run.__get__(trainer)

    def recording_run(dispatch):  # every step goes through `run`, one dispatch each here
        assert dispatch.count == 1
        steps.append(int(np.asarray(dispatch.inputs[0])[0, 0]))
        return run(dispatch)

    trainer.run = recording_run
    return steps


class Counter:
    """An iterator over batches 0, 1, ... with its position as state (as grain's have)."""

    def __init__(self, as_bytes=False):
        self.position = 0
        self.as_bytes = as_bytes

    def __iter__(self):
        return self

    def __next__(self):
        batch = batches(1, self.position)[0]
        self.position += 1
        return batch

    def get_state(self):
        state = {"position": self.position}
        return json.dumps(state).encode() if self.as_bytes else state

    def set_state(self, state):
        self.position = json.loads(state)["position"] if self.as_bytes else state["position"]


class Counting:
    """A re-iterable source of Counter iterators."""

    def __init__(self, as_bytes=False):
        self.as_bytes = as_bytes

    def __iter__(self):
        return Counter(self.as_bytes)


# -- what each kind of iterable does in runs -----------------------------------------------------


def test_a_list_is_read_in_order_and_the_next_run_goes_on(trainer, seen):
    data = batches(6)
    loop = loopax.Loop(trainer)
    loop.run_steps(data, 2)
    loop.run_to_step(data, 5)
    assert seen == [0, 1, 2, 3, 4]
    with pytest.raises(RuntimeError, match=r"reached the end of dataset 'train' after 1 of 2"):
        loop.run_steps(data, 2)


def test_only_the_last_runs_iterable_keeps_its_position_in_the_loop(trainer, seen):
    first, other = batches(4), batches(2, start=10)
    loop = loopax.Loop(trainer)
    loop.run_steps(first, 2)
    loop.run_steps(other, 1)
    loop.run_steps(first, 2)  # another object came between: `first` starts over
    assert seen == [0, 1, 10, 0, 1]
    seen.clear()
    kept = loopax.IterableDataset(batches(4), name="kept")  # the position lives in it
    loop.run_steps(kept, 2)
    loop.run_steps(other, 1)
    loop.run_steps(kept, 2)
    assert seen == [0, 1, 10, 2, 3]


def test_the_loop_does_not_hold_the_pipelines_of_earlier_runs(trainer):
    class Pipeline:
        def __iter__(self):
            return iter(batches(2))

    loop = loopax.Loop(trainer)
    old = Pipeline()
    loop.run_steps(old, 1)
    held = weakref.ref(old)
    del old
    loop.run_steps(Pipeline(), 1)
    gc.collect()
    assert held() is None


def test_run_epochs_over_a_list_starts_it_over_each_epoch(trainer, seen):
    loop = loopax.Loop(trainer)
    ends = []
    loop.on_epoch_end("ends", lambda loop, metrics: ends.append(loop.end_step))
    loop.run_epochs(batches(3), 2)
    assert seen == [0, 1, 2, 0, 1, 2]
    assert ends == [6, 6] and loop.epoch == 2


def test_a_generator_trains_with_run_steps_but_not_run_epochs(trainer, seen):
    loop = loopax.Loop(trainer)
    generator = (batch for batch in batches(5))
    loop.run_steps(generator, 2)
    loop.run_steps(generator, 2)
    assert seen == [0, 1, 2, 3]
    with pytest.raises(
        TypeError,
        match=r"run_epochs reads its dataset from the start, and "
        r"dataset 'train' is an iterator \(generator\) that can "
        r"be read only once.*or use run_steps",
    ):
        loop.run_epochs((batch for batch in batches(5)), 1)


def test_a_generator_function_in_iterable_dataset_runs_epochs(trainer, seen):
    def make_batches():
        yield from batches(2)

    loopax.Loop(trainer).run_epochs(loopax.IterableDataset(make_batches, name="gen"), 2)
    assert seen == [0, 1, 0, 1]


def test_elements_may_be_dicts_and_carry_a_spec(trainer):
    x, y = batches(1)[0]
    loop = loopax.Loop(trainer)
    loop.run_steps(
        [{"inputs": x, "labels": y}, {"inputs": [x], "labels": [y], "spec": None}, (None, x, y)], 3
    )
    assert trainer.global_step == 3
    dataset = loopax.IterableDataset([{"inputs": (x, x)}, ("long", [x], [])], name="forms")
    spec, inputs, labels = dataset.yield_batch()
    assert spec is None and len(inputs) == 2 and labels == []
    assert dataset.yield_batch()[0] == "long"


def test_an_object_with_a_name_keeps_it(trainer):
    class Named:
        name = "named-source"

        def __iter__(self):
            return iter(batches(1))

    loop = loopax.Loop(trainer)
    names = []
    loop.on_start("name", lambda loop, dataset: names.append(dataset.name))
    loop.run_steps(Named(), 1)
    loop.run_steps(batches(1), 1)
    assert names == ["named-source", "train"]


# -- evaluation ----------------------------------------------------------------------------------


def test_evaluate_reads_an_iterable_from_the_start_every_time(trainer):
    data = batches(3)
    x = np.concatenate([inputs for inputs, _ in data])
    y = np.concatenate([labels for _, labels in data])
    reference = trainer.evaluate(loopax.ArrayDataset(x, y, BATCH_SIZE, shuffle=False))
    assert trainer.evaluate(data) == reference
    assert trainer.evaluate(data) == reference
    assert trainer.evaluate(loopax.IterableDataset(data, name="test")) == reference


def test_evaluating_the_iterable_dataset_a_run_trains_on_leaves_its_position(trainer, seen):
    data = loopax.IterableDataset(batches(6), name="train")
    loop = loopax.Loop(trainer)
    loop.run_steps(data, 2)
    trainer.evaluate(data)
    loop.evaluate(data)
    loop.run_steps(data, 2)
    assert seen == [0, 1, 2, 3]


def test_evaluate_refuses_an_iterator_saying_what_to_pass(trainer):
    with pytest.raises(
        TypeError,
        match=r"evaluate reads its dataset from the start, and dataset "
        r"'eval' is an iterator \(generator\).*a list, a grain "
        r"MapDataset, IterDataset or DataLoader",
    ):
        trainer.evaluate(batch for batch in batches(2))


def test_scheduled_evaluation_of_a_named_iterable(trainer):
    loop = loopax.Loop(trainer)
    hooks.evaluate(loop, loopax.IterableDataset(batches(2), name="test"), every_n_steps=2)
    loop.run_steps(batches(4), 4)
    assert [step for step, _ in loop.history["eval/test/mean_loss"]] == [2, 4]


def test_loop_evaluate_asks_for_a_name_for_an_unnamed_iterable(trainer):
    with pytest.raises(
        ValueError,
        match=r"needs a non-empty str `name`.*"
        r"loopax\.IterableDataset\(batches, name='test'\)",
    ):
        loopax.Loop(trainer).evaluate(batches(2))


# -- positions in checkpoints --------------------------------------------------------------------


@pytest.mark.parametrize("as_bytes", [False, True])
def test_an_iterator_with_get_state_resumes_exactly(trainer, seen, tmp_path, as_bytes):
    loop = loopax.Loop(trainer)
    checkpointer = hooks.checkpoint(loop, tmp_path, every_n_steps=100)
    loop.run_to_step(Counting(as_bytes), 3)
    checkpointer.wait()
    trainer.state = jax.tree.map(np.zeros_like, jax.device_get(trainer.state))
    loop = loopax.Loop(trainer)
    checkpointer = hooks.checkpoint(loop, tmp_path)
    assert checkpointer.restored_step == 3
    loop.run_to_step(Counting(as_bytes), 5)
    assert seen == [0, 1, 2, 3, 4]


def test_an_iterator_without_get_state_resumes_from_where_it_is_with_a_warning(
    trainer, seen, tmp_path
):
    loop = loopax.Loop(trainer)
    checkpointer = hooks.checkpoint(loop, tmp_path, every_n_steps=100)
    loop.run_to_step(batches(6), 3)
    checkpointer.wait()
    loop = loopax.Loop(trainer)
    hooks.checkpoint(loop, tmp_path)
    with pytest.warns(
        RuntimeWarning,
        match=r"dataset 'train' has no saved position: its "
        r"iterator \(list_iterator\) has no get_state",
    ):
        loop.run_to_step(batches(6), 5)
    assert seen == [0, 1, 2, 0, 1]


def test_iterable_dataset_states():
    dataset = loopax.IterableDataset(Counting(as_bytes=True), name="counted")
    dataset.yield_batch()
    state = dataset.get_state()
    assert list(state) == ["iterator_bytes"] and json.dumps(state)
    dataset.yield_batch()
    dataset.set_state(state)
    assert int(dataset.yield_batch()[1][0][0, 0]) == 1

    with pytest.raises(
        ValueError,
        match=r"'counted' got the state \{'position': 1\}, which no "
        r"IterableDataset.get_state\(\) returned",
    ):
        dataset.set_state({"position": 1})
    listed = loopax.IterableDataset(batches(2), name="listed")
    with pytest.raises(
        ValueError,
        match=r"'listed' was saved with its iterator's position, but "
        r"its iterator now \(list_iterator\) has no set_state",
    ):
        listed.set_state({"iterator": {"position": 1}})

    class NumpyState(Counter):
        def get_state(self):
            return {"position": np.int64(self.position)}

    class NumpyCounting:
        def __iter__(self):
            return NumpyState()

    odd = loopax.IterableDataset(NumpyCounting(), name="odd")
    with pytest.raises(
        TypeError,
        match=r"dataset 'odd': its iterator's get_state\(\) returned "
        r"a dict that is not JSON",
    ):
        odd.get_state()


# -- messages ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "element, what",
    [
        (np.ones((4, 3), np.float32), "an element of type ndarray"),
        ((1, 2, 3, 4), "a tuple of 4 items"),
        ({"inputs": 1, "weights": 2}, "a dict with keys ['inputs', 'weights']"),
        ({"labels": 1}, "a dict with keys ['labels']"),
    ],
)
def test_an_element_that_is_not_a_batch_names_the_dataset_and_the_forms(trainer, element, what):
    # Like any error a dataset raises: the run stops naming it and the step.
    with pytest.raises(RuntimeError) as raised:
        loopax.Loop(trainer).run_steps([element], 1)
    message = str(raised.value)
    assert (
        f"dataset 'train' failed at step 0 (global step 1): ValueError: dataset 'train' "
        f"yielded {what}" in message
    )
    assert "(inputs, labels), (spec, inputs, labels) or a dict {'inputs': ..." in message
    assert isinstance(raised.value.__cause__, ValueError)
    with pytest.raises(
        RuntimeError,
        match=r"dataset 'eval' failed during evaluation: "
        r"ValueError: dataset 'eval' yielded",
    ):
        trainer.evaluate([element])


def test_an_array_spec_says_how_to_pass_several_inputs():
    x, y = batches(1)[0]
    dataset = loopax.IterableDataset([(x, x, y)], name="three")
    with pytest.raises(
        ValueError,
        match=r"'three' yielded a spec that is an array of shape "
        r"\(4, 3\).*\(\(input1, input2\), labels\)",
    ):
        dataset.yield_batch()


@pytest.mark.parametrize(
    "data, hint",
    [
        (5, "got int$"),
        (np.ones((8, 3)), "got ndarray; for in-memory arrays use loopax.ArrayDataset"),
        ({"inputs": np.ones((4, 3))}, r"got dict; for a single batch pass \[batch\]"),
        (lambda: iter(batches(1)), r"got function; pass what it returns"),
        ("abc", "got str$"),
    ],
)
def test_what_is_neither_a_dataset_nor_an_iterable_of_batches(trainer, data, hint):
    loop = loopax.Loop(trainer)
    for run in (loop.run_steps, loop.run_epochs, lambda data, _: trainer.evaluate(data)):
        with pytest.raises(
            TypeError,
            match=r"expected a loopax Dataset \(with yield_batch\(\) "
            rf"and reset\(\)\) or an iterable of batches.*{hint}",
        ):
            run(data, 1)
    assert trainer.global_step == 0


@pytest.mark.parametrize("wrap", [tuple, list])
def test_whole_arrays_given_as_a_dataset_name_array_dataset(trainer, wrap):
    x, y = np.ones((8, 3), np.float32), np.ones((8, 1), np.float32)
    loop = loopax.Loop(trainer)
    for run in (loop.run_steps, loop.run_epochs, lambda data, _: trainer.evaluate(data)):
        with pytest.raises(
            TypeError,
            match=rf"got a {wrap.__name__} of 2 arrays, as \(inputs, labels\) arrays look.*"
            r"loopax.ArrayDataset\(inputs, labels, batch_size\)",
        ):
            run(wrap([x, y]), 1)
    assert trainer.global_step == 0
    loop.run_steps([(x, y)], 1)  # one batch, as the message says
    assert trainer.global_step == 1


def test_iterable_dataset_refuses_an_iterator_and_what_is_not_iterable():
    with pytest.raises(
        TypeError,
        match=r"'once' got an iterator \(generator\), which can be "
        r"read only once.*`lambda: make_batches\(\)`",
    ):
        loopax.IterableDataset((batch for batch in batches(1)), name="once")
    with pytest.raises(
        TypeError,
        match="needs an iterable of batches or a zero-argument "
        "callable returning an iterator, got int",
    ):
        loopax.IterableDataset(3, name="three")


def test_no_warning_for_a_run_on_iterables_without_a_checkpoint(trainer):
    start = trainer.global_step
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop = loopax.Loop(trainer)
        loop.run_steps(batches(2), 2)
        loop.run_epochs(batches(2), 1)
        results = trainer.evaluate(batches(2))
    assert [str(warning.message) for warning in caught] == []
    assert trainer.global_step == start + 4  # both runs read every batch
    assert np.isfinite(results["mean_loss"])
