"""grain datasets fed to the Loop and evaluation directly, and resumed exactly from checkpoints.

Run as a script, this file is the worker of the kill-and-resume test:

    python test_grain.py DIR TARGET_STEP OUT.npz [--kill-after-save STEP]

It trains on a grain DataLoader (its position is bytes: base64 in the checkpoint) on every
visible device, checkpointing every 4 steps, and writes the final parameters to OUT.npz.
"""

import argparse
import json
import os
import signal

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import loopax
from loopax import hooks

grain = pytest.importorskip("grain")

EXAMPLES = 48
BATCH_SIZE = 8  # 6 batches an epoch: the runs below cross epochs


def model_fn(ctx, spec, inputs):
    hidden = nn.Dense(4)(inputs[0])
    return nn.Dense(1)(nn.Dropout(0.5, deterministic=not ctx.training)(hidden))


def make_trainer(devices):
    return loopax.Trainer(
        model_fn,
        loopax.losses.mean_squared_error,
        optax.adam(0.01),
        devices=jax.devices()[:devices],
    )


def records():
    """(features, target) examples; every example's features are unique, so a batch's
    first column names it."""
    rng = np.random.default_rng(0)
    inputs = rng.normal(size=(EXAMPLES, 3)).astype(np.float32)
    targets = inputs.sum(1, keepdims=True)
    return [(inputs[i], targets[i]) for i in range(EXAMPLES)]


def map_dataset(epochs=1):
    """The examples shuffled (each epoch its own order) and batched, `epochs` times over
    (None: forever)."""
    dataset = grain.MapDataset.source(records()).shuffle(seed=7)
    dataset = dataset.batch(BATCH_SIZE, drop_remainder=True)
    return dataset if epochs == 1 else dataset.repeat(epochs)


def make_source(kind):
    """A new grain source of `kind` (MapDataset, IterDataset or DataLoader) of 3 epochs:
    18 batches, more than any test reads (grain reads ahead up to 500 batches with 16
    threads by default, which an endless MapDataset would fill, costing seconds)."""
    if kind == "map":
        return map_dataset(3)
    if kind == "iter":  # a small read-ahead: two CPU cores run the suite
        return map_dataset(3).to_iter_dataset(
            grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)
        )
    assert kind == "loader"
    return grain.DataLoader(
        data_source=records(),
        sampler=grain.samplers.IndexSampler(EXAMPLES, shuffle=True, seed=7, num_epochs=3),
        operations=[grain.transforms.Batch(BATCH_SIZE, drop_remainder=True)],
        worker_count=0,
    )


def record_batches(trainer):
    """Makes `trainer` record each train batch it steps on (its first input's first column,
    which names its examples); returns the list it fills."""
    seen = []
    run = type(trainer).run.__get__(trainer)

    def recording_run(dispatch):  # every step goes through `run`, one dispatch each here
        assert dispatch.count == 1
        seen.append(np.asarray(dispatch.inputs[0])[:, 0].tolist())
        return run(dispatch)

    trainer.run = recording_run
    return seen


def batch_keys(source, count):
    """What `record_batches` records for the first `count` batches of a new pass."""
    iterator = iter(source)
    return [next(iterator)[0][:, 0].tolist() for _ in range(count)]


def assert_params_equal(expected, actual):
    expected, actual = jax.device_get(expected), jax.device_get(actual)
    assert jax.tree.structure(expected) == jax.tree.structure(actual)
    for want, got in zip(jax.tree.leaves(expected), jax.tree.leaves(actual), strict=True):
        assert np.array_equal(want, got)


@pytest.fixture(scope="module")
def fresh_trainer():
    """`fresh_trainer(devices)`: a trainer on that many devices at its initial state (step 0),
    compiled once for the module (compiling costs seconds, a step well under a millisecond)."""
    compiled = {}

    def fresh(devices=1):
        if devices not in compiled:
            trainer = make_trainer(devices)
            initial = []
            trainer.add_state_initializer(
                lambda state: initial.append(jax.device_get(state)) or state
            )
            loopax.Loop(trainer).run_steps(make_source("map"), 1)
            compiled[devices] = trainer, initial[0]
        trainer, initial = compiled[devices]
        trainer.__dict__.pop("run", None)  # a recording run of an earlier test
        trainer.state = jax.tree.map(np.array, initial)
        assert trainer.global_step == 0
        return trainer

    return fresh


