"""Gradient accumulation: `Trainer(..., accumulate_steps=K)`.

An optimizer step over K micro-batches of B examples must equal one step over the K*B big
batch (its mean-loss gradient), on 1 and 4 simulated devices (tests/conftest.py). Float
tolerance throughout: rtol=1e-5, atol=1e-6 (the sums run in a different order).
"""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import loopax
from loopax import hooks, metrics

ONE_DEVICE = jax.devices()[:1]
K = 4  # accumulate_steps
MICRO = 8  # examples per micro-batch
STEPS = 5
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.1), "adam": lambda: optax.adam(0.01)}
RTOL, ATOL = 1e-5, 1e-6

needs_four_devices = pytest.mark.skipif(
    jax.device_count() < 4,
    reason="needs 4 devices: XLA_FLAGS=--xla_force_host_platform_device_count=4 before jax loads",
)
DEVICE_COUNTS = [1, pytest.param(4, marks=needs_four_devices)]


def mlp_model(ctx, spec, inputs):
    return nn.Dense(1)(nn.tanh(nn.Dense(8)(inputs[0])))


def squared_error(labels, predictions):
    return (labels[0] - predictions[0]) ** 2


def label_value(labels, predictions):
    return labels[0][:, 0]


def regression_data(examples, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(examples, 3)).astype(np.float32)
    y = np.sin(x @ np.array([[1.0], [-2.0], [0.5]], np.float32)).astype(np.float32)
    return x, y


def make_trainer(optimizer="sgd", devices=1, accumulate_steps=1, **options):
    return loopax.Trainer(
        mlp_model,
        squared_error,
        OPTIMIZERS[optimizer](),
        devices=jax.devices()[:devices],
        accumulate_steps=accumulate_steps,
        **options,
    )


def micro_batches(array, count):
    """`array` of `count * B` examples as `count` micro-batches: shape (count, B, ...)."""
    return array.reshape(count, -1, *array.shape[1:])


def assert_close_trees(got, want):
    got, want = jax.device_get(got), jax.device_get(want)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL), got, want)


def assert_trees_equal(got, want):
    got, want = jax.device_get(got), jax.device_get(want)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(g, w)


class CountingDataset:
    """Endless micro-batches of MICRO examples; batch j has every label equal to j / 100."""

    name = "counting"

    def __init__(self):
        self.batches_read = 0
        self.x, _ = regression_data(MICRO)

    def yield_batch(self):
        labels = np.full((MICRO, 1), self.batches_read / 100, np.float32)
        self.batches_read += 1
        return None, [self.x], [labels]

    def reset(self):
        pass


# -- one optimizer step over micro-batches == one step over the big batch -------------------


@pytest.mark.parametrize("devices", DEVICE_COUNTS)
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_accumulated_micro_batches_equal_the_big_batch(optimizer, devices):
    x, y = regression_data(STEPS * K * MICRO)
    big = make_trainer(optimizer)  # the reference: one device, batches of K * MICRO
    accumulated = make_trainer(optimizer, devices, accumulate_steps=K)
    for step in range(STEPS):
        chunk = slice(step * K * MICRO, (step + 1) * K * MICRO)
        want = big.train_step(None, [x[chunk]], [y[chunk]])
        got = accumulated.train_step(
            None, [micro_batches(x[chunk], K)], [micro_batches(y[chunk], K)]
        )
        assert list(got) == ["loss", "moving_average_loss"]
        # The loss is the mean of the micro-batch losses: the big batch's mean loss.
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=RTOL, atol=ATOL)
        assert accumulated.global_step == step + 1
    assert int(jax.device_get(accumulated.state.step)) == STEPS
    assert_close_trees(accumulated.params, big.params)
    assert_close_trees(accumulated.state.opt_state, big.state.opt_state)


def test_a_group_shorter_than_accumulate_steps_is_one_step_over_its_micro_batches():
    x, y = regression_data(2 * MICRO)
    big = make_trainer()
    accumulated = make_trainer(accumulate_steps=K)
    big.train_step(None, [x], [y])
    accumulated.train_step(None, [micro_batches(x, 2)], [micro_batches(y, 2)])  # k=2 < K=4
    assert accumulated.global_step == 1
    assert_close_trees(accumulated.params, big.params)


