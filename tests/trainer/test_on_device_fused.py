"""Fused steps on an on-device `ArrayDataset`: the Trainer's program gathers the batches.

With `Loop(trainer, steps_per_execution=K)` and `ArrayDataset(..., on_device=True)` on the
Trainer's devices, a group of steps is one dispatch: the loop hands the Trainer where the
batches lie (`DeviceChunk`) and the compiled steps gather them from the epoch's permutation,
across an epoch's end too. Everything must equal single steps on the host dataset.
"""

import gc
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hlo_helpers import loop_bodies

import loopax
from loopax.data import _device_data
from loopax.data._reader import OnDevice
from loopax.testing import count_compilations

EXAMPLES = 52


def model_fn(ctx, spec, inputs):
    return nn.Dense(1)(jnp.concatenate(inputs, axis=-1))


def dataset(on_device, devices, *, batch_size=8, **kwargs):
    rng = np.random.default_rng(0)
    inputs = rng.normal(size=(EXAMPLES, 3)).astype(np.float32)
    labels = inputs @ np.array([[1.0], [-2.0], [0.5]], np.float32)
    kwargs.setdefault("loop_forever", True)
    return loopax.ArrayDataset(
        [inputs, inputs[:, :1] ** 2],
        labels,
        batch_size,
        seed=3,
        on_device=on_device,
        devices=devices if on_device else None,
        **kwargs,
    )


def new_trainer(devices, parallel="shard_map", accumulate_steps=1):
    return loopax.Trainer(
        model_fn,
        loopax.losses.mean_squared_error,
        optax.adam(0.01),
        devices=devices,
        parallel=parallel,
        accumulate_steps=accumulate_steps,
    )


def run(
    on_device, k, devices, steps=45, epochs=None, parallel="shard_map", accumulate_steps=1, **kw
):
    trainer = new_trainer(devices, parallel, accumulate_steps)
    loop = loopax.Loop(trainer, steps_per_execution=k)
    fired = []
    loopax.hooks.every_n_steps(loop, 7, "every 7", lambda loop, m: fired.append(loop.loop_step))
    losses = []
    loop.on_step("losses", lambda loop, m: losses.extend(np.asarray(loop.group_metrics["loss"])))
    data = dataset(on_device, devices, **kw)
    if epochs is None:
        metrics = loop.run_steps(data, steps)
    else:
        metrics = loop.run_epochs(data, epochs)
    return {
        "params": jax.device_get(trainer.params),
        "loss": float(metrics["loss"]),
        "losses": np.asarray(losses),
        "state": data.get_state(),
        "fired": fired,
        "global_step": trainer.global_step,
    }


def assert_same(actual, expected):
    jax.tree.map(np.testing.assert_array_equal, actual["params"], expected["params"])
    assert actual["loss"] == expected["loss"]
    np.testing.assert_array_equal(actual["losses"], expected["losses"])
    assert actual["state"] == expected["state"]
    assert actual["fired"] == expected["fired"]
    assert actual["global_step"] == expected["global_step"]


@pytest.mark.parametrize("k", [4, 32])
@pytest.mark.parametrize(
    "options",
    [
        {"shuffle": True},
        {"shuffle": False},
        {"shuffle": True, "drop_remainder": False},  # a short last batch every epoch
        {"shuffle": True, "batch_size": 4},  # 13 batches an epoch, odd
        {"shuffle": True, "batch_size": 24},  # 2 batches an epoch: a group spans many
    ],
    ids=["shuffled", "in-order", "short-last-batch", "13-batch-epochs", "2-batch-epochs"],
)
def test_fused_on_device_equals_single_steps_on_the_host(k, options):
    devices = jax.devices()[:1]
    actual = run(True, k, devices, **options)
    # Each step slices its batch inside the scan: bit for bit single steps on CPU.
    assert_same(actual, run(False, 1, devices, **options))
    # Fused steps on host batches (stacked before the scan) may round differently: this
    # model at batch 4 differs by ~3e-8 (see README); the same steps, hooks and positions.
    assert_close(actual, run(False, k, devices, **options))