@pytest.fixture
def trainer(fresh_trainer):
    return fresh_trainer(1)


# -- exact resume -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, devices",
    [
        ("map", 1),
        ("map", 4),
        ("iter", 1),
        ("iter", 4),
        ("loader", 1),
        ("loader", 4),
    ],
)
def test_grain_resume_sees_exactly_the_batches_an_uninterrupted_run_sees(
    tmp_path, fresh_trainer, kind, devices
):
    trainer = fresh_trainer(devices)
    want = record_batches(trainer)
    loopax.Loop(trainer).run_to_step(make_source(kind), 10)
    uninterrupted_params = jax.device_get(trainer.params)
    assert want == batch_keys(make_source(kind), 10)

    trainer = fresh_trainer(devices)
    got = record_batches(trainer)
    loop = loopax.Loop(trainer)
    checkpointer = hooks.checkpoint(loop, tmp_path, every_n_steps=100)  # saves at the end
    loop.run_to_step(make_source(kind), 4)
    checkpointer.wait()

    # As a new process would: a new loop, checkpoint hook and grain object (the trainer
    # starts afresh, and the checkpoint restores step 4 into it).
    trainer = fresh_trainer(devices)
    got_after = record_batches(trainer)
    loop = loopax.Loop(trainer)
    checkpointer = hooks.checkpoint(loop, tmp_path, every_n_steps=100)
    assert checkpointer.restored_step == 4
    loop.run_to_step(make_source(kind), 10)
    checkpointer.wait()
    assert got == want[:4]
    assert got_after == want[4:]
    assert_params_equal(uninterrupted_params, trainer.params)


def test_the_checkpoint_holds_the_grain_iterator_position_as_json(tmp_path, trainer):
    loop = loopax.Loop(trainer)
    checkpointer = hooks.checkpoint(loop, tmp_path, every_n_steps=100)
    loop.run_to_step(make_source("map"), 3)
    checkpointer.wait()
    bundle = json.loads((tmp_path / "3" / "loopax" / "metadata").read_text())
    assert bundle["datasets"] == {"train": {"iterator": {"next_index": 3}}}


def test_a_data_loader_position_survives_as_base64_bytes():
    source = make_source("loader")
    dataset = loopax.IterableDataset(source, name="loader")
    for _ in range(3):
        dataset.yield_batch()
    state = dataset.get_state()
    assert set(state) == {"iterator_bytes"} and isinstance(state["iterator_bytes"], str)
    after = [dataset.yield_batch()[1][0] for _ in range(4)]
    restored = loopax.IterableDataset(make_source("loader"), name="loader")
    restored.set_state(state)
    for want in after:
        np.testing.assert_array_equal(restored.yield_batch()[1][0], want)


# -- runs on one grain object -------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["map", "iter", "loader"])
def test_runs_on_the_same_grain_object_go_on_where_the_last_stopped(trainer, kind):
    source = make_source(kind)
    seen = record_batches(trainer)
    loop = loopax.Loop(trainer)
    loop.run_steps(source, 3)
    loop.run_to_step(source, 5)
    loop.run_steps(source, 4)
    assert seen == batch_keys(make_source(kind), 9)


def test_evaluating_the_training_object_leaves_the_training_position(trainer):
    source = map_dataset()  # 6 batches
    seen = record_batches(trainer)
    loop = loopax.Loop(trainer)
    loop.run_steps(source, 2)
    first = trainer.evaluate(source)
    assert trainer.evaluate(source) == first  # each evaluation from the start
    loop.run_steps(source, 2)
    assert seen == batch_keys(source, 4)


def test_run_epochs_over_a_grain_dataset_restarts_it_each_epoch(trainer):
    source = map_dataset().to_iter_dataset()
    seen = record_batches(trainer)
    loop = loopax.Loop(trainer)
    loop.run_epochs(source, 2)
    assert loop.epoch == 2 and trainer.global_step == 12
    assert seen == batch_keys(source, 6) * 2


