"""`trainer.check_replicas()` and `hooks.check_replicas`: every copy of a replicated array is
compared across 4 simulated devices; one that differs is named with its device."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loopax
from loopax import hooks

pytestmark = pytest.mark.cpu_devices  # copies compared across 4 devices: simulated CPU ones

DEVICES = jax.devices()[:4]
AXIS = []  # the device axis's name, as the model sees it


def model_fn(ctx, spec, inputs):
    AXIS.append(ctx.axis_name)
    return nn.Dense(2)(nn.relu(nn.Dense(8)(inputs[0])))


def make_trainer(**kwargs):
    kwargs.setdefault("devices", DEVICES)
    return loopax.Trainer(
        model_fn,
        loopax.losses.sparse_categorical_crossentropy_logits,
        optax.adam(1e-2),
        train_metrics=[loopax.metrics.MovingAverageSparseCategoricalAccuracy()],
        **kwargs,
    )


def make_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    return loopax.ArrayDataset(x, y, 16, loop_forever=True)


def drift_on_device_2(params):
    """A per-step update that runs differently on one device (the failure caught)."""
    index = jax.lax.axis_index(AXIS[-1])
    return jax.tree.map(lambda p: p + jnp.where(index == 2, 1e-3, 0.0).astype(p.dtype), params)


@pytest.mark.parametrize("kwargs", [{}, {"parallel": "pmap"}, {"fsdp": True}], ids=str)
def test_a_clean_state_passes(kwargs):
    trainer = make_trainer(**kwargs)
    assert trainer.check_replicas() == 0  # no state before the first step
    loopax.Loop(trainer).run_steps(make_data(), 3)
    # 17 arrays: the step, 4 parameters, Adam's count and 2 x 4 moments, 3 metric states;
    # all replicated, but with fsdp the 2 kernels and their 4 moments (sharded over the
    # devices: one copy of each block).
    assert trainer.check_replicas() == (11 if kwargs.get("fsdp") else 17)


def test_a_replica_that_drifted_in_the_step_is_named_with_its_device():
    trainer = make_trainer(parallel="pmap")  # pmap does not check replication: it drifts
    trainer.add_per_step_update(drift_on_device_2)
    loopax.Loop(trainer).run_steps(make_data(), 1)
    with pytest.raises(loopax.ReplicaMismatchError) as raised:
        trainer.check_replicas()
    error = raised.value
    # The first array of the state that differs (the step counter is still equal).
    assert error.path == "params/Dense_0/bias"
    assert error.device == DEVICES[2] and error.reference == DEVICES[0]
    assert str(error).startswith(
        f"replica mismatch: params/Dense_0/bias float32[2] differs on device {DEVICES[2]} "
        f"(process 0) from device {DEVICES[0]}: fingerprint "
    )


def test_a_corrupted_shard_of_a_replicated_parameter_is_named():
    trainer = make_trainer()
    loopax.Loop(trainer).run_steps(make_data(), 2)
    assert trainer.check_replicas() > 0
    # One device's copy of the kernel altered in one element by one unit in the last place.
    placed = trainer._placed.device_state  # the arrays the compiled step runs on
    kernel = placed.params["Dense_1"]["kernel"]
    copies = []
    for shard in sorted(kernel.addressable_shards, key=lambda s: DEVICES.index(s.device)):
        value = np.array(shard.data)
        if shard.device == DEVICES[3]:
            value[1, 0] = np.nextafter(value[1, 0], np.float32(np.inf))
        copies.append(jax.device_put(value, shard.device))
    corrupted = jax.make_array_from_single_device_arrays(kernel.shape, kernel.sharding, copies)
    params = {**placed.params, "Dense_1": {**placed.params["Dense_1"], "kernel": corrupted}}
    trainer._placed.device_state = placed.replace(params=params)
    with pytest.raises(loopax.ReplicaMismatchError) as raised:
        trainer.check_replicas()
    # (Flax numbers the outer Dense first: Dense_1 is the (4, 8) kernel.)
    assert raised.value.path == "params/Dense_1/kernel" and raised.value.device == DEVICES[3]
    assert f"params/Dense_1/kernel float32[4, 8] differs on device {DEVICES[3]}" in str(
        raised.value
    )


def test_the_hook_checks_on_its_schedule_and_stops_a_diverged_run():
    trainer = make_trainer(parallel="pmap")
    loop = loopax.Loop(trainer)
    checked = []
    check = trainer.check_replicas

    def counting_check():
        checked.append(trainer.global_step)
        return check()

    trainer.check_replicas = counting_check
    schedule = hooks.check_replicas(loop, every_n_steps=3)
    assert isinstance(schedule, hooks.EveryNSteps)
    loop.run_steps(make_data(), 7)
    assert checked == [3, 6]

    diverging = make_trainer(parallel="pmap")
    diverging.add_per_step_update(drift_on_device_2)
    loop = loopax.Loop(diverging)
    hooks.check_replicas(loop, every_n_steps=3)
    with pytest.raises(loopax.HookError, match="check_replicas") as raised:
        loop.run_steps(make_data(), 7)
    assert isinstance(raised.value.__cause__, loopax.ReplicaMismatchError)
    assert diverging.global_step == 3  # steps 1 and 2 were not checked
    with pytest.raises(ValueError, match="positive int"):
        hooks.check_replicas(loop, every_n_steps=0)