def assert_close(actual, expected):
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
        actual["params"],
        expected["params"],
    )
    np.testing.assert_allclose(actual["losses"], expected["losses"], rtol=1e-5, atol=1e-7)
    assert actual["state"] == expected["state"]
    assert actual["fired"] == expected["fired"]
    assert actual["global_step"] == expected["global_step"]


@pytest.mark.cpu_devices
@pytest.mark.parametrize("parallel", ["shard_map", "pmap"])
@pytest.mark.parametrize("batch_size", [8, 24])  # 24: 2 batches an epoch, groups span epochs
def test_four_devices(parallel, batch_size):
    devices = jax.devices()[:4]
    expected = run(False, 1, devices, parallel=parallel, batch_size=batch_size)
    for k in (8, 32):
        actual = run(True, k, devices, parallel=parallel, batch_size=batch_size)
        if parallel == "shard_map":  # each device slices its own shard of each step's batch
            assert_same(actual, expected)
        else:  # pmap gathers the group first, then runs the host path's program
            assert_same(actual, run(False, k, devices, parallel=parallel, batch_size=batch_size))
            assert_close(actual, expected)


@pytest.mark.parametrize("num_devices", [1, 4])
def test_with_gradient_accumulation(num_devices):
    # Micro-batches are stacked from gathered batches (the scan does not take them itself).
    devices = jax.devices()[:num_devices]
    expected = run(False, 1, devices, accumulate_steps=2)
    assert_same(run(True, 8, devices, accumulate_steps=2), expected)


def test_an_unhashable_spec():
    devices = jax.devices()[:1]
    expected = run(False, 1, devices, spec={"task": "regression"})
    assert_same(run(True, 8, devices, spec={"task": "regression"}), expected)


def test_run_epochs_on_data_that_ends():
    devices = jax.devices()[:1]
    options = {"loop_forever": False, "drop_remainder": False}
    expected = run(False, 1, devices, epochs=3, **options)
    assert_same(run(True, 32, devices, epochs=3, **options), expected)


def test_a_group_is_one_dispatch_with_no_separate_gather(monkeypatch):
    devices = jax.devices()[:1]
    trainer = new_trainer(devices)
    loop = loopax.Loop(trainer, steps_per_execution=8)
    data = dataset(True, devices)
    loop.run_steps(data, 16)  # creates the state (from one gathered batch) and compiles

    def no_gather(*args, **kwargs):
        raise AssertionError("a batch was gathered outside the compiled steps")

    monkeypatch.setattr(_device_data.DeviceArrays, "gather", no_gather)
    dispatches = []
    original = trainer.run

    def run(dispatch):
        if isinstance(dispatch, OnDevice):
            dispatches.append(dispatch.count)
        return original(dispatch)

    monkeypatch.setattr(trainer, "run", run)
    with count_compilations() as compiled:
        loop.run_steps(data, 64)  # 52 examples, 6 batches an epoch: groups cross epochs
    assert dispatches == [8] * 8
    assert compiled.count == 0, compiled.names


@pytest.mark.parametrize("k", [8, 32])
def test_at_most_log2_k_plus_one_executables(k):
    devices = jax.devices()[:1]
    trainer = new_trainer(devices)
    infos = []
    trainer.on_exec_creation(infos.append)
    loop = loopax.Loop(trainer, steps_per_execution=k)
    loopax.hooks.every_n_steps(loop, 5, "every 5", lambda loop, m: None)
    loop.run_steps(dataset(True, devices, batch_size=4), 200)
    train = [info for info in infos if info.graph_type.startswith("train")]
    assert {info.graph_type for info in train} == {"train_steps"}
    counts = sorted({info.input_shapes[0][0] for info in train})
    assert len(train) == len(counts) <= int(math.log2(k)) + 1
    assert all(count & (count - 1) == 0 and count <= k for count in counts)


