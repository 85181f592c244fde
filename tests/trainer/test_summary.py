"""`Trainer.summary()`: every parameter, the totals, and on a mesh the bytes per device."""

import io

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import loopax
from loopax import hooks


def model_fn(ctx, spec, inputs):
    hidden = nn.BatchNorm(use_running_average=not ctx.training)(nn.Dense(8)(inputs[0]))
    return nn.Dense(2)(nn.relu(hidden))


def trained(**kwargs):
    kwargs.setdefault("devices", jax.devices()[:1])
    trainer = loopax.Trainer(model_fn, loopax.losses.mean_squared_error, optax.sgd(0.1), **kwargs)
    x = np.ones((8, 4), np.float32)
    trainer.train_step(None, [x], [np.ones((8, 2), np.float32)])
    return trainer


def test_every_parameter_with_shape_dtype_count_and_bytes_then_the_totals():
    assert loopax.Trainer(model_fn, None, optax.sgd(0.1)).summary() == "no parameters yet"
    lines = trained().summary().splitlines()
    assert lines[0].split() == ["parameter", "shape", "dtype", "count", "bytes"]
    rows = {line.split()[0]: line.split() for line in lines[2:] if line[:1].isalpha()}
    assert rows["Dense_0/kernel"][1:5] == ["(4,", "8)", "float32", "32"]
    assert rows["Dense_1/bias"][1:4] == ["(2,)", "float32", "2"]
    # Trainable: 4*8 + 8 + 8 + 8 (BatchNorm scale, bias) + 8*2 + 2 = 74; state: mean, var.
    assert "trainable parameters: 74 (296 B)" in lines
    assert "model state: 16 (64 B)" in lines and "total: 90 (360 B)" in lines
    assert any(line.startswith("(state) batch_stats/BatchNorm_0/mean") for line in lines)


@pytest.mark.cpu_devices  # a mesh over 4 devices
def test_on_a_mesh_each_parameter_shows_its_spec_and_bytes_per_device():
    text = trained(mesh={"data": 4}, fsdp=True, devices=None).summary()
    assert "partition spec" in text and "bytes per device" in text
    kernel = next(line for line in text.splitlines() if line.startswith("Dense_0/kernel"))
    assert "P(None, 'data')" in kernel or "P('data'" in kernel
    assert "per device:" in text


def test_the_progress_bar_prints_it_once_when_asked():
    trainer = loopax.Trainer(
        model_fn, loopax.losses.mean_squared_error, optax.sgd(0.1), devices=jax.devices()[:1]
    )
    loop = loopax.Loop(trainer)
    out = io.StringIO()
    hooks.progress_bar(loop, summary=True, file=out, notebook=False, refresh_seconds=0)
    batch = (np.ones((8, 4), np.float32), np.ones((8, 2), np.float32))
    loop.run_steps([batch] * 3, 3)
    loop.run_steps([batch] * 3, 3)  # a second run: printed once only
    assert out.getvalue().count("trainable parameters: 74") == 1
