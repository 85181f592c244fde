"""A sharded (FSDP + tensor-parallel) state checkpointed by 2 processes, resumed on any topology.

2 processes x 2 devices train on a 2x2 mesh and save in the background; the checkpoint then
resumes on 2 processes, and restores in 1 process on meshes 4x1, 1x4 and on 1 device, each
continuing as an uninterrupted 1-device run would.
"""

import json
import shutil

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import loopax
from loopax import hooks
from loopax.testing import multiprocess

# Their processes fork from one pre-imported interpreter (conftest.py, tests/zygote.py).
pytestmark = pytest.mark.usefixtures("forked_processes")

GLOBAL_BATCH = 8
RULES = [("embed", None), ("mlp", "model")]


def model_fn(ctx, spec, inputs):
    init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
    hidden = nn.relu(nn.Dense(8, kernel_init=init)(inputs[0]))
    return nn.Dense(1)(nn.Dense(8)(hidden))


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    return x, x.sum(axis=1, keepdims=True).astype(np.float32)


def new_loop(mesh, directory, one_device=False):
    kwargs = {"devices": jax.devices()[:1]} if one_device else {"mesh": mesh, "rules": RULES}
    if mesh is not None and not one_device:
        kwargs["fsdp"] = True
    trainer = loopax.Trainer(model_fn, loopax.losses.mean_squared_error, optax.adam(0.01), **kwargs)
    loop = loopax.Loop(trainer)
    checkpointer = hooks.checkpoint(loop, directory, every_n_steps=2, barrier_timeout=60)
    return loop, checkpointer


def share_dataset():
    """The whole data on every process; each yields its rows of every global batch."""
    x, y = data()
    return loopax.ArrayDataset(
        x, y, GLOBAL_BATCH, shuffle=False, loop_forever=True, shard_by_process=True
    )


def train_to(directory, target, mesh_json, one_device):
    """Trains (or resumes) to global step `target`; returns the losses and the params."""
    loop, checkpointer = new_loop(json.loads(mesh_json), directory, one_device)
    start = loop.trainer.global_step
    losses = []
    loop.on_step("record", lambda loop, m: losses.append(float(m["loss"])))
    loop.run_to_step(share_dataset(), target)
    checkpointer.wait()
    params = loop.trainer.params
    return {
        "start": start,
        "losses": losses,
        "steps": checkpointer.all_steps(),
        "specs": [str(params[f"Dense_{i}"]["kernel"].sharding.spec) for i in range(3)],
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("sharded") / "ckpt")
    results = multiprocess(2, 2, train_to, directory, 6, json.dumps({"data": 2, "model": 2}), False)
    return directory, results


def copy_of(directory, tmp_path):
    """A copy of the saved checkpoints: each case resumes from step 6, not from another's."""
    copy = tmp_path / "ckpt"
    shutil.copytree(directory, copy)
    return str(copy)


def reference(steps):
    x, y = data()
    trainer = loopax.Trainer(
        model_fn, loopax.losses.mean_squared_error, optax.adam(0.01), devices=jax.devices()[:1]
    )
    starts = [(GLOBAL_BATCH * step) % len(x) for step in range(steps)]  # epochs wrap
    return [
        float(
            trainer.train_step(None, [x[i : i + GLOBAL_BATCH]], [y[i : i + GLOBAL_BATCH]])["loss"]
        )
        for i in starts
    ]


def test_two_processes_save_their_shards_in_the_background(saved):
    _, results = saved
    expected = reference(6)
    for result in results:
        assert result["start"] == 0 and result["steps"][-1] == 6
        # Tensor parallel by the rule, then FSDP over "data" for the unannotated kernels.
        assert result["specs"] == ["P(None, 'model')", "P('data',)", "P('data',)"]
        np.testing.assert_allclose(result["losses"], expected, rtol=1e-5, atol=1e-6)


def test_the_sharded_checkpoint_resumes_on_two_processes(saved, tmp_path):
    directory = copy_of(saved[0], tmp_path)
    resumed = multiprocess(
        2, 2, train_to, directory, 10, json.dumps({"data": 2, "model": 2}), False
    )
    expected = reference(10)[6:]
    for result in resumed:
        assert result["start"] == 6
        np.testing.assert_allclose(result["losses"], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("mesh", "one_device"),
    [({"data": 4, "model": 1}, False), ({"data": 1, "model": 4}, False), (None, True)],
)
def test_the_sharded_checkpoint_restores_on_one_process_on_another_mesh(
    saved, tmp_path, mesh, one_device
):
    copy = copy_of(saved[0], tmp_path)
    (result,) = multiprocess(1, 4, train_to, str(copy), 8, json.dumps(mesh), one_device)
    assert result["start"] == 6
    np.testing.assert_allclose(result["losses"], reference(8)[6:], rtol=1e-5, atol=1e-6)