@pytest.mark.cpu_devices
@pytest.mark.parametrize("k", [1, 8])
@pytest.mark.parametrize(("held", "used"), [(4, 1), (1, 4)])
def test_data_on_other_devices_is_refused_before_any_step(k, held, used):
    trainer = new_trainer(jax.devices()[:used])
    loop = loopax.Loop(trainer, steps_per_execution=k)
    data = dataset(True, jax.devices()[:held])
    with pytest.raises(ValueError, match=r"holds its arrays on devices .* devices=trainer.devices"):
        loop.run_steps(data, 5)
    with pytest.raises(ValueError, match=r"holds its arrays on devices"):
        loop.run_epochs(data, 1)
    assert trainer.global_step == 0 and data.get_state()["position"] == 0
    # The trainer's own devices work, and evaluation takes data from any devices.
    loop.run_steps(dataset(True, jax.devices()[:used]), 5)
    assert trainer.global_step == 5
    assert np.isfinite(
        trainer.evaluate(
            dataset(True, jax.devices()[:held], loop_forever=False, drop_remainder=False)
        )["mean_loss"]
    )


def test_device_steps_cover_the_batches_of_yield_batch():
    devices = jax.devices()[:1]
    for options in ({}, {"batch_size": 24}, {"drop_remainder": False}, {"shuffle": False}):
        host = dataset(False, devices, **options)
        data = dataset(True, devices, **options)
        for count in (1, 3, 8, 13, 32):
            expected = [host.yield_batch() for _ in range(count)]
            chunks, ended = data.device_steps(count)
            assert not ended
            assert sum(chunk.count for chunk in chunks) == count
            batches = []
            for chunk in chunks:
                arrays = [*chunk.source.inputs, *chunk.source.labels]
                for step in range(chunk.count):
                    rows = _device_data.rows_of(
                        arrays,
                        chunk.order,
                        chunk.next_order,
                        np.int32(chunk.start + step * chunk.size),
                        np.int32(chunk.end),
                        chunk.size,
                    )
                    split = len(chunk.source.inputs)
                    batches.append((rows[:split], rows[split:]))
            for (_, inputs, labels), got in zip(expected, batches, strict=True):
                for want, array in zip(inputs + labels, got[0] + got[1], strict=True):
                    np.testing.assert_array_equal(np.asarray(array), want)
            assert data.get_state() == host.get_state()


def test_device_step_reads_the_batches_of_yield_batch():
    # The per-step Loop's read: one step at a time, across epoch ends, a smaller last batch
    # and an epoch's permuted copy (or its permutation), as `yield_batch` reads them.
    devices = jax.devices()[:1]
    cases = ({}, {"drop_remainder": False}, {"shuffle": False}, {"shuffled_copy": False})
    for options in cases:
        host = dataset(False, devices, **{k: v for k, v in options.items() if k != "shuffled_copy"})
        data = dataset(True, devices, **options)
        for _ in range(20):  # over three epochs
            _, inputs, labels = host.yield_batch()
            chunk = data.device_step()
            assert (chunk.count, chunk.size) == (1, len(labels[0]))
            assert chunk.epoch is chunk.next_epoch
            expected = (
                _device_data.Reading.SLICE
                if not data.shuffle
                else (
                    _device_data.Reading.GATHER
                    if options.get("shuffled_copy") is False
                    else _device_data.Reading.COPY
                )
            )
            assert chunk.reading is expected
            # Read as the step program reads it: a slice of the copy, else through the order.
            source = chunk.epoch.copy or (chunk.source.inputs, chunk.source.labels)
            rows = _device_data.rows_of(
                [*source[0], *source[1]],
                None if chunk.epoch.copy else chunk.order,
                None if chunk.epoch.copy else chunk.order,
                np.int32(chunk.start),
                np.int32(chunk.end),
                chunk.size,
            )
            for want, array in zip(inputs + labels, rows, strict=True):
                np.testing.assert_array_equal(np.asarray(array), want)
            assert data.get_state() == host.get_state()


