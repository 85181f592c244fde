"""A run's steady state on an on-device dataset: no copy from the host, nothing compiled.

On an accelerator each host-to-device copy inside a run is a transfer and a stream wait,
and each call that leaves JAX's C++ fast path costs tens of microseconds; a CPU run shows
neither in its timings, so these tests guard the causes: after warm-up, steps per step and
fused steps make no host-to-device (or device-to-device) transfer, compile nothing, lower
nothing and never take JAX's Python path.
"""

import contextlib

import flax.linen as nn
import jax
import jax._src.test_util as jax_test_util
import numpy as np
import optax
import pytest

import loopax
from loopax.testing import count_compilations

EXAMPLES = 256
BATCH = 8  # 32 batches an epoch


def model_fn(ctx, spec, inputs):
    return nn.Dense(1)(inputs[0])


def dataset(**kwargs):
    rng = np.random.default_rng(0)
    inputs = rng.normal(size=(EXAMPLES, 3)).astype(np.float32)
    labels = inputs[:, :1] * 2.0 - inputs[:, 1:2]
    return loopax.ArrayDataset(
        inputs, labels, BATCH, seed=1, loop_forever=True, on_device=True, **kwargs
    )


def new_loop(k):
    trainer = loopax.Trainer(model_fn, loopax.losses.mean_squared_error, optax.adam(0.01))
    return loopax.Loop(trainer, steps_per_execution=k)


@contextlib.contextmanager
def steady_state():
    """Fails a transfer to the devices; counts compilations, lowerings, Python-path calls."""
    counters = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(jax.transfer_guard_host_to_device("disallow"))
        stack.enter_context(jax.transfer_guard_device_to_device("disallow"))
        counters["compilations"] = stack.enter_context(count_compilations())
        counters["lowerings"] = stack.enter_context(jax_test_util.count_jit_and_pmap_lowerings())
        counters["jit python path"] = stack.enter_context(jax_test_util.count_pjit_cpp_cache_miss())
        counters["compiled python path"] = stack.enter_context(
            jax_test_util.count_aot_jit_cpp_cache_miss()
        )
        yield counters


def counts(counters):
    return {
        name: counter.count if name == "compilations" else counter()
        for name, counter in counters.items()
    }


NOTHING = {"compilations": 0, "lowerings": 0, "jit python path": 0, "compiled python path": 0}


@pytest.mark.parametrize("k", [1, 8])
@pytest.mark.parametrize(
    "options",
    [{"shuffle": True}, {"shuffle": True, "shuffled_copy": False}],
    ids=["permuted copy", "gathered rows"],
)
def test_steps_within_an_epoch_copy_nothing_to_the_devices(k, options):
    loop = new_loop(k)
    data = dataset(**options)
    loop.run_steps(data, 8)  # warm-up: compiles, the epoch's permutation (and its copy)
    with steady_state() as counters:
        loop.run_steps(data, 16)  # steps 9-24 of the 32 of the first epoch
    assert counts(counters) == NOTHING
    assert data.get_state()["epoch"] == 0 and loop.trainer.global_step == 24


@pytest.mark.parametrize("k", [1, 8])
def test_steps_across_epochs_in_order_copy_nothing_to_the_devices(k):
    # In order, an epoch's end brings no new permutation: several epochs run untouched,
    # fused groups reading across an epoch's end included (35 is no multiple of 8).
    loop = new_loop(k)
    data = dataset(shuffle=False)
    loop.run_steps(data, 35)
    with steady_state() as counters:
        loop.run_steps(data, 96)
    assert counts(counters) == NOTHING
    assert data.get_state()["epoch"] == 4


@pytest.mark.parametrize(
    "options",
    [{"shuffle": True}, {"shuffle": True, "shuffled_copy": False}, {"shuffle": False}],
    ids=["permuted copy", "gathered rows", "in order"],
)
def test_a_per_step_run_on_device_makes_one_program_call_a_step(options):
    # On an accelerator each call of a compiled program is host time and kernel launches:
    # a step's program reads its own batch from the devices' arrays (no gather program
    # before it, through the dataset's `yield_batch`), as fused groups do.
    loop = new_loop(1)
    data = dataset(**options)
    loop.run_steps(data, 8)  # warm-up: compiles
    calls = {"programs": 0, "dataset reads": 0}

    def counted(run):
        def counting(*args):
            calls["programs"] += 1
            return run(*args)

        return counting

    for executor in loop.trainer.executors():
        executor.run = counted(executor.run)
    yield_batch = data.yield_batch

    def read():
        calls["dataset reads"] += 1
        return yield_batch()

    data.yield_batch = read
    loop.run_steps(data, 16)  # steps 9-24, within the first epoch
    assert calls == {"programs": 16, "dataset reads": 0}
    assert loop.trainer.global_step == 24 and data.get_state()["position"] == 24 * BATCH


