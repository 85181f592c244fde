"""A convolution model's step on an on-device `ArrayDataset` compiles as on host batches.

XLA:CPU rewrites a convolution whose dimensions are not in its canonical order (the
gradient convolutions JAX's transpose rules produce) so that it runs as a library
convolution, but only in a program's entry computation: one left in a loop's body, even a
`lax.scan` of one step, runs as XLA's generic loops, over ten times slower. The per-step
program that reads its own batch on the devices runs its step outside any loop, as the
host batches' program does: the same convolutions, and the same numbers bit for bit.
"""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import loopax

EXAMPLES, BATCH = 40, 8


def cnn(ctx, spec, inputs):
    """A 3x3 convolution and a linear layer on 6x6 one-channel images (36 inputs)."""
    x = inputs[0].reshape((-1, 6, 6, 1))
    x = nn.relu(nn.Conv(4, (3, 3))(x))
    return nn.Dense(3)(x.reshape((x.shape[0], -1)))


def trained(on_device):
    """A Trainer after 5 per-step steps of the CNN, on host batches or on-device data."""
    rng = np.random.default_rng(0)
    inputs = rng.normal(size=(EXAMPLES, 36)).astype(np.float32)
    labels = rng.integers(0, 3, size=EXAMPLES).astype(np.int32)
    devices = jax.devices()[:1]
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
        cnn,
        loopax.losses.sparse_categorical_crossentropy_logits,
        optax.adam(0.01),
        seed=2,
        devices=devices,
    )
    loopax.Loop(trainer).run_to_step(dataset, 5)
    return trainer


def convolutions(trainer):
    """Per compiled train program: its convolutions' dimension labels, sorted, and whether
    any of them lies in a loop body (not the entry computation)."""
    found = []
    for executor in trainer.executors():
        if executor.info.graph_type not in ("train", "train_steps"):
            continue
        text = executor.run.as_text()
        labels = sorted(re.findall(r" convolution\(.*?dim_labels=([\w>-]+)", text))
        entry = text[text.index("\nENTRY ") :]
        entry = entry[: entry.index("\n}\n")]
        in_entry = entry.count(" convolution(") + sum(
            # a fusion of the entry computation that computes a convolution
            _fused_convolutions(text, name)
            for name in re.findall(r" fusion\(.*?calls=%([\w.\-]+)", entry)
        )
        found.append((labels, in_entry == len(labels)))
    return found


def _fused_convolutions(text, name):
    start = text.index(f"\n%{name} ") + 1
    return text[start : text.index("\n}\n", start)].count(" convolution(")


def test_the_on_device_step_has_the_host_steps_convolutions():
    host, on_device = trained(False), trained(True)
    (host_convolutions,) = convolutions(host)
    (device_convolutions,) = convolutions(on_device)
    labels, all_in_entry = host_convolutions
    assert len(labels) >= 2  # the forward convolution and its gradients
    assert all_in_entry
    # The same convolutions, each in canonical order (none left to XLA's generic loops).
    assert device_convolutions == host_convolutions
    assert set(labels) == {"b01f_01io->b01f"}


def test_the_on_device_step_equals_the_host_step_bit_for_bit():
    host, on_device = trained(False).state, trained(True).state
    assert host is not None and on_device is not None
    for ours, theirs in zip(
        jax.tree.leaves(on_device.params), jax.tree.leaves(host.params), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    assert jnp.array_equal(on_device.step, host.step)
