"""`ArrayDataset(..., on_device=True)`: the host dataset's batches, taken on the devices."""

import gc
import os
import subprocess
import sys
import textwrap
import weakref

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import loopax
from loopax.data import _device_data
from loopax.testing import count_compilations

EXAMPLES = 10


def make_dataset(on_device, batch_size=4, **kwargs):
    inputs = np.arange(EXAMPLES * 3, dtype=np.float32).reshape(EXAMPLES, 3)
    labels = np.arange(EXAMPLES, dtype=np.int32)
    if on_device:
        kwargs.setdefault("devices", jax.devices()[:1])
    return loopax.ArrayDataset(
        [inputs, inputs[:, :1] * 2], labels, batch_size, on_device=on_device, **kwargs
    )


def host_arrays(batch):
    spec, inputs, labels = batch
    return spec, [np.asarray(a) for a in inputs], [np.asarray(a) for a in labels]


def assert_same_batch(actual, expected):
    actual, expected = host_arrays(actual), host_arrays(expected)
    assert actual[0] == expected[0]
    for got, want in zip(actual[1] + actual[2], expected[1] + expected[2], strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def read_all(dataset, reader="yield_batch", *args):
    batches = []
    while True:
        try:
            batches.append(getattr(dataset, reader)(*args))
        except StopIteration:
            return batches


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_remainder", [True, False])
def test_same_batches_as_host_over_epochs(shuffle, drop_remainder):
    options = {"shuffle": shuffle, "drop_remainder": drop_remainder, "seed": 3}
    host, device = make_dataset(False, **options), make_dataset(True, **options)
    for _ in range(3):  # reset() starts each epoch with its own permutation
        expected = read_all(host)
        actual = read_all(device)
        assert len(actual) == len(expected) == (2 if drop_remainder else 3)
        for got, want in zip(actual, expected, strict=True):
            assert isinstance(got[1][0], jax.Array)
            assert_same_batch(got, want)
        host.reset()
        device.reset()


@pytest.mark.parametrize("drop_remainder", [True, False])
def test_same_batches_as_host_looping_forever(drop_remainder):
    options = {"loop_forever": True, "drop_remainder": drop_remainder, "seed": 5}
    host, device = make_dataset(False, **options), make_dataset(True, **options)
    epochs = []
    for _ in range(10):  # four epochs and more, crossing epoch ends
        assert_same_batch(device.yield_batch(), host.yield_batch())
        epochs.append(device.get_state()["epoch"])
        assert device.get_state() == host.get_state()
    assert epochs[-1] >= 3


@pytest.mark.parametrize("on_device", [False, True])
def test_yield_batches_equals_stacked_yield_batch(on_device):
    options = {"loop_forever": True, "drop_remainder": False, "batch_size": 3}
    grouped, single = make_dataset(on_device, **options), make_dataset(on_device, **options)
    leading = []
    for _ in range(8):
        spec, inputs, labels = grouped.yield_batches(2)
        count = inputs[0].shape[0]
        leading.append(count)
        batches = [host_arrays(single.yield_batch()) for _ in range(count)]
        stacked = (
            batches[0][0],
            [np.stack([b[1][i] for b in batches]) for i in range(2)],
            [np.stack([b[2][0] for b in batches])],
        )
        assert_same_batch((spec, inputs, labels), stacked)
        assert grouped.get_state() == single.get_state()
    # Per epoch of 3 + 3 + 3 + 1 examples: two batches, then one before the smaller last
    # batch, which comes alone.
    assert leading == [2, 1, 1] * 2 + [2, 1]


@pytest.mark.parametrize("on_device", [False, True])
def test_yield_batches_partial_group_then_stop(on_device):
    dataset = make_dataset(on_device, batch_size=3)  # drop_remainder: 3 batches per epoch
    groups = read_all(dataset, "yield_batches", 2)
    assert [group[1][0].shape for group in groups] == [(2, 3, 3), (1, 3, 3)]
    assert [group[2][0].shape for group in groups] == [(2, 3), (1, 3)]
    with pytest.raises(StopIteration):
        dataset.yield_batch()
    dataset.reset()
    assert dataset.yield_batches(5)[1][0].shape == (3, 3, 3)


@pytest.mark.parametrize("on_device", [False, True])
def test_yield_batches_same_as_host(on_device):
    host = make_dataset(False, batch_size=2, loop_forever=True, seed=1)
    other = make_dataset(on_device, batch_size=2, loop_forever=True, seed=1)
    for count in (3, 1, 4, 2, 5, 5):
        assert_same_batch(other.yield_batches(count), host.yield_batches(count))


@pytest.mark.parametrize("on_device", [False, True])
def test_set_state_mid_epoch_resumes_exactly(on_device):
    options = {"loop_forever": True, "seed": 7, "batch_size": 3}
    original = make_dataset(on_device, **options)
    for _ in range(4):  # into the second epoch
        original.yield_batch()
    state = original.get_state()
    assert state["epoch"] == 1 and state["position"] == 3
    restored = make_dataset(on_device, **options)
    restored.set_state(state)
    for _ in range(5):
        assert_same_batch(restored.yield_batch(), original.yield_batch())
    assert_same_batch(restored.yield_batches(3), original.yield_batches(3))


def test_no_transfer_or_compilation_per_batch(monkeypatch):
    dataset = make_dataset(True, batch_size=2, shuffle=True, loop_forever=True)
    dataset.yield_batch()  # compiles the gather of one batch
    dataset.yield_batches(2)  # and of two stacked
    puts = []
    real_device_put = jax.device_put

    def counting_device_put(*args, **kwargs):
        puts.append(args)
        return real_device_put(*args, **kwargs)

    monkeypatch.setattr(jax, "device_put", counting_device_put)
    with count_compilations() as compilations:
        dataset.yield_batch()
        dataset.yield_batch()  # the last of this epoch's 5
    assert compilations.count == 0
    assert puts == []
    # A new epoch puts its permutation on the devices, once; its batches compile nothing.
    with count_compilations() as compilations:
        dataset.yield_batches(2)
        for _ in range(3):
            dataset.yield_batch()
    assert compilations.count == 0
    assert len(puts) == 1 and np.shape(puts[0][0]) == (EXAMPLES,)


def test_batches_split_over_devices_like_the_trainer_takes_them():
    devices = jax.devices()
    dataset = make_dataset(True, batch_size=4, devices=devices, drop_remainder=False)
    _, inputs, _ = dataset.yield_batch()
    assert inputs[0].sharding.spec == jax.sharding.PartitionSpec("devices")
    _, inputs, _ = dataset.yield_batches(1)
    assert inputs[0].sharding.spec == jax.sharding.PartitionSpec(None, "devices")
    _, inputs, _ = dataset.yield_batch()  # 2 examples left: not divisible, so replicated
    assert inputs[0].shape == (2, 3)
    assert inputs[0].sharding.is_fully_replicated
    assert repr(dataset) == (
        "ArrayDataset(name='array', examples=10, batch_size=4, on_device=True)"
    )
    assert dataset.on_device and not make_dataset(False).on_device


def model_fn(ctx, spec, inputs):
    return nn.Dense(1)(inputs[0])


def regression_dataset(on_device, devices):
    rng = np.random.default_rng(0)
    inputs = rng.normal(size=(48, 3)).astype(np.float32)
    labels = inputs @ np.array([[1.0], [-2.0], [0.5]], np.float32)
    return loopax.ArrayDataset(
        inputs,
        labels,
        batch_size=8,
        loop_forever=True,
        seed=2,
        on_device=on_device,
        devices=devices if on_device else None,
    )


def regression_trainer(devices, accumulate_steps=1):
    return loopax.Trainer(
        model_fn,
        loopax.losses.mean_squared_error,
        optax.sgd(0.05),
        devices=devices,
        accumulate_steps=accumulate_steps,
    )


def train(on_device, devices, steps=15, accumulate_steps=1):
    trainer = regression_trainer(devices, accumulate_steps)
    loop = loopax.Loop(trainer)
    dataset = regression_dataset(on_device, devices)
    metrics = loop.run_steps(dataset, steps)
    return jax.device_get(trainer.params), float(metrics["loss"]), dataset.get_state()


@pytest.mark.parametrize(("num_devices", "accumulate_steps"), [(1, 1), (4, 1), (4, 2)])
def test_training_matches_host_dataset(num_devices, accumulate_steps):
    devices = jax.devices()[:num_devices]
    host_params, host_loss, host_state = train(False, devices, accumulate_steps=accumulate_steps)
    params, loss, state = train(True, devices, accumulate_steps=accumulate_steps)
    assert state == host_state
    assert loss == host_loss
    jax.tree.map(np.testing.assert_array_equal, params, host_params)


@pytest.mark.parametrize(("examples", "accumulate_steps"), [(40, 2), (40, 3), (20, 4)])
def test_accumulated_micro_batches_across_epoch_ends_match_host_dataset(
    monkeypatch, examples, accumulate_steps
):
    # A step's micro-batches come from one gather where they lie in one epoch; a step an
    # epoch's end cuts (5 batches of 8 an epoch, 2 or 3 a step; 20 examples: 2 batches
    # an epoch, 4 a step) takes the rest from the next epoch, as yield_batch does.
    gathers = []
    real_gather = _device_data.DeviceArrays.gather

    def counting_gather(self, start, count, size, stacked, epoch=None):
        gathers.append(count)
        return real_gather(self, start, count, size, stacked, epoch)

    monkeypatch.setattr(_device_data.DeviceArrays, "gather", counting_gather)
    devices = jax.devices()[:4]
    rng = np.random.default_rng(1)
    inputs = rng.normal(size=(examples, 3)).astype(np.float32)
    labels = inputs @ np.array([[1.0], [-2.0], [0.5]], np.float32)
    results = []
    for on_device in (False, True):
        trainer = regression_trainer(devices, accumulate_steps)
        dataset = loopax.ArrayDataset(
            inputs,
            labels,
            batch_size=8,
            loop_forever=True,
            seed=3,
            on_device=on_device,
            devices=devices if on_device else None,
        )
        loss = loopax.Loop(trainer).run_steps(dataset, 10)["loss"]
        results.append((jax.device_get(trainer.params), float(loss), dataset.get_state()))
    (host_params, host_loss, host_state), (params, loss, state) = results
    assert state == host_state and loss == host_loss
    jax.tree.map(np.testing.assert_array_equal, params, host_params)
    # One gather per step and epoch it reads: not one per micro-batch.
    per_epoch = examples // 8
    pieces = [
        len(
            {
                batch // per_epoch
                for batch in range(step * accumulate_steps, (step + 1) * accumulate_steps)
            }
        )
        for step in range(10)
    ]
    assert len(gathers) == sum(pieces) < sum(gathers) == 10 * accumulate_steps


def test_accumulating_a_smaller_last_batch_fails_as_on_the_host():
    devices = jax.devices()[:1]
    inputs = np.arange(EXAMPLES * 3, dtype=np.float32).reshape(EXAMPLES, 3)
    errors = []
    for on_device in (False, True):
        trainer = regression_trainer(devices, accumulate_steps=2)
        # 10 examples in batches of 4: the third has 2, which the second step cannot stack
        # with the next epoch's first.
        dataset = loopax.ArrayDataset(
            inputs,
            inputs[:, :1],
            4,
            drop_remainder=False,
            loop_forever=True,
            on_device=on_device,
            devices=devices if on_device else None,
        )
        with pytest.raises(RuntimeError, match="micro-batch 1 has spec") as raised:
            loopax.Loop(trainer).run_steps(dataset, 3)
        errors.append(str(raised.value))
    assert errors[0] == errors[1]


# Run in a child process: several CPU devices whose steps are held (each waits for `go`)
# while the Loop dispatches on. Where the host thread then waits says what bounds the
# queue: the Loop's in-flight bound (`_inflight.py:push`), or XLA's cap on a device's
# unfinished computations (its launch blocking inside a program's call). On a machine with
# no more cores than devices the latter deadlocked a collective and XLA aborted the worker
# (`limit_for`); the child's thread pool is made larger than that here, so that the held
# steps leave threads to launch programs on and the child only reports where it waited.
HELD_STEPS_CHILD = textwrap.dedent("""
    import os, sys, threading, time, traceback
    import flax.linen as nn, jax, numpy as np, optax
    import loopax

    go = threading.Event()
    go.set()

    def model_fn(ctx, spec, inputs):
        out = nn.Dense(1)(inputs[0])
        jax.debug.callback(lambda _: go.wait(), out)  # holds the step on every device
        return out

    devices = jax.devices()[:4]
    x = np.random.default_rng(0).normal(size=(48, 3)).astype(np.float32)
    dataset = loopax.ArrayDataset(x, x[:, :1], batch_size=8, loop_forever=True, seed=2,
                                  on_device=True, devices=devices)
    trainer = loopax.Trainer(model_fn, loopax.losses.mean_squared_error, optax.sgd(0.05),
                             devices=devices, accumulate_steps=int(sys.argv[1]))
    loop = loopax.Loop(trainer)
    loop.run_steps(dataset, 8)  # compiles every program the run below takes
    main, waited = threading.main_thread().ident, []

    def watch():  # the host thread's stack, once unchanged for 2 s: it waits there
        last, since = None, time.monotonic()
        while not waited:
            time.sleep(0.05)
            stack = traceback.extract_stack(sys._current_frames()[main])
            frames = [(frame.filename, frame.lineno) for frame in stack]
            if frames != last:
                last, since = frames, time.monotonic()
            elif time.monotonic() - since > 2:
                waited.append(f"{os.path.basename(stack[-1].filename)}:{stack[-1].name}")
        go.set()

    go.clear()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    loop.run_steps(dataset, 40)
    watcher.join()
    print("host waited in", waited[0])
""")


@pytest.mark.cpu_devices
@pytest.mark.parametrize("accumulate_steps", [2, 4])
def test_held_steps_stop_the_host_at_the_loops_bound_not_xlas_cap(accumulate_steps):
    env = dict(os.environ)
    # A deadlock, were there one, aborts in seconds rather than after XLA's 40.
    env["XLA_FLAGS"] = (
        "--xla_force_host_platform_device_count=4 "
        "--xla_cpu_collective_call_warn_stuck_timeout_seconds=10 "
        "--xla_cpu_collective_call_terminate_timeout_seconds=20"
    )
    env["PJRT_NPROC"] = "16"  # XLA's CPU thread pool: more threads than devices
    done = subprocess.run(
        [sys.executable, "-c", HELD_STEPS_CHILD, str(accumulate_steps)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "host waited in _inflight.py:push", done.stdout


@pytest.mark.parametrize("num_devices", [1, 4])
def test_fused_steps_match_host_dataset(num_devices):
    devices = jax.devices()[:num_devices]
    results = []
    for on_device in (False, True):
        trainer = loopax.Trainer(
            model_fn, loopax.losses.mean_squared_error, optax.sgd(0.05), devices=devices
        )
        dataset = regression_dataset(on_device, devices)
        trainer.train_step(*dataset.yield_batch())
        for _ in range(3):
            trainer.train_steps(*dataset.yield_batches(4))
        results.append(jax.device_get(trainer.params))
    jax.tree.map(np.testing.assert_array_equal, *results)


@pytest.mark.parametrize(("num_devices", "batch_size"), [(1, 5), (4, 8)])
def test_evaluation_matches_host_dataset(num_devices, batch_size):
    devices = jax.devices()[:num_devices]
    trainer = loopax.Trainer(
        model_fn, loopax.losses.mean_squared_error, optax.sgd(0.05), devices=devices
    )
    loop = loopax.Loop(trainer)
    loop.run_steps(regression_dataset(True, devices), 3)
    source = regression_dataset(False, devices)
    results = [
        loop.evaluate(
            loopax.ArrayDataset(
                source.inputs,
                source.labels,
                batch_size,
                name="test",
                shuffle=False,
                drop_remainder=False,
                on_device=on_device,
                devices=devices if on_device else None,
            )
        ).values
        for on_device in (False, True)
    ]
    assert results[0] == results[1]


def test_bad_arguments():
    data = np.zeros((4, 2), np.float32)
    with pytest.raises(ValueError, match="without on_device=True"):
        loopax.ArrayDataset(data, (), 2, devices=jax.devices())
    with pytest.raises(ValueError, match=r"devices=\[\]"):
        loopax.ArrayDataset(data, (), 2, on_device=True, devices=[])
    with pytest.raises(ValueError, match=r"devices\[0\] is a str, not a jax device"):
        loopax.ArrayDataset(data, (), 2, on_device=True, devices=["cpu"])
    dataset = loopax.ArrayDataset(data, (), 2, on_device=True)
    for count in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="yield_batches needs a count >= 1"):
            dataset.yield_batches(count)  # type: ignore[arg-type]
    # The host dataset's checks hold on the device too.
    with pytest.raises(ValueError, match="batch_size 5 is larger"):
        loopax.ArrayDataset(data, (), 5, on_device=True)


def count_copies(monkeypatch):
    """The orders of the epochs' permuted copies made from now on, one per copy.

    Each entry also keeps a weak reference to its copy's first array.
    """
    copies = []
    make = _device_data.permuted_copy

    def counting(inputs, labels, order, sharding):
        copy = make(inputs, labels, order, sharding)
        copies.append((np.asarray(order), weakref.ref(copy[0][0])))
        return copy

    monkeypatch.setattr(_device_data, "permuted_copy", counting)
    return copies


def permutation(seed, epoch):
    """Epoch `epoch`'s order, as ArrayDataset documents it: drawn from `(seed, epoch)`."""
    return np.random.default_rng((seed, epoch)).permutation(EXAMPLES)


def test_each_shuffled_epoch_is_permuted_once_into_a_copy(monkeypatch):
    copies = count_copies(monkeypatch)
    options = {"loop_forever": True, "seed": 4, "batch_size": 3, "drop_remainder": False}
    host, device = make_dataset(False, **options), make_dataset(True, **options)
    assert copies == []  # the first epoch is permuted when its first batch is read
    for count in (1, 2, 1, 3, 1, 2, 2, 1, 1, 3):  # epochs of batches of 3, 3, 3 and 1
        if count == 1:
            assert_same_batch(device.yield_batch(), host.yield_batch())
        else:
            assert_same_batch(device.yield_batches(count), host.yield_batches(count))
        assert device.get_state() == host.get_state()
    epochs = device.get_state()["epoch"] + 1
    assert epochs >= 3
    assert len(copies) == epochs  # one gather of the whole epoch, however its batches are read
    for epoch, (order, _) in enumerate(copies):
        np.testing.assert_array_equal(order, permutation(4, epoch))
    # The previous epochs' copies are replaced, not kept: only the current one lives.
    gc.collect()
    assert [alive() is not None for _, alive in copies] == [False] * (epochs - 1) + [True]


@pytest.mark.parametrize("options", [{"shuffled_copy": False}, {"shuffle": False}])
def test_no_copy_without_shuffling_or_with_shuffled_copy_false(monkeypatch, options):
    copies = count_copies(monkeypatch)
    options = {"loop_forever": True, "seed": 2, "drop_remainder": False, **options}
    host = make_dataset(False, **{k: v for k, v in options.items() if k != "shuffled_copy"})
    device = make_dataset(True, **options)
    for _ in range(7):  # three epochs and more
        assert_same_batch(device.yield_batch(), host.yield_batch())
    assert_same_batch(device.yield_batches(2), host.yield_batches(2))
    assert copies == []


def test_a_restored_position_permutes_only_its_own_epoch(monkeypatch):
    copies = count_copies(monkeypatch)
    host, device = (make_dataset(on_device, batch_size=3, seed=7) for on_device in (False, True))
    state = {"epoch": 3, "position": 3, "seed": 7}
    host.set_state(state)
    device.set_state(state)  # mid-epoch, before any batch was read: epoch 0 is never copied
    assert copies == []
    for _ in range(2):  # the rest of epoch 3
        assert_same_batch(device.yield_batch(), host.yield_batch())
    assert [order.tolist() for order, _ in copies] == [permutation(7, 3).tolist()]
    with pytest.raises(StopIteration):
        device.yield_batch()
    device.reset()  # the next epoch starts; nothing is copied until it is read
    host.reset()
    assert len(copies) == 1
    assert_same_batch(device.yield_batches(3), host.yield_batches(3))
    assert [order.tolist() for order, _ in copies][1:] == [permutation(7, 4).tolist()]


def test_shuffled_copy_needs_on_device():
    data = np.zeros((4, 2), np.float32)
    with pytest.raises(ValueError, match=r"'array' got shuffled_copy=False without on_device=True"):
        loopax.ArrayDataset(data, (), 2, shuffled_copy=False)
    loopax.ArrayDataset(data, (), 2, shuffled_copy=True)  # the default, harmless


@pytest.mark.parametrize("num_devices", [1, 4])
def test_evaluation_on_a_shuffled_copy_matches_the_host_dataset(monkeypatch, num_devices):
    copies = count_copies(monkeypatch)
    devices = jax.devices()[:num_devices]
    trainer = loopax.Trainer(
        model_fn, loopax.losses.mean_squared_error, optax.sgd(0.05), devices=devices
    )
    loopax.Loop(trainer).run_steps(regression_dataset(False, devices), 3)
    source = regression_dataset(False, devices)

    def evaluation(on_device):
        dataset = loopax.ArrayDataset(
            source.inputs,
            source.labels,
            10,  # 48 examples: a short last batch, which 4 devices do not divide
            name="test",
            seed=5,
            drop_remainder=False,
            on_device=on_device,
            devices=devices if on_device else None,
        )
        return [trainer.evaluate(dataset) for _ in range(2)]  # each a new epoch

    assert evaluation(True) == evaluation(False)
    assert len(copies) == 2  # one permuted copy per evaluation
