"""The checkpoint hook with real Orbax checkpoints, real Loops and real killed subprocesses."""

import contextlib
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from _tiny import tiny_data, tiny_trainer

import loopax
from loopax import hooks
from loopax.hooks._checkpointing._snapshot import Snapshot, check

WORKER = Path(__file__).with_name("checkpoint_worker.py")
BATCH_SIZE = 8


def model_fn(ctx, spec, inputs):
    hidden = nn.Dense(4)(inputs[0])
    return nn.Dense(1)(nn.Dropout(0.5, deterministic=not ctx.training)(hidden))


def make_trainer(devices=None):
    return loopax.Trainer(
        model_fn,
        loopax.losses.mean_squared_error,
        optax.adam(0.01),
        devices=jax.devices()[:1] if devices is None else devices,
    )


def make_dataset(seed=0):
    rng = np.random.default_rng(0)
    inputs = rng.normal(size=(24, 3)).astype(np.float32)
    return loopax.ArrayDataset(
        inputs, inputs.sum(1, keepdims=True), batch_size=BATCH_SIZE, loop_forever=True, seed=seed
    )


@pytest.fixture(scope="module")
def compiled_trainer():
    # One trainer for most tests: compiling costs seconds, a step well under a millisecond.
    trainer = make_trainer()
    initial = []
    trainer.add_state_initializer(lambda state: initial.append(jax.device_get(state)) or state)
    loopax.Loop(trainer).run_steps(make_dataset(), 1)
    return trainer, initial[0]


@pytest.fixture
def trainer(compiled_trainer):
    """The shared trainer, back at its freshly initialized state (step 0)."""
    trainer, initial_state = compiled_trainer
    trainer.state = jax.tree.map(np.array, initial_state)
    assert trainer.global_step == 0
    return trainer


def assert_trees_equal(expected, actual):
    expected, actual = jax.device_get(expected), jax.device_get(actual)
    assert jax.tree.structure(expected) == jax.tree.structure(actual)
    for want, got in zip(jax.tree.leaves(expected), jax.tree.leaves(actual), strict=True):
        assert np.array_equal(want, got)


def worker_command(directory, target, out, *flags):
    return [sys.executable, str(WORKER), str(directory), str(target), str(out), *flags]


def worker_env(cache):
    # The killed and resumed runs compile the same step: share it through JAX's disk cache.
    return dict(
        os.environ,
        JAX_COMPILATION_CACHE_DIR=os.environ.get("JAX_COMPILATION_CACHE_DIR", str(cache)),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )


def run_worker(tmp_path, *args):
    return subprocess.run(
        worker_command(*args),
        capture_output=True,
        text=True,
        timeout=120,
        env=worker_env(tmp_path / "jax-cache"),
    )


# -- exact resume across processes ---------------------------------------------------------