def test_evaluate_takes_grain_dict_batches_and_a_name_from_iterable_dataset(trainer):
    inputs = np.stack([features for features, _ in records()])
    targets = np.stack([target for _, target in records()])
    as_dicts = grain.MapDataset.source(
        [{"inputs": inputs[i], "labels": targets[i]} for i in range(EXAMPLES)]
    ).batch(20)  # 20, 20, 8: uneven batches count every example once
    as_arrays = loopax.ArrayDataset(inputs, targets, 16, name="arrays", shuffle=False)
    np.testing.assert_allclose(
        trainer.evaluate(as_dicts)["mean_loss"], trainer.evaluate(as_arrays)["mean_loss"], rtol=1e-6
    )
    loop = loopax.Loop(trainer)
    test = loopax.IterableDataset(as_dicts, name="test")
    evaluation = loop.evaluate(test)
    assert evaluation.dataset == "test"
    assert "eval/test/mean_loss" in loop.history


def test_evaluating_an_endless_grain_dataset_says_so(trainer):
    with pytest.raises(
        ValueError,
        match=r"'eval' \(RepeatMapDataset\) repeats forever.*"
        r"without \.repeat\(\)",
    ):
        trainer.evaluate(map_dataset(epochs=None))
    with pytest.raises(ValueError, match="repeats forever"):
        loopax.Loop(trainer).run_epochs(map_dataset(epochs=None), 1)


def test_loop_evaluate_of_an_unnamed_grain_dataset_asks_for_a_name(trainer):
    with pytest.raises(ValueError, match=r"loopax\.IterableDataset\(batches, name='test'\)"):
        loopax.Loop(trainer).evaluate(map_dataset())


# -- a real kill, then a resume in a new process ------------------------------------------------


def worker_command(directory, target, out, *flags):
    return [__file__, str(directory), str(target), str(out), *flags]


def test_sigkill_then_resume_matches_the_uninterrupted_run_bit_for_bit(zygote_server, tmp_path):
    # Real processes, forked from one pre-imported interpreter (tests/zygote.py); the runs
    # compile the same step and share it through the run's JAX compilation cache (conftest.py).
    reference = zygote_server.start(  # in parallel with the killed run
        worker_command(tmp_path / "reference", 14, tmp_path / "ref.npz"),
        out=tmp_path / "reference.log",
        err=tmp_path / "reference.log",
    )
    directory, out = tmp_path / "killed", tmp_path / "out.npz"
    killed = zygote_server.run(
        worker_command(directory, 14, out, "--kill-after-save", "8"), timeout=120
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert "resumed from step None" in killed.stdout
    finished = zygote_server.run(worker_command(directory, 14, out), timeout=120)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "resumed from step 8" in finished.stdout  # saved every 4 steps: 4, 8
    assert reference.finish(timeout=120) == 0, (tmp_path / "reference.log").read_text()[-3000:]
    want, got = np.load(tmp_path / "ref.npz"), np.load(out)
    assert sorted(want.files) == sorted(got.files)
    for name in want.files:
        assert np.array_equal(want[name], got[name]), name


def worker_main():
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("target", type=int)
    parser.add_argument("out")
    parser.add_argument("--kill-after-save", type=int)
    args = parser.parse_args()
    trainer = make_trainer(len(jax.devices()))
    loop = loopax.Loop(trainer)
    checkpointer = hooks.checkpoint(loop, args.directory, every_n_steps=4)
    print(f"resumed from step {checkpointer.restored_step}", flush=True)
    if args.kill_after_save is not None:

        def kill_after_save(loop, metrics):
            if trainer.global_step == args.kill_after_save + 1:
                checkpointer.wait()
                os.kill(os.getpid(), signal.SIGKILL)

        loop.on_step("kill", kill_after_save, loopax.Priority.VALIDATE)
    loop.run_to_step(make_source("loader"), args.target)
    checkpointer.wait()
    leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(trainer.params))[0]
    np.savez(args.out, **{jax.tree_util.keystr(path): leaf for path, leaf in leaves})


if __name__ == "__main__":
    worker_main()