def test_device_step_at_the_end_of_data_that_does_not_loop():
    data = dataset(True, jax.devices()[:1], loop_forever=False, drop_remainder=False)
    sizes = [data.device_step().size for _ in range(7)]
    assert sizes == [8] * 6 + [4]  # 52 examples
    with pytest.raises(StopIteration):
        data.device_step()


def test_device_steps_at_the_end_of_data_that_does_not_loop():
    data = dataset(True, jax.devices()[:1], loop_forever=False)  # 6 batches
    chunks, ended = data.device_steps(4)
    assert [c.count for c in chunks] == [4] and not ended
    chunks, ended = data.device_steps(4)
    assert [c.count for c in chunks] == [2] and ended
    with pytest.raises(StopIteration):
        data.device_steps(4)


def test_resume_from_a_checkpoint_continues_identically(tmp_path):
    devices = jax.devices()[:1]
    expected = run(False, 1, devices, steps=40)

    def resumed(steps):
        trainer = new_trainer(devices)
        loop = loopax.Loop(trainer, steps_per_execution=32)
        loopax.hooks.checkpoint(loop, str(tmp_path / "ckpt"), every_n_steps=10)
        data = dataset(True, devices)
        loop.run_steps(data, steps)
        return trainer, data

    resumed(25)  # saves at 10, 20 and the end (25)
    trainer, data = resumed(15)  # restores at 25, runs to 40
    assert trainer.global_step == 40
    assert data.get_state() == expected["state"]
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(trainer.params), expected["params"])


@pytest.mark.parametrize("k", [1, 8])
def test_a_nan_in_the_data_is_named_at_its_own_step(k):
    devices = jax.devices()[:1]
    data = dataset(True, devices, shuffle=False)
    poisoned = np.asarray(data.inputs[0]).copy()
    poisoned[42] = np.nan  # batch 5 of each 6-batch epoch: loop steps 5, 11, ...
    data = loopax.ArrayDataset(
        [poisoned, np.asarray(data.inputs[1])],
        data.labels,
        8,
        shuffle=False,
        loop_forever=True,
        on_device=True,
        devices=devices,
    )
    loop = loopax.Loop(new_trainer(devices), steps_per_execution=k)
    with pytest.raises(loopax.NonFiniteLossError) as raised:
        loop.run_steps(data, 40)
    assert raised.value.step == 5


def count_copies(monkeypatch):
    """The orders of the epochs' permuted copies made from now on, one per copy."""
    copies = []
    make = _device_data.permuted_copy

    def counting(inputs, labels, order, sharding):
        copies.append(np.asarray(order))
        return make(inputs, labels, order, sharding)

    monkeypatch.setattr(_device_data, "permuted_copy", counting)
    return copies


def record_orders(monkeypatch):
    """The epoch permutations put on the devices from now on, in order."""
    orders = []
    put = _device_data.DeviceArrays.set_order

    def recording(self, order):
        if order is not None:
            orders.append(np.asarray(order))
        return put(self, order)

    monkeypatch.setattr(_device_data.DeviceArrays, "set_order", recording)
    return orders


def train_programs(trainer):
    """The HLO text of every compiled train program of `trainer`."""
    return [e.run.as_text() for e in trainer.executors() if e.info.graph_type == "train_steps"]