@pytest.mark.parametrize("devices", DEVICE_COUNTS)
def test_the_loop_stacks_k_consecutive_batches_into_one_step(devices):
    x, y = regression_data(3 * K * MICRO)
    accumulated = make_trainer(devices=devices, accumulate_steps=K)
    big = make_trainer()
    loops = [loopax.Loop(accumulated), loopax.Loop(big)]
    losses = [[], []]
    for loop, recorded in zip(loops, losses, strict=True):
        loop.on_step("record", lambda loop, m, recorded=recorded: recorded.append(m["loss"]))
    loops[0].run_steps(loopax.ArrayDataset(x, y, MICRO, shuffle=False), 3)
    loops[1].run_steps(loopax.ArrayDataset(x, y, K * MICRO, shuffle=False), 3)
    assert accumulated.global_step == big.global_step == 3
    assert loops[0].loop_step == 3
    np.testing.assert_allclose(
        np.array(jax.device_get(losses[0])), np.array(jax.device_get(losses[1])), rtol=RTOL
    )
    assert_close_trees(accumulated.params, big.params)


def test_an_epoch_end_closes_a_shorter_group():
    # 10 micro-batches an epoch with K=4: groups of 4, 4 and 2, so 3 optimizer steps.
    x, y = regression_data(10 * MICRO)
    accumulated = make_trainer(accumulate_steps=K)
    loopax.Loop(accumulated).run_epochs(loopax.ArrayDataset(x, y, MICRO, shuffle=False), 2)
    assert accumulated.global_step == 6

    big = make_trainer()
    groups = [slice(0, 4 * MICRO), slice(4 * MICRO, 8 * MICRO), slice(8 * MICRO, 10 * MICRO)]
    for _ in range(2):
        for group in groups:
            big.train_step(None, [x[group]], [y[group]])
    assert_close_trees(accumulated.params, big.params)


