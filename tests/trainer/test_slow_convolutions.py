"""A fused program on CPU devices that leaves convolutions to XLA:CPU's generic path warns.

XLA:CPU rewrites convolutions into its fast library form only in a program's entry
computation: in a fused group's loop of steps, the gradient convolutions of a CNN stay in
their generic form, about an order of magnitude slower per step. The trainer reads each
fused program's optimized HLO once when it compiles it and warns once.
"""

import warnings

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import loopax
from loopax.trainer._slow_convolutions import slow_convolutions

EXAMPLES, BATCH = 24, 4
WARNING = (
    r"(?s)^A fused training program \(Loop steps_per_execution > 1; this group: 2 steps\) "
    r"runs convolutions.*slow generic path.*steps_per_execution=1"
)


def cnn(ctx, spec, inputs):
    """A 3x3 convolution and a linear layer on 4x4 one-channel images (16 inputs)."""
    x = inputs[0].reshape((-1, 4, 4, 1))
    x = nn.relu(nn.Conv(2, (3, 3))(x))
    return nn.Dense(3)(x.reshape((x.shape[0], -1)))


def dense(ctx, spec, inputs):
    """A linear layer."""
    return nn.Dense(3)(inputs[0])


def train(model, steps_per_execution, steps=4, on_device=False, accumulate_steps=1):
    """A Trainer after `steps` steps of `model`, fused by `steps_per_execution`."""
    rng = np.random.default_rng(0)
    inputs = rng.normal(size=(EXAMPLES, 16)).astype(np.float32)
    labels = rng.integers(0, 3, size=EXAMPLES).astype(np.int32)
    devices = jax.devices("cpu")[:1]
    dataset = loopax.ArrayDataset(
        inputs,
        labels,
        BATCH,
        seed=1,
        loop_forever=True,
        on_device=on_device,
        devices=devices if on_device else None,
    )
    trainer = loopax.Trainer(
        model,
        loopax.losses.sparse_categorical_crossentropy_logits,
        optax.sgd(0.1),
        seed=2,
        devices=devices,
        accumulate_steps=accumulate_steps,
    )
    loopax.Loop(trainer, steps_per_execution=steps_per_execution).run_to_step(dataset, steps)
    return trainer


@pytest.mark.parametrize("on_device", [False, True])
def test_a_fused_cnn_on_cpu_warns_once(on_device):
    with pytest.warns(RuntimeWarning, match=WARNING) as caught:
        trainer = train(cnn, 2, steps=6, on_device=on_device)  # three groups of 2 steps
    slow = [w for w in caught if "slow generic path" in str(w.message)]
    assert len(slow) == 1
    assert "docs/guides/fused.md#convolutional-models-on-a-cpu" in str(slow[0].message)
    assert slow[0].filename == __file__  # shown at the user's line, not loopax's
    # The warning's reason is in the fused program's HLO: a convolution in a loop's body.
    (fused,) = [e for e in trainer.executors() if e.info.steps == 2]
    assert slow_convolutions(fused.run.as_text())
    # A second loop on the same trainer compiles nothing new and says nothing more.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loopax.Loop(trainer, steps_per_execution=2).run_to_step(
            loopax.ArrayDataset(
                np.zeros((EXAMPLES, 16), np.float32),
                np.zeros(EXAMPLES, np.int32),
                BATCH,
                loop_forever=True,
            ),
            10,
        )


@pytest.mark.parametrize("on_device", [False, True])
def test_single_steps_of_the_cnn_do_not_warn(on_device):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer = train(cnn, 1, on_device=on_device)
    (program,) = [e for e in trainer.executors() if e.info.steps]
    assert not slow_convolutions(program.run.as_text())  # every convolution in the entry


def test_single_steps_accumulating_micro_batches_warn_too():
    # Each step loops over its micro-batches: the same convolutions, in a loop's body.
    with pytest.warns(RuntimeWarning, match=r"(?s)^A train step that accumulates.*slow generic"):
        trainer = train(cnn, 1, steps=2, accumulate_steps=2)
    (program,) = [e for e in trainer.executors() if e.info.steps]
    assert program.info.steps == 1
    assert slow_convolutions(program.run.as_text())


def test_a_fused_dense_model_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer = train(dense, 2)
    assert any(e.info.steps == 2 for e in trainer.executors())


def test_only_non_canonical_convolutions_outside_the_entry_count():
    text = "\n".join(
        [
            "%body (p: f32[]) -> f32[] {",
            "  %a = f32[1] convolution(%x, %y), window={size=3}, dim_labels=b0f_0io->b0f",
            "  %b = f32[1] convolution(%x, %y), window={size=3x3}, dim_labels=f01b_i01o->01bf",
            "}",
            "",
            "ENTRY %main (p: f32[]) -> f32[] {",
            "  %c = f32[1] convolution(%x, %y), window={size=3x3}, dim_labels=bf01_oi01->bf01",
            "  %d = f32[1] convolution(%x, %y), window={size=3x3}, dim_labels=b01f_01io->b01f",
            "}",
        ]
    )
    assert slow_convolutions(text) == ["f01b_i01o->01bf"]