@pytest.mark.parametrize(
    ("num_devices", "parallel"), [(1, "shard_map"), (4, "shard_map"), (4, "pmap")]
)
@pytest.mark.parametrize("batch_size", [8, 24])  # 24: 2 batches an epoch, chunks span epochs
def test_fused_steps_read_their_groups_through_the_permutation(
    monkeypatch, num_devices, parallel, batch_size
):
    devices = jax.devices()[:num_devices]
    expected = run(False, 1, devices, steps=64, parallel=parallel, batch_size=batch_size)
    copies = count_copies(monkeypatch)
    trainer = new_trainer(devices, parallel)
    loop = loopax.Loop(trainer, steps_per_execution=8)
    data = dataset(True, devices, batch_size=batch_size)
    metrics = loop.run_steps(data, 64)
    params = jax.device_get(trainer.params)
    if parallel == "shard_map":  # each step slices its shard in the scan: bit for bit
        jax.tree.map(np.testing.assert_array_equal, params, expected["params"])
        assert float(metrics["loss"]) == expected["loss"]
    else:  # pmap takes the group first, then runs the stacked steps: to float rounding
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
            params,
            expected["params"],
        )
    assert data.get_state() == expected["state"]
    # A group reads all its rows by one gather through the epoch's permutation before its
    # steps, so no epoch's permuted copy is made (a gather of the whole epoch, and the data's
    # memory again, that fused runs measured slower with: docs/benchmarks.md).
    assert data.get_state()["epoch"] + 1 == (11 if batch_size == 8 else 32)
    assert copies == []
    # Each step slices its batch from the group's rows: no gather is compiled into the
    # steps' loop.
    bodies = [body for text in train_programs(trainer) for body in loop_bodies(text)]
    assert bodies and not any(body["gathers"] for body in bodies)


def test_shuffled_copy_false_gathers_each_batch_in_the_steps(monkeypatch):
    copies = count_copies(monkeypatch)
    devices = jax.devices()[:1]
    expected = run(False, 1, devices, steps=20)
    actual = run(True, 8, devices, steps=20, shuffled_copy=False)
    assert_same(actual, expected)
    assert copies == []
    trainer = new_trainer(devices)
    loopax.Loop(trainer, steps_per_execution=8).run_steps(
        dataset(True, devices, shuffled_copy=False), 8
    )
    assert all(" gather(" in text for text in train_programs(trainer))


def test_a_resume_mid_epoch_permutes_the_restored_epoch(tmp_path, monkeypatch):
    devices = jax.devices()[:1]
    expected = run(False, 1, devices, steps=40)

    def resumed(steps):
        trainer = new_trainer(devices)
        loop = loopax.Loop(trainer, steps_per_execution=32)
        loopax.hooks.checkpoint(loop, str(tmp_path / "ckpt"), every_n_steps=10)
        data = dataset(True, devices)
        loop.run_steps(data, steps)
        return trainer, data

    resumed(25)  # ends at step 25: epoch 4, one batch into its 6
    gc.collect()
    orders = record_orders(monkeypatch)
    trainer, data = resumed(15)  # restores at 25, runs to 40: epochs 4 (its rest), 5, 6
    # Epoch 0's at construction, then the restored epoch 4's and the two after it.
    assert [order.tolist() for order in orders] == [
        np.random.default_rng((3, epoch)).permutation(52).tolist() for epoch in (0, 4, 5, 6)
    ]
    assert data.get_state() == expected["state"]
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(trainer.params), expected["params"])


@pytest.mark.parametrize("batch_size", [8, 24])
def test_fused_groups_join_each_pair_of_epochs_orders_once(monkeypatch, batch_size):
    # A group's examples are a slice of its epoch's permutation joined with the next
    # epoch's: joined on the devices once for the groups within an epoch and once for a
    # group crossing into the next, not per group, and the run's batches are still the
    # per-step run's (the documented permutation of each epoch).
    joins = []
    join = _device_data.joined_orders

    def counting(order, next_order, end, sharding):
        joins.append((np.asarray(order).tolist(), np.asarray(next_order).tolist(), end))
        return join(order, next_order, end, sharding)

    monkeypatch.setattr(_device_data, "joined_orders", counting)
    devices = jax.devices()[:1]
    expected = run(False, 1, devices, steps=48, batch_size=batch_size)
    actual = run(True, 8, devices, steps=48, batch_size=batch_size)
    assert_same(actual, expected)
    epochs = actual["state"]["epoch"] + 1
    assert joins and len(joins) <= 2 * epochs
    assert len({str(j) for j in joins}) == len(joins)  # no pair joined twice
    end = EXAMPLES - EXAMPLES % batch_size
    for order, next_order, at in joins:
        assert at == end
        assert sorted(order) == sorted(next_order) == list(range(EXAMPLES))