def test_a_change_of_batch_shape_inside_a_group_is_a_clear_error_and_loses_no_step():
    # Batches of 8, 8, 8, 4, 4 with K=2: the third group would stack 8 and 4 examples. The
    # odd batch cannot wait for the next step (a checkpoint between them would lose it), so
    # the run stops, naming the shapes and the fix, after the steps it could take.
    x, y = regression_data(32)
    bounds = [0, 8, 16, 24, 28, 32]
    batches = [([x[a:b]], [y[a:b]]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    accumulated = make_trainer(accumulate_steps=2)
    with pytest.raises(RuntimeError, match=r"need one spec and one shape.*micro-batch 1"):
        loopax.Loop(accumulated).run_epochs(
            loopax.IterableDataset(lambda: iter(batches), name="two sizes"), 1
        )
    assert accumulated.global_step == 1

    big = make_trainer()
    big.train_step(None, [x[:16]], [y[:16]])
    assert_close_trees(accumulated.params, big.params)


# -- metrics, steps, triggers and checkpoints count optimizer steps ------------------------


def test_train_metrics_see_every_micro_batch_and_hooks_count_optimizer_steps():
    trainer = make_trainer(
        accumulate_steps=K, train_metrics=[metrics.Mean("label mean", label_value)]
    )
    loop = loopax.Loop(trainer)
    dataset = CountingDataset()
    seen = []
    loop.on_step("record", lambda loop, m: seen.append((loop.loop_step, m)))
    fired = []
    hooks.every_n_steps(loop, 2, "every 2", lambda loop, m: fired.append(loop.loop_step))
    loop.run_steps(dataset, 5)

    assert dataset.batches_read == 5 * K  # run_steps(ds, n) reads n*K batches
    assert trainer.global_step == 5 and loop.loop_step == 5
    assert [step for step, _ in seen] == [0, 1, 2, 3, 4]
    assert fired == [1, 3]
    # Micro-batch j has labels j / 100; the run's running mean after optimizer step s
    # covers micro-batches 0 .. K*(s+1)-1: (K*(s+1) - 1) / 200 only if every one counted.
    label_means = [float(m["label mean"]) for _, m in seen]
    np.testing.assert_allclose(label_means, [(K * (s + 1) - 1) / 200 for s in range(5)], rtol=RTOL)

    loop.run_steps(dataset, 2)  # a second run continues from the current step
    assert dataset.batches_read == 7 * K
    assert trainer.global_step == 7 and loop.loop_step == 7
    # The train metrics restart with the run: micro-batches 20 .. 27.
    assert float(seen[-1][1]["label mean"]) == pytest.approx(np.mean(np.arange(20, 28)) / 100)


def test_the_second_step_never_compiles_again():
    trainer = make_trainer(accumulate_steps=K)
    compiled = []
    trainer.on_exec_creation(lambda info: compiled.append(info.graph_type))
    x, y = regression_data(K * MICRO)
    for _ in range(3):
        trainer.train_step(None, [micro_batches(x, K)], [micro_batches(y, K)])
    assert compiled == ["train"]


def resume_dataset():
    x, y = regression_data(12 * MICRO, seed=1)  # 12 micro-batches: 3 optimizer steps an epoch
    return loopax.ArrayDataset(x, y, MICRO, shuffle=True, seed=4, loop_forever=True)


def test_checkpoints_count_optimizer_steps_and_resume_exactly(tmp_path):
    uninterrupted = make_trainer("adam", accumulate_steps=K)
    loop = loopax.Loop(uninterrupted)
    checkpointer = hooks.checkpoint(loop, tmp_path / "uninterrupted", every_n_steps=2, keep=None)
    loop.run_to_step(resume_dataset(), 7)
    checkpointer.wait()
    assert checkpointer.all_steps() == [2, 4, 6, 7]

    # Stopped after 2 optimizer steps (8 of an epoch's 12 micro-batches read), then
    # resumed in a fresh trainer, as a new process would.
    directory = tmp_path / "interrupted"
    first = make_trainer("adam", accumulate_steps=K)
    loop = loopax.Loop(first)
    hooks.checkpoint(loop, directory)
    loop.run_to_step(resume_dataset(), 2)
    assert first.global_step == 2

    resumed = make_trainer("adam", accumulate_steps=K)
    loop = loopax.Loop(resumed)
    checkpointer = hooks.checkpoint(loop, directory)
    assert checkpointer.restored_step == 2
    assert (resumed.global_step, loop.loop_step) == (2, 2)
    loop.run_to_step(resume_dataset(), 7)
    checkpointer.wait()
    assert resumed.global_step == 7
    assert_trees_equal(resumed.state.params, uninterrupted.state.params)
    assert_trees_equal(resumed.state.opt_state, uninterrupted.state.opt_state)


# -- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -2, 2.5, "4"])
def test_invalid_accumulate_steps_raise_at_construction(value):
    with pytest.raises((ValueError, TypeError), match="accumulate_steps"):
        make_trainer(accumulate_steps=value)


MICRO_BATCH_ERROR = r"(?i)(micro-?batch|accumulate_steps)"


def test_a_batch_without_the_micro_batch_axis_is_a_clear_error():
    trainer = make_trainer(accumulate_steps=K)
    x, y = regression_data(2 * K * MICRO)  # (64, 3): a leading axis of 64 > K
    with pytest.raises(ValueError, match=MICRO_BATCH_ERROR) as error:
        trainer.train_step(None, [x], [y])
    assert "64" in str(error.value) and str(K) in str(error.value)


def test_more_micro_batches_than_accumulate_steps_is_a_clear_error():
    trainer = make_trainer(accumulate_steps=K)
    x, y = regression_data((K + 1) * MICRO)
    with pytest.raises(ValueError, match=MICRO_BATCH_ERROR) as error:
        trainer.train_step(None, [micro_batches(x, K + 1)], [micro_batches(y, K + 1)])
    assert str(K + 1) in str(error.value) and str(K) in str(error.value)


@pytest.mark.parametrize(
    "input_count,label_count,other_input_count",
    [(K, 2, None), (K, K, 3)],
    ids=["labels differ from inputs", "inputs differ"],
)
def test_inconsistent_micro_batch_axes_are_a_clear_error(
    input_count, label_count, other_input_count
):
    trainer = make_trainer(accumulate_steps=K)
    x, y = regression_data(K * MICRO)
    inputs = [micro_batches(x[: input_count * MICRO], input_count)]
    if other_input_count is not None:
        inputs.append(micro_batches(x[: other_input_count * MICRO], other_input_count))
    labels = [micro_batches(y[: label_count * MICRO], label_count)]
    with pytest.raises(ValueError, match=MICRO_BATCH_ERROR):
        trainer.train_step(None, inputs, labels)