def test_a_copy_from_the_host_inside_a_run_is_what_the_guard_catches():
    # The check can fail: a batch from host numpy arrays is a copy to the devices.
    loop = new_loop(1)
    host = loopax.ArrayDataset(
        np.ones((EXAMPLES, 3), np.float32), np.ones((EXAMPLES, 1), np.float32), BATCH
    )
    loop.run_steps(host, 2)
    with pytest.raises(Exception, match="host-to-device"), steady_state():
        loop.run_steps(host, 1)


def test_per_step_and_fused_runs_on_device_equal_the_host_dataset_after_epochs():
    # The positions the programs carry on the devices are the host's: the same batches.
    def train(k, on_device):
        loop = new_loop(k)
        rng = np.random.default_rng(0)
        inputs = rng.normal(size=(EXAMPLES, 3)).astype(np.float32)
        data = loopax.ArrayDataset(
            inputs, inputs[:, :1], BATCH, seed=4, loop_forever=True, on_device=on_device
        )
        loop.run_steps(data, 37)
        data.set_state(data.get_state())  # a restore: the position comes from the host
        loop.run_steps(data, 40)
        return jax.device_get(loop.trainer.params), data.get_state()

    host_params, host_state = train(1, False)
    for k, on_device in [(1, True), (8, True)]:
        params, state = train(k, on_device)
        assert state == host_state
        jax.tree.map(np.testing.assert_array_equal, params, host_params)


@pytest.mark.parametrize(
    "options",
    [{"shuffle": True}, {"shuffle": True, "shuffled_copy": False}, {"shuffle": False}],
    ids=["permuted copy", "gathered rows", "in order"],
)
def test_per_step_runs_on_device_equal_the_host_dataset_with_a_short_last_batch(options):
    # Each step's program reads its own batch however the epoch lies, the short last
    # batch of an epoch (another program) included: the host dataset's steps, bit for bit.
    def train(on_device):
        loop = new_loop(1)
        rng = np.random.default_rng(1)
        inputs = rng.normal(size=(EXAMPLES + 4, 3)).astype(np.float32)
        host_options = {k: v for k, v in options.items() if k != "shuffled_copy"}
        data = loopax.ArrayDataset(
            inputs,
            inputs[:, :1] * 0.5,
            BATCH,
            seed=6,
            loop_forever=True,
            drop_remainder=False,
            on_device=on_device,
            **(options if on_device else host_options),
        )
        metrics = loop.run_steps(data, 70)  # two epochs of 33 batches, and 4 steps
        return jax.device_get(loop.trainer.params), float(metrics["loss"]), data.get_state()

    host_params, host_loss, host_state = train(False)
    params, loss, state = train(True)
    assert state == host_state
    assert loss == host_loss
    jax.tree.map(np.testing.assert_array_equal, params, host_params)


def test_a_subclass_yielding_its_own_batches_is_read_through_them():
    # A subclass's `yield_batch` is how its batches come: the per-step Loop calls it.
    class Doubled(loopax.ArrayDataset):
        def yield_batch(self):
            spec, inputs, labels = super().yield_batch()
            return spec, [a * 2.0 for a in inputs], labels

    def train(cls):
        loop = new_loop(1)
        rng = np.random.default_rng(2)
        inputs = rng.normal(size=(EXAMPLES, 3)).astype(np.float32)
        data = cls(inputs, inputs[:, :1], BATCH, seed=3, loop_forever=True, on_device=True)
        loop.run_steps(data, 5)
        return jax.device_get(loop.trainer.params)

    doubled, plain = train(Doubled), train(loopax.ArrayDataset)
    assert not np.array_equal(doubled["Dense_0"]["kernel"], plain["Dense_0"]["kernel"])
