"""Tiny trainers shared by the tests of loop and hook behaviour (not a test file).

Over half of the suite's CPU once went to XLA compiling programs that differed only because
each test file chose its own throwaway model, optimizer and shapes. A test that checks what
the loop or a hook does, not what a model computes, takes its trainer and data from here:
the same model, loss, optimizer and batch shapes give the same programs, and a program one
test compiled loads from the run's persistent compilation cache (tests/conftest.py) in every
other test, file, xdist worker and subprocess. A test that depends on its model (BatchNorm,
dropout, a particular loss or precision) keeps its own.

Two models, each with fixed shapes:

- `"regression"`: `Dense(4) -> relu -> Dense(1)` over 3 features, batches of 8, labels the sum
  of the features, mean squared error, `loopax.optimizers.adam(0.01)`;
- `"classifier"`: `Dense(8) -> relu -> Dense(2)` over 4 features, batches of 16, labels
  whether the first two features sum above 0, sparse softmax cross-entropy,
  `loopax.optimizers.sgd(0.1)`.

Their optimizers are loopax's, whose learning rate hooks can read and set.

Metrics change the programs: pass the same ones (the `loopax.metrics` objects, not lambdas of
a test file) wherever a test does not need its own.
"""

import collections
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import numpy as np

import loopax


def regression_model(ctx, spec, inputs):
    return nn.Dense(1)(nn.relu(nn.Dense(4)(inputs[0])))


def classifier_model(ctx, spec, inputs):
    return nn.Dense(2)(nn.relu(nn.Dense(8)(inputs[0])))


class TinyModel(NamedTuple):
    """A model with its loss, default optimizer and the shapes of its batches."""

    model_fn: Any
    loss_fn: Any
    optimizer: Any  # () -> optax.GradientTransformation
    batch_size: int
    features: int


MODELS = {
    "regression": TinyModel(
        regression_model,
        loopax.losses.mean_squared_error,
        lambda: loopax.optimizers.adam(0.01),
        8,
        3,
    ),
    "classifier": TinyModel(
        classifier_model,
        loopax.losses.sparse_categorical_crossentropy_logits,
        lambda: loopax.optimizers.sgd(0.1),
        16,
        4,
    ),
}


def _model(name: str) -> TinyModel:
    if name not in MODELS:
        raise ValueError(f"tiny model {name!r} is not one of {sorted(MODELS)}")
    return MODELS[name]


def tiny_trainer(
    devices: int | Sequence[Any] = 1,
    *,
    model: str = "regression",
    metrics: Sequence[Any] = (),
    eval_metrics: Sequence[Any] = (),
    optimizer: Any = None,
    **kwargs: Any,
) -> loopax.Trainer:
    """A fresh trainer of a shared tiny model.

    Args:
      devices: how many of `jax.devices()` to train on, or the devices themselves.
      model: `"regression"` or `"classifier"`.
      metrics: the train metrics; `eval_metrics` the eval ones.
      optimizer: another optimizer than the model's own (another program).
      **kwargs: the other `loopax.Trainer` arguments (`seed`, `accumulate_steps`, ...).
    """
    tiny = _model(model)
    if isinstance(devices, int):
        devices = jax.devices()[:devices]
    return loopax.Trainer(
        tiny.model_fn,
        tiny.loss_fn,
        tiny.optimizer() if optimizer is None else optimizer,
        train_metrics=metrics,
        eval_metrics=eval_metrics,
        devices=devices,
        **kwargs,
    )


def tiny_arrays(examples: int, *, model: str = "regression", seed: int = 0):
    """`(inputs, labels)` of `examples` rows for `model` (labels a function of the inputs)."""
    tiny = _model(model)
    inputs = np.random.default_rng(seed).normal(size=(examples, tiny.features))
    inputs = inputs.astype(np.float32)
    if model == "classifier":
        return inputs, (inputs[:, 0] + inputs[:, 1] > 0).astype(np.int32)
    return inputs, inputs.sum(1, keepdims=True)


def tiny_batch(*, model: str = "regression", seed: int = 0):
    """One batch `(None, [inputs], [labels])` of `model`'s batch size, as a dataset yields."""
    inputs, labels = tiny_arrays(_model(model).batch_size, model=model, seed=seed)
    return None, [inputs], [labels]


def tiny_data(
    batches: int = 3,
    *,
    model: str = "regression",
    data_seed: int = 0,
    loop_forever: bool = True,
    **kwargs: Any,
) -> loopax.ArrayDataset:
    """A `loopax.ArrayDataset` of `batches` batches of `model`'s shapes.

    Args:
      batches: batches an epoch.
      model: `"regression"` or `"classifier"`.
      data_seed: the seed the examples are drawn from (`seed` is the shuffle's).
      loop_forever: whether the dataset starts another epoch at its end.
      **kwargs: the other `loopax.ArrayDataset` arguments (`name`, `shuffle`, `seed`, ...).
    """
    tiny = _model(model)
    inputs, labels = tiny_arrays(batches * tiny.batch_size, model=model, seed=data_seed)
    return loopax.ArrayDataset(
        inputs, labels, batch_size=tiny.batch_size, loop_forever=loop_forever, **kwargs
    )


def compiled(trainer: loopax.Trainer, data: Any = None):
    """Compiles `trainer`'s step: one step on `data` (by default `tiny_data()`).

    For a trainer that a module's tests share (compiling costs a second, a step
    microseconds), handed out again at its initial state by `restart`.

    Returns:
      `(trainer, initial)`: `initial` a host copy of the state the trainer was initialized
      to (the step donates the device buffers of the state it is given).
    """
    initial = []
    trainer.add_state_initializer(lambda state: initial.append(jax.device_get(state)) or state)
    loopax.Loop(trainer).run_steps(tiny_data() if data is None else data, 1)
    return trainer, initial[0]


def restart(trainer: loopax.Trainer, initial: Any, step: int = 0) -> loopax.Trainer:
    """`trainer` back at the `initial` state that `compiled` returned, at global `step`."""
    state = jax.tree.map(np.array, initial)
    trainer.state = state.replace(step=np.full_like(state.step, step))
    assert trainer.global_step == step
    return trainer


def python_calls_by_step(loop: loopax.Loop, data: Any, steps: int) -> collections.Counter:
    """Python calls `loop.run_steps(data, steps)` makes, by the loop step they were made at.

    Counted with `sys.setprofile`: deterministic, unlike the time the calls take.
    """
    calls: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event == "call":
            calls[loop.loop_step] += 1

    sys.setprofile(profile)
    try:
        loop.run_steps(data, steps)
    finally:
        sys.setprofile(None)
    return calls