def test_sigkill_at_several_steps_then_resume_matches_uninterrupted_run_bit_for_bit(tmp_path):
    reference = subprocess.Popen(  # in parallel with the killed runs
        worker_command(tmp_path / "reference", 20, tmp_path / "ref.npz"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=worker_env(tmp_path / "jax-cache"),
    )
    directory, out = tmp_path / "killed", tmp_path / "out.npz"
    # Killed right after the save of step 6 was issued, its background write in flight.
    killed = run_worker(tmp_path, directory, 20, out, "--kill-after-save", "6")
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert "resumed from step None" in killed.stdout
    # Killed inside Orbax's commit of step 12: written, but never made a valid checkpoint.
    killed = run_worker(tmp_path, directory, 20, out, "--kill-in-commit", "12")
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert "resumed from step 3" in killed.stdout or "resumed from step 6" in killed.stdout
    assert "12.orbax-checkpoint-tmp" in os.listdir(directory)
    # A normal exit right after the save of step 15 was issued: it completes at exit.
    exited = run_worker(tmp_path, directory, 20, out, "--exit-after-save", "15")
    assert exited.returncode == 3, exited.stderr[-3000:]
    assert "resumed from step 9" in exited.stdout
    assert "15" in os.listdir(directory)
    finished = run_worker(tmp_path, directory, 20, out)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "resumed from step 15" in finished.stdout
    assert "done at step 20" in finished.stdout
    _, errors = reference.communicate(timeout=120)
    assert reference.returncode == 0, errors[-3000:]

    want, got = np.load(tmp_path / "ref.npz"), np.load(out)
    assert sorted(want.files) == sorted(got.files)
    for name in want.files:
        assert np.array_equal(want[name], got[name]), name


# -- in-process behaviour --------------------------------------------------------------------


def train(trainer, directory, steps, **options):
    loop = loopax.Loop(trainer)
    checkpointer = hooks.checkpoint(loop, directory, **options)
    loop.run_to_step(make_dataset(), steps)
    checkpointer.wait()
    return trainer, loop, checkpointer


def test_saves_on_trigger_and_at_the_end_of_every_run(trainer, tmp_path):
    _, loop, checkpointer = train(trainer, tmp_path, 5, every_n_steps=2, keep=None)
    assert checkpointer.all_steps() == [2, 4, 5]
    loop.run_steps(make_dataset(), 2)
    checkpointer.wait()
    assert checkpointer.all_steps() == [2, 4, 5, 6, 7]
    assert checkpointer.latest_step() == 7


def test_restore_in_a_fresh_trainer_has_the_state_before_the_first_batch(trainer, tmp_path):
    dataset = make_dataset()
    loop = loopax.Loop(trainer)
    hooks.checkpoint(loop, tmp_path, every_n_steps=2).wait()
    loop.run_to_step(dataset, 5)

    resumed = make_trainer()
    resumed_loop = loopax.Loop(resumed)
    checkpointer = hooks.checkpoint(resumed_loop, tmp_path)
    assert checkpointer.restored_step == 5
    assert (resumed.global_step, resumed_loop.loop_step) == (5, 5)
    # The state is there before any batch, e.g. for a run that has nothing left to do.
    assert_trees_equal(trainer.state, resumed.state)
    assert resumed_loop.run_to_step(make_dataset(), 5) == {}  # already there: a no-op
    assert resumed.global_step == 5 and checkpointer.all_steps() == [2, 4, 5]
    resumed_loop.run_to_step(make_dataset(), 6)  # the dataset position comes back too
    assert checkpointer.all_steps() == [4, 5, 6]

    loopax.Loop(trainer).run_to_step(dataset, 6)  # the saving run, continued in memory
    for field in ("step", "params", "opt_state", "model_state", "rng"):
        assert_trees_equal(getattr(trainer.state, field), getattr(resumed.state, field))


def test_resumed_run_equals_uninterrupted_run_in_process(trainer, compiled_trainer, tmp_path):
    initial = compiled_trainer[1]
    loopax.Loop(trainer).run_to_step(make_dataset(), 9)
    uninterrupted = jax.device_get(trainer.state)
    trainer.state = jax.tree.map(np.array, initial)
    train(trainer, tmp_path, 4)
    trainer.state = jax.tree.map(np.array, initial)  # as a new process: restoring overwrites it
    train(trainer, tmp_path, 9)
    assert_trees_equal(uninterrupted.params, trainer.state.params)
    assert_trees_equal(uninterrupted.opt_state, trainer.state.opt_state)


def test_explicit_save_and_restore_of_an_older_step(trainer, tmp_path):
    _, loop, checkpointer = train(trainer, tmp_path, 3, keep=None)
    state_at_3 = jax.device_get(trainer.state)
    loop.run_steps(make_dataset(), 2)
    assert checkpointer.save() is None  # step 5 was just saved at the end of the run
    checkpointer.wait()
    assert checkpointer.all_steps() == [3, 5]
    assert checkpointer.restore(3) == 3
    assert (trainer.global_step, loop.loop_step) == (3, 3)
    assert_trees_equal(state_at_3, trainer.state)
    with pytest.raises(ValueError, match="no checkpoint of step 4"):
        checkpointer.restore(4)


def test_save_before_the_first_batch_is_an_error(tmp_path):
    checkpointer = hooks.checkpoint(loopax.Loop(make_trainer()), tmp_path)
    with pytest.raises(RuntimeError, match="before the trainer's first step"):
        checkpointer.save()


def test_the_second_step_never_compiles_again(trainer, tmp_path):
    compiled = []
    trainer.on_exec_creation(compiled.append)
    loop = loopax.Loop(trainer)
    hooks.checkpoint(loop, tmp_path, every_n_steps=1)
    loop.run_steps(make_dataset(), 4)
    assert compiled == []


# -- retention -------------------------------------------------------------------------------


def test_keeps_the_newest_keep(trainer, tmp_path):
    _, _, checkpointer = train(trainer, tmp_path, 6, every_n_steps=1, keep=2)
    assert checkpointer.all_steps() == [5, 6]
    assert sorted(os.listdir(tmp_path)) == ["5", "6"]


def test_keep_period_keeps_multiples_forever(trainer, tmp_path):
    _, _, checkpointer = train(trainer, tmp_path, 7, every_n_steps=1, keep=1, keep_period=3)
    assert checkpointer.all_steps() == [3, 6, 7]


def keep_best_of_five_steps(trainer, directory, fake_evaluation, best_mode):
    """Five steps checkpointed each, keeping one and the best by the `fake_evaluation`'s
    `eval/test/mean_loss`; the checkpointer, every save committed."""
    loop = loopax.Loop(trainer)
    loop.on_step("fake evaluation", fake_evaluation, loopax.Priority.EVALUATE)
    checkpointer = hooks.checkpoint(
        loop,
        directory,
        every_n_steps=1,
        keep=1,
        best_metric="eval/test/mean_loss",
        best_mode=best_mode,
    )
    loop.run_steps(make_dataset(), 5)
    checkpointer.wait()
    return checkpointer


@pytest.mark.parametrize("best_mode, best_step", [("min", 2), ("max", 1)])
def test_keeps_the_best_by_an_eval_metric(trainer, tmp_path, best_mode, best_step):
    losses = {0: 5.0, 1: 1.0, 2: 4.0, 3: 3.0}  # by loop_step; at step 4 only a stale value

    def fake_evaluation(loop, metrics):
        if loop.loop_step in losses:
            loop.history.record(
                trainer.global_step, {"eval/test/mean_loss": losses[loop.loop_step]}
            )
        else:  # a value of another step says nothing about this one
            loop.history.record(trainer.global_step - 1, {"eval/test/mean_loss": -100.0})

    checkpointer = keep_best_of_five_steps(trainer, tmp_path, fake_evaluation, best_mode)
    assert checkpointer.all_steps() == [best_step, 5]


@pytest.mark.parametrize("best_mode", ["min", "max"])
def test_of_equal_best_values_the_first_step_is_kept(trainer, tmp_path, best_mode):
    # As early stopping counts only a strict improvement: its best step is the first of
    # equal values (an accuracy on a small validation set ties often).
    sign = 1.0 if best_mode == "min" else -1.0
    values = {1: 3.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 2.0}  # by global step, sign applied

    def fake_evaluation(loop, metrics):
        step = trainer.global_step
        loop.history.record(step, {"eval/test/mean_loss": sign * values[step]})

    checkpointer = keep_best_of_five_steps(trainer, tmp_path, fake_evaluation, best_mode)
    assert checkpointer.all_steps() == [2, 5] and checkpointer.best_step() == 2


def test_keeps_the_best_by_a_train_metric(trainer, tmp_path):
    loop = loopax.Loop(trainer)
    losses = {}
    loop.on_step("record", lambda lp, m: losses.update({trainer.global_step: float(m["loss"])}))
    checkpointer = hooks.checkpoint(
        loop, tmp_path, every_n_steps=1, keep=1, keep_best=2, best_metric="train/loss"
    )
    loop.run_steps(make_dataset(), 6)
    checkpointer.wait()
    best_two = sorted(losses, key=losses.get)[:2]
    assert checkpointer.all_steps() == sorted({*best_two, 6})


@pytest.mark.parametrize(
    "options, message",
    [
        ({"keep": 0}, "keep must be a positive int"),
        ({"keep_period": -3}, "keep_period must be a positive int"),
        ({"best_mode": "lowest"}, "best_mode must be 'min' or 'max'"),
        ({"best_metric": "loss"}, "best_metric must be 'train/<metric>'"),
        ({"best_metric": "train/accuracy"}, "names no train metric"),
        ({"every_n_steps": 0}, "n must be a positive int"),
        ({"period_seconds": 0}, "period_seconds must be a finite number > 0"),
    ],
)
def test_invalid_configuration_raises_at_attach(tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        hooks.checkpoint(loopax.Loop(make_trainer()), tmp_path, **options)


# -- damaged and foreign directories ---------------------------------------------------------


def test_falls_back_from_a_damaged_newest_checkpoint_and_keeps_it(trainer, tmp_path):
    train(trainer, tmp_path, 4, every_n_steps=2)
    data_files = [
        path
        for path in (tmp_path / "4" / "state").rglob("*")
        if path.is_file() and path.parent.name == "d"
    ]
    assert data_files
    for path in data_files:
        path.write_bytes(b"not an array" * 10)

    loop = loopax.Loop(trainer)
    with pytest.warns(RuntimeWarning, match=r"checkpoint '.*4' is damaged .*falling back"):
        checkpointer = hooks.checkpoint(loop, tmp_path)
    assert checkpointer.restored_step == 2
    assert (trainer.global_step, loop.loop_step) == (2, 2)
    assert (tmp_path / "damaged" / "4" / "state").is_dir()  # set aside, never deleted
    loop.run_to_step(make_dataset(), 4)
    checkpointer.wait()
    assert checkpointer.all_steps() == [2, 4]
    hooks.checkpoint(loopax.Loop(trainer), tmp_path)  # the directory stays usable


def test_a_damaged_description_falls_back_too(trainer, tmp_path):
    train(trainer, tmp_path, 4, every_n_steps=2)
    (tmp_path / "4" / "loopax" / "metadata").write_text("{not json")
    with pytest.warns(RuntimeWarning, match="is damaged"):
        checkpointer = hooks.checkpoint(loopax.Loop(trainer), tmp_path)
    assert checkpointer.restored_step == 2


def test_a_directory_with_other_content_is_a_clear_error(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="holds 'notes.txt', which is not part of a loopax"):
        hooks.checkpoint(loopax.Loop(make_trainer()), tmp_path)


def test_a_foreign_orbax_checkpoint_is_a_clear_error(tmp_path):
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as writer:
        writer.save(tmp_path / "7", {"w": np.ones(3)})
    with pytest.raises(ValueError, match="holds '7', which is not part of a loopax"):
        hooks.checkpoint(loopax.Loop(make_trainer()), tmp_path)


def test_a_file_is_not_a_directory(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        hooks.checkpoint(loopax.Loop(make_trainer()), tmp_path / "file")


# -- triggers, dataset position and devices --------------------------------------------------


def test_trigger_schedules_and_dataset_position_continue_after_a_resume(
    trainer, compiled_trainer, tmp_path
):
    def attach(trainer):
        loop = loopax.Loop(trainer)
        fired = {"n_times": [], "every": [], "exponential": [], "batches": []}
        hooks.n_times_during_loop(loop, 4, "n", lambda lp, m: fired["n_times"].append(lp.loop_step))
        hooks.every_n_steps(loop, 5, "e", lambda lp, m: fired["every"].append(lp.loop_step))
        hooks.exponential_callback(
            loop, 3, 2.0, "x", lambda lp, m: fired["exponential"].append(lp.loop_step)
        )
        return loop, fired

    loop, uninterrupted = attach(trainer)
    loop.run_to_step(make_dataset(), 20)
    uninterrupted_state = jax.device_get(trainer.state)

    trainer.state = jax.tree.map(np.array, compiled_trainer[1])
    loop, first = attach(trainer)
    hooks.checkpoint(loop, tmp_path)
    loop.on_step("interrupt", lambda lp, m: lp.loop_step == 11 and lp.request_stop("test"))
    loop.run_to_step(make_dataset(), 20)
    assert trainer.global_step == 12

    trainer.state = jax.tree.map(np.array, compiled_trainer[1])  # as a new process
    loop, second = attach(trainer)
    hooks.checkpoint(loop, tmp_path)
    loop.run_to_step(make_dataset(), 20)
    for name in ("n_times", "every", "exponential"):
        assert first[name] + second[name] == uninterrupted[name], name
    assert second["n_times"] == [14, 19]
    assert_trees_equal(uninterrupted_state.params, trainer.state.params)


FOUR_DEVICES = "--xla_force_host_platform_device_count=4"


@pytest.mark.cpu_devices
def test_restore_onto_one_and_four_devices(tmp_path):
    if jax.device_count() < 4:
        assert "LOOPAX_FOUR_DEVICES_RERUN" not in os.environ, jax.devices()
        # Simulated devices must be set before jax starts: rerun this test in a fresh process.
        env = dict(
            os.environ,
            XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {FOUR_DEVICES}",
            JAX_PLATFORMS="cpu",
            LOOPAX_FOUR_DEVICES_RERUN="1",
        )
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-x",
                "-q",
                "-p",
                "no:cacheprovider",
                f"{__file__}::test_restore_onto_one_and_four_devices",
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return
    trainers = {count: make_trainer(jax.devices()[:count]) for count in (4, 1)}
    loopax.Loop(trainers[4]).run_steps(make_dataset(), 3)
    loopax.Loop(trainers[1]).run_steps(make_dataset(), 1)
    for saving, loading in [(4, 1), (1, 4)]:
        directory = tmp_path / f"{saving}-to-{loading}"
        checkpointer = hooks.checkpoint(loopax.Loop(trainers[saving]), directory, restore=False)
        checkpointer.save()
        checkpointer.wait()
        saved = jax.device_get(trainers[saving].state)
        loop = loopax.Loop(trainers[loading])
        hooks.checkpoint(loop, directory)
        assert trainers[loading].num_devices == loading
        assert_trees_equal(saved, trainers[loading].state)
        loop.run_steps(make_dataset(), 1)  # trains on with the restored arrays
        assert trainers[loading].global_step == saved.step + 1


# -- verified restores, failed saves, a second hook on the same directory --------------------


def flip_bytes(path, count=16):
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for index in range(middle, min(middle + count, len(data))):
        data[index] ^= 0xFF
    path.write_bytes(bytes(data))


def data_files(directory):
    return [path for path in directory.rglob("*") if path.is_file() and path.parent.name == "d"]


def test_flipped_bytes_in_a_data_file_make_a_checkpoint_damaged(trainer, tmp_path):
    train(trainer, tmp_path, 4, every_n_steps=2)
    for path in data_files(tmp_path / "4" / "state"):
        flip_bytes(path)
    loop = loopax.Loop(trainer)
    with pytest.warns(RuntimeWarning, match=r"checkpoint '.*4' is damaged .*falling back"):
        checkpointer = hooks.checkpoint(loop, tmp_path)
    assert checkpointer.restored_step == 2 and (tmp_path / "damaged" / "4").is_dir()


def test_a_checkpoint_holding_nan_is_damaged_and_never_restored(trainer, tmp_path):
    import orbax.checkpoint as ocp

    from loopax.hooks._checkpointing._io import checksums

    train(trainer, tmp_path, 2, every_n_steps=2)
    # A checkpoint as a loopax without the finite check could have written it: valid files,
    # valid checksums, NaN parameters.
    state = trainer.state_dict()
    state["step"] = np.asarray(3, state["step"].dtype)
    state["params"]["Dense_0"]["kernel"][:] = np.nan
    bundle = {
        "format": "loopax.checkpoint",
        "version": 1,
        "global_step": 3,
        "checksums": checksums(state),
        "loop": {},
        "datasets": {},
    }
    handlers = {"state": ocp.StandardCheckpointHandler(), "loopax": ocp.JsonCheckpointHandler()}
    with ocp.CheckpointManager(tmp_path, item_handlers=handlers) as manager:
        manager.save(
            3,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), loopax=ocp.args.JsonSave(bundle)
            ),
            force=True,
        )
        manager.wait_until_finished()
    with pytest.warns(
        RuntimeWarning,
        match=r"'.*3' is damaged .*'params/Dense_0/kernel' holds "
        r"NaN or infinite values",
    ):
        restored = hooks.checkpoint(loopax.Loop(trainer), tmp_path)
    assert restored.restored_step == 2
    assert np.isfinite(jax.device_get(trainer.params)["Dense_0"]["kernel"]).all()


def test_when_no_checkpoint_is_good_it_refuses_to_start_over(trainer, tmp_path):
    train(trainer, tmp_path, 4, every_n_steps=2)
    for step in ("2", "4"):
        for path in data_files(tmp_path / step / "state"):
            flip_bytes(path)
    for attempt in range(2):  # the damaged ones are set aside: the next attach refuses too
        with pytest.warns(RuntimeWarning) if attempt == 0 else contextlib.nullcontext():
            with pytest.raises(
                hooks.NoGoodCheckpointError,
                match=r"no good checkpoint in .*restore='never' or use a new "
                r"directory",
            ):
                hooks.checkpoint(loopax.Loop(make_trainer()), tmp_path)
    fresh = make_trainer()
    loop = loopax.Loop(fresh)
    checkpointer = hooks.checkpoint(loop, tmp_path, restore="never")
    assert fresh.global_step == 0 and checkpointer.restored_step is None
    loop.run_steps(make_dataset(), 2)
    checkpointer.wait()
    assert checkpointer.all_steps() == [2]


def test_a_failed_background_save_raises_at_a_next_step_naming_the_directory(trainer, tmp_path):
    directory = tmp_path / "ckpt"
    loop = loopax.Loop(trainer)
    checkpointer = hooks.checkpoint(loop, directory, every_n_steps=2)
    loop.run_steps(make_dataset(), 1)
    checkpointer.wait()  # the run returns before its end-of-run save is committed
    shutil.rmtree(directory)
    directory.write_text("not a directory any more")  # every write under it now fails
    with pytest.raises(
        hooks.BackgroundSaveError,
        match=r"saving a checkpoint to '.*ckpt' "
        r"failed: \w+Error",
    ) as error:
        loop.run_steps(make_dataset(), 50)
    assert isinstance(error.value.__cause__, OSError)
    # Raised while training went on (a step after the failure), not 50 steps later at the end.
    assert trainer.global_step < 51


def test_a_new_hook_on_the_same_directory_waits_for_the_saves_in_flight(
    trainer, tmp_path, monkeypatch
):
    from orbax.checkpoint._src.path import atomicity

    release, committing, entered = threading.Event(), threading.Event(), threading.Event()
    original = atomicity.AtomicRenameTemporaryPath.finalize

    async def slow_finalize(self, *args, **kwargs):
        committing.set()
        release.wait()  # a slow disk: the commit of the first save hangs until released
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", slow_finalize)
    loop = loopax.Loop(trainer)
    first = hooks.checkpoint(loop, tmp_path, every_n_steps=2)
    first.wait = lambda: None  # the run ends without waiting for its save (as if it raised)
    loop.run_steps(make_dataset(), 2)
    del first.wait
    committing.wait()
    waited = first.wait_quietly

    def wait_quietly():
        entered.set()
        waited()

    monkeypatch.setattr(first, "wait_quietly", wait_quietly)
    attached = []
    second = threading.Thread(
        target=lambda: attached.append(hooks.checkpoint(loopax.Loop(make_trainer()), tmp_path))
    )
    second.start()
    try:
        # The second hook waits for the first one's save (the timeout only keeps a
        # regression from hanging the suite)...
        assert entered.wait(timeout=60), "the new hook did not wait for the save in flight"
        assert not (tmp_path / "2").exists()
    finally:
        release.set()  # ...which then commits, instead of being cleaned away as a leftover
        second.join()
    assert attached[0].restored_step == 2 and attached[0].all_steps() == [2]


def test_best_step_and_restore_best(trainer, tmp_path):
    losses = {1: 5.0, 3: 1.0, 5: 4.0, 7: 3.0}  # by global step

    def fake_evaluation(loop, metrics):
        step = trainer.global_step
        if step in losses:
            loop.history.record(step, {"eval/test/mean_loss": losses[step]})

    loop = loopax.Loop(trainer)
    loop.on_step("fake evaluation", fake_evaluation, loopax.Priority.EVALUATE)
    checkpointer = hooks.checkpoint(
        loop, tmp_path, every_n_steps=1, keep=2, best_metric="eval/test/mean_loss"
    )
    saved = {}
    loop.on_step(
        "remember",
        lambda lp, m: saved.update({trainer.global_step: trainer.state_dict()}),
        loopax.Priority.UI,
    )
    loop.run_steps(make_dataset(), 8)
    assert checkpointer.best_step() == 3
    assert checkpointer.all_steps() == [3, 7, 8]
    assert checkpointer.restore_best() == 3
    assert trainer.global_step == 3 and loop.loop_step == 3
    assert_trees_equal(saved[3], trainer.state_dict())
    # A new process finds the best among the checkpoints on disk too.
    again = hooks.checkpoint(
        loopax.Loop(make_trainer()), tmp_path, best_metric="eval/test/mean_loss"
    )
    assert again.best_step() == 3


def test_best_step_needs_a_best_metric(trainer, tmp_path):
    checkpointer = hooks.checkpoint(loopax.Loop(trainer), tmp_path)
    with pytest.raises(
        ValueError, match="best_step\\(\\) needs the hook attached with best_metric"
    ):
        checkpointer.best_step()


def test_a_resumed_run_continues_its_train_metrics_and_a_new_run_starts_them_afresh(
    trainer, compiled_trainer, tmp_path
):
    initial = compiled_trainer[1]
    uninterrupted = float(
        loopax.Loop(trainer).run_to_step(make_dataset(), 8)["moving_average_loss"]
    )

    def resume(target):
        trainer.state = jax.tree.map(np.array, initial)  # as a new process
        loop = loopax.Loop(trainer)
        hooks.checkpoint(loop, tmp_path, restore=True)
        losses = []
        loop.on_step("record", lambda lp, m: losses.append(float(m["loss"])))
        return float(loop.run_to_step(make_dataset(), target)["moving_average_loss"]), losses

    trainer.state = jax.tree.map(np.array, initial)
    loop = loopax.Loop(trainer)
    hooks.checkpoint(loop, tmp_path)
    loop.on_step("interrupt", lambda lp, m: lp.loop_step == 4 and lp.request_stop("test"))
    loop.run_to_step(make_dataset(), 8)  # stopped at 5, saved there, in the run to 8
    # The same run, resumed: its moving average goes on from the checkpoint's.
    assert resume(8)[0] == uninterrupted
    # A run to another target is a new run: its average starts afresh, over its own steps
    # (an exact running mean for the first 100 steps).
    average, losses = resume(12)  # from the end save of step 8
    assert len(losses) == 4 and average == pytest.approx(np.mean(losses), rel=1e-6)


def test_a_run_that_raises_waits_for_its_save_in_flight(trainer, tmp_path, monkeypatch):
    from orbax.checkpoint._src.path import atomicity

    raised = threading.Event()
    original = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize_after_the_error(self, *args, **kwargs):
        raised.wait(timeout=60)  # the save of step 2 is still in flight when the run raises
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", finalize_after_the_error)
    loop = loopax.Loop(trainer)
    checkpointer = hooks.checkpoint(loop, tmp_path, every_n_steps=2)

    def fail(loop, metrics):
        if loop.loop_step == 3:
            raised.set()
            raise RuntimeError("a bug in a hook")

    loop.on_step("fail", fail)
    with pytest.raises(loopax.HookError, match="a bug in a hook"):
        loop.run_steps(make_dataset(), 10)
    # When the error reaches the caller, the save issued before it is committed.
    assert checkpointer.all_steps() == [2]
    assert sorted(os.listdir(tmp_path)) == ["2"]


def test_run_epochs_resumes_from_a_checkpoint_taken_at_an_epochs_end(tmp_path):
    """Keras's every-epoch checkpoint: the saved position is at the end of its pass."""

    def new_loop():
        trainer = loopax.Trainer(
            lambda ctx, spec, inputs: nn.Dense(1)(inputs[0]),
            loopax.losses.mean_squared_error,
            optax.sgd(0.05),
            devices=jax.devices()[:1],
        )
        return loopax.Loop(trainer)

    def data():
        x = np.random.default_rng(0).normal(size=(24, 3)).astype(np.float32)
        return loopax.ArrayDataset(x, x.sum(axis=1, keepdims=True), 8, seed=5)

    uninterrupted = new_loop()
    uninterrupted.run_epochs(data(), 3)

    first = new_loop()
    hooks.checkpoint(first, tmp_path, every_n_epochs=1)
    first.run_epochs(data(), 2)
    resumed = new_loop()
    hooks.checkpoint(resumed, tmp_path, every_n_epochs=1)
    assert resumed.trainer.global_step == 6
    resumed.run_epochs(data(), 1)  # the third epoch, with its own shuffle
    assert resumed.trainer.global_step == 9
    for got, want in zip(
        jax.tree.leaves(resumed.trainer.params),
        jax.tree.leaves(uninterrupted.trainer.params),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_save_refused_for_nan_state_is_caught_as_non_finite_loss_error(trainer, tmp_path):
    loop = loopax.Loop(trainer)
    checkpointer = hooks.checkpoint(loop, tmp_path, every_n_steps=1000)
    loop.run_steps(make_dataset(), 2)
    checkpointer.wait()
    state = trainer.state
    nan = jax.tree.map(lambda a: a * np.nan, state.params)
    trainer.state = state.replace(params=nan, step=np.int32(3))  # a new step to save
    checkpointer.save()
    with pytest.raises(loopax.NonFiniteLossError, match="refused to save checkpoint 3") as error:
        checkpointer.wait()
    assert isinstance(error.value, hooks.NonFiniteSaveError)
    assert checkpointer.all_steps() == [2]  # the good checkpoint of step 2 is kept


def test_a_save_refused_for_a_nan_learning_rate_says_the_learning_rate_its_value_and_step(
    tmp_path,
):
    trainer = tiny_trainer(1)  # loopax.optimizers.adam: its rate lives in the state
    loop = loopax.Loop(trainer)
    checkpointer = hooks.checkpoint(loop, tmp_path, every_n_steps=1000)
    loop.run_steps(tiny_data(), 2)
    checkpointer.wait()
    trainer.set_learning_rate(float("nan"))
    loop.run_steps(tiny_data(), 1)  # its loss is finite; its update made the parameters NaN
    checkpointer.save()
    with pytest.raises(hooks.NonFiniteSaveError) as error:
        checkpointer.wait()
    message = str(error.value)
    # Worded as the loss check and nan_guard word a NaN rate: the value, the step, the fix.
    assert (
        "refused to save checkpoint 3: the learning rate is nan at step 2 (global step 3): the "
        "optimizer's learning rate is nan (a value set with set_learning_rate, or injected "
        "so), kept in 'opt_state/hyperparams/learning_rate'. Set a finite learning rate; the "
        "newest good checkpoint is kept"
    ) in message
    assert "'params/" not in message  # the parameters only follow the rate
    assert checkpointer.all_steps() == [2]


def test_a_refused_save_names_a_non_finite_learning_rate_before_the_arrays_it_spoiled():
    # An optax.chain's states in order: the first one's moment (NaN after a NaN update)
    # comes before the rate, which is still the one named: the rest only follow it.
    nan = np.array(np.nan, np.float32)
    snapshot = Snapshot(
        {
            "opt_state": {
                "0": {"mu": {"w": np.array([1.0, np.nan], np.float32)}},
                "1": {"count": np.int32(3), "hyperparams": {"learning_rate": nan}},
            },
            "params": {"w": np.array([np.nan, np.nan], np.float32)},
        }
    )
    assert check(snapshot, [])[1] == "opt_state/1/hyperparams/learning_rate"
    params_only = Snapshot({"params": {"w": np.array([np.inf], np.float32)}, "step": np.int32(3)})
    assert check(params_only, [])[1] == "params/w"


def test_a_deleted_directory_is_named_at_the_next_save_not_recreated(trainer, tmp_path):
    directory = tmp_path / "ckpt"
    loop = loopax.Loop(trainer)
    checkpointer = hooks.checkpoint(loop, directory, every_n_steps=2)
    loop.run_steps(make_dataset(), 2)
    checkpointer.wait()
    shutil.rmtree(directory)
    with pytest.raises(loopax.HookError, match=r"'.*ckpt' was deleted or moved while training"):
        loop.run_steps(make_dataset(), 4)
    assert not directory.exists()
