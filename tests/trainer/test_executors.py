"""The executor cache: one compilation per (graph type, spec, shapes, dtypes), LRU-bounded."""

import logging

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import loopax

ONE_DEVICE = jax.devices()[:1]


def dense_model(ctx, spec, inputs):
    return nn.Dense(1)(inputs[0])


def squared_error(labels, predictions):
    return (labels[0] - predictions[0]) ** 2


def batch(batch_size=4, width=3, dtype=np.float32):
    x = np.ones((batch_size, width), dtype)
    return [x], [np.ones((batch_size, 1), np.float32)]


class CountingTrainer:
    """A trainer plus the ExecInfo of every compilation it reports."""

    def __init__(self, **kwargs):
        self.trainer = loopax.Trainer(
            dense_model, squared_error, optax.sgd(0.01), devices=ONE_DEVICE, **kwargs
        )
        self.compiled = []
        self.trainer.on_exec_creation(self.compiled.append)


def test_second_step_with_the_same_spec_and_shapes_never_compiles():
    counting = CountingTrainer()
    trainer = counting.trainer
    inputs, labels = batch()
    for _ in range(5):
        trainer.train_step(None, inputs, labels)
    assert len(counting.compiled) == 1
    [executor] = trainer.executors()
    assert executor.hits == 4
    assert executor.info == counting.compiled[0]
    loopax.Loop(trainer).run_steps(
        loopax.ArrayDataset(inputs[0], labels[0], batch_size=4, loop_forever=True), 3
    )
    assert len(counting.compiled) == 1
    assert trainer.executors()[0].hits == 7


def test_exec_info_fields():
    counting = CountingTrainer()
    counting.trainer.train_step("spec-a", *batch())
    counting.trainer.eval_step("spec-a", *batch())
    train_info, eval_info = counting.compiled
    assert isinstance(train_info, loopax.ExecInfo)
    assert train_info.graph_type == "train" and eval_info.graph_type == "eval"
    assert train_info.spec == "spec-a"
    assert train_info.input_shapes == ((4, 3),)
    assert train_info.label_shapes == ((4, 1),)
    assert train_info.input_dtypes == ("float32",)
    assert train_info.label_dtypes == ("float32",)
    assert train_info.compile_seconds > 0 and eval_info.compile_seconds > 0
    assert [e.info.graph_type for e in counting.trainer.executors()] == ["train", "eval"]


def test_a_new_shape_dtype_or_spec_compiles_a_new_executable():
    counting = CountingTrainer()
    trainer = counting.trainer
    trainer.train_step(None, *batch(4))
    trainer.train_step(None, *batch(8))  # another batch size
    trainer.train_step("other", *batch(4))  # another spec
    trainer.train_step(None, [np.ones((4, 3), np.float16)], batch()[1])  # another dtype
    trainer.train_step(None, *batch(4))
    trainer.train_step(None, *batch(8))
    keys = [(info.spec, info.input_shapes, info.input_dtypes) for info in counting.compiled]
    assert keys == [
        (None, ((4, 3),), ("float32",)),
        (None, ((8, 3),), ("float32",)),
        ("other", ((4, 3),), ("float32",)),
        (None, ((4, 3),), ("float16",)),
    ]
    assert sorted(e.hits for e in trainer.executors()) == [0, 0, 1, 1]


def test_lru_eviction_warns_with_spec_and_shapes_and_recompiles_later(caplog):
    counting = CountingTrainer(max_executors=2)
    trainer = counting.trainer
    with caplog.at_level(logging.WARNING, logger="loopax"):
        trainer.train_step("bucket-4", *batch(4))
        trainer.train_step("bucket-8", *batch(8))
        trainer.train_step("bucket-4", *batch(4))  # now bucket-8 is least recently used
        assert not caplog.records
        trainer.train_step("bucket-12", *batch(12))
    [record] = [r for r in caplog.records if r.name == "loopax"]
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert "bucket-8" in message and "(8, 3)" in message
    assert "bucket-4" not in message
    assert "max_executors=2" in message
    assert "pad" in message.lower() or "bucket" in message.lower()
    assert {e.info.spec for e in trainer.executors()} == {"bucket-4", "bucket-12"}
    compiled = len(counting.compiled)
    trainer.train_step("bucket-4", *batch(4))  # still cached
    assert len(counting.compiled) == compiled
    trainer.train_step("bucket-8", *batch(8))  # evicted: compiles again
    assert len(counting.compiled) == compiled + 1
    assert trainer.global_step == 6


def test_unhashable_spec_works_through_its_repr():
    counting = CountingTrainer()
    trainer = counting.trainer
    spec = {"length": 4, "tags": ["a"]}
    trainer.train_step(spec, *batch())
    trainer.train_step({"length": 4, "tags": ["a"]}, *batch())  # an equal dict: same executor
    assert len(counting.compiled) == 1
    assert counting.compiled[0].spec == spec
    trainer.train_step({"length": 5, "tags": ["a"]}, *batch())
    assert len(counting.compiled) == 2


def test_same_spec_with_another_number_of_inputs_or_labels_raises():
    trainer = CountingTrainer().trainer
    inputs, labels = batch()
    trainer.train_step("pairs", inputs, labels)
    with pytest.raises(ValueError, match="'pairs'") as info:
        trainer.train_step("pairs", inputs + inputs, labels)
    message = str(info.value)
    assert "1 inputs and 1 labels" in message and "2 inputs and 1 labels" in message
    with pytest.raises(ValueError, match="1 inputs and 0 labels"):
        trainer.eval_step("pairs", inputs, [])
    trainer.train_step("other", inputs + inputs, labels)  # another spec is free to differ


def test_add_per_step_update_recompiles_once():
    counting = CountingTrainer()
    trainer = counting.trainer
    trainer.train_step(None, *batch())
    trainer.add_per_step_update(lambda params: params)
    trainer.train_step(None, *batch())
    trainer.train_step(None, *batch())
    assert len(counting.compiled) == 2


def test_on_exec_creation_rejects_non_callables():
    with pytest.raises(TypeError):
        CountingTrainer().trainer.on_exec_creation("print")
