"""Checkpoints on several processes: background saves without a hang, every process's data
position, restores onto other topologies, damage set aside everywhere, a dead process named.

Each test runs real JAX processes joined by `jax.distributed` (2 processes x 2 CPU devices,
gloo) through `loopax.testing`; the functions they run are at the top level of this module.
"""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest

from loopax import LOST_PROCESS_EXIT
from loopax.testing import Processes, multiprocess

# Their processes fork from one pre-imported interpreter (conftest.py, tests/zygote.py).
pytestmark = pytest.mark.usefixtures("forked_processes")

TIMEOUT = 120  # per group of processes; a hang fails, it never waits forever
BARRIER_TIMEOUT = 30.0  # seconds: the processes' own agreement timeout in these tests
DEAD_TIMEOUT = 3.0  # the agreement timeout of the run that loses a process
GLOBAL_BATCH = 8


# -- what the processes run ------------------------------------------------------------------


def _trainer(devices=None):
    import flax.linen as nn
    import optax

    import loopax

    return loopax.Trainer(
        lambda ctx, spec, x: nn.Dense(1)(nn.Dense(4)(x[0])),
        loopax.losses.mean_squared_error,
        optax.adam(0.05),
        devices=devices,
    )


def _host(tree):
    """A state's arrays as lists; every array here is replicated, so one local copy is whole."""
    import jax

    def one(leaf):
        if isinstance(leaf, jax.Array):
            leaf = leaf.addressable_data(0)
        return np.asarray(leaf).tolist()

    return jax.tree.map(one, tree)


def _rows(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((24, 3)).astype(np.float32)
    return x, (x @ np.array([[1.0], [-2.0], [0.5]], np.float32)).astype(np.float32)


def _shuffled(seed):
    """This process's own data, shuffled by its own seed (so its position is its own)."""
    import loopax

    x, y = _rows(seed)
    return loopax.ArrayDataset(x, y, batch_size=4, seed=seed, loop_forever=True, name="train")


def _global(seed):
    """The same data on every process, each yielding its rows of every global batch of 8:
    a global position, which resumes on any process count."""
    import loopax

    x, y = _rows(seed)
    return loopax.ArrayDataset(
        x, y, batch_size=8, seed=seed, loop_forever=True, name="train", shard_by_process=True
    )


class Share:
    """Process `process` of `processes`'s rows of global batches of one fixed stream.

    No `get_state`: the test places it at `start_step` itself, so that a run on one process
    and a run on two see the same global batches.
    """

    name = "share"

    def __init__(self, start_step, process, processes):
        self.x, self.y = _rows(3)
        self.x, self.y = np.tile(self.x, (4, 1)), np.tile(self.y, (4, 1))
        self.start_step, self.step = start_step, start_step
        self.local = GLOBAL_BATCH // processes
        self.offset = process * self.local

    def yield_batch(self):
        first = self.step * GLOBAL_BATCH + self.offset
        self.step += 1
        rows = slice(first, first + self.local)
        return None, [self.x[rows]], [self.y[rows]]

    def reset(self):
        self.step = self.start_step


def save_and_resume(directory, shared_directory):
    """2 processes: background saves every 2 steps to 6, per-process data; a resume to 10
    (new trainer, new datasets) against an uninterrupted run to 10; a run whose processes
    share one dataset (its position maps to any count)."""
    import jax

    import loopax
    from loopax import hooks

    process = jax.process_index()
    seed = 100 + process
    result = {}
    loop = loopax.Loop(_trainer())
    checkpointer = hooks.checkpoint(
        loop, directory, keep=None, every_n_steps=2, barrier_timeout=BARRIER_TIMEOUT
    )
    started = time.perf_counter()
    loop.run_to_step(_shuffled(seed), 6)
    checkpointer.wait()
    result["seconds_to_6"] = time.perf_counter() - started
    result["steps"] = checkpointer.all_steps()
    result["params6"] = _host(loop.trainer.params)

    resumed = loopax.Loop(_trainer())
    checkpointer = hooks.checkpoint(resumed, directory, keep=None, every_n_steps=2)
    result["restored"] = checkpointer.restored_step
    data = _shuffled(seed)
    resumed.run_to_step(data, 10)
    checkpointer.wait()
    result["resumed_params"] = _host(resumed.trainer.params)
    result["resumed_position"] = data.get_state()
    checkpointer.restore(4)  # a given step, read and agreed on every process
    result["back_to_4"] = [resumed.trainer.global_step, _host(resumed.trainer.params)]

    # Process 1 now holds other data than it saved: both processes raise, neither hangs.
    wrong = loopax.Loop(_trainer())
    hooks.checkpoint(wrong, directory, barrier_timeout=BARRIER_TIMEOUT)
    try:
        wrong.run_to_step(_shuffled(seed + 1000 * process), 12)
        result["wrong_data"] = "ran"
    except Exception as err:  # noqa: BLE001 - the outcome is what the test reads
        result["wrong_data"] = f"{type(err).__name__}: {err}"

    reference = loopax.Loop(_trainer())
    reference_data = _shuffled(seed)
    reference.run_to_step(reference_data, 10)
    result["reference_params"] = _host(reference.trainer.params)
    result["reference_position"] = reference_data.get_state()

    shared = loopax.Loop(_trainer())
    checkpointer = hooks.checkpoint(shared, shared_directory, every_n_steps=2)
    shared.run_to_step(_global(7), 6)
    checkpointer.wait()
    result["shared_params6"] = _host(shared.trainer.params)
    return result


def restore_on_one_process(directory, shared_directory, saved_directory):
    """1 process: a 2-process checkpoint read back on 4, 2 and 1 devices; another count for
    positions that differ is refused; a 1-process checkpoint at step 4 for the 1 -> 2 test."""
    import shutil

    import jax

    import loopax
    from loopax import hooks

    result = {"restored": {}}
    for count in (4, 2, 1):
        loop = loopax.Loop(_trainer(jax.devices()[:count]))
        copy = f"{saved_directory}-on-{count}"  # each run saves its own step 8
        shutil.copytree(shared_directory, copy)
        checkpointer = hooks.checkpoint(loop, copy)
        result["restored"][count] = [checkpointer.restored_step, _host(loop.trainer.params)]
        metrics = loop.run_to_step(_global(7), 8)  # training goes on from it
        checkpointer.wait()
        result.setdefault("losses", {})[count] = float(np.asarray(metrics["loss"]))
    try:
        hooks.checkpoint(loopax.Loop(_trainer()), directory)
    except ValueError as err:
        result["refused"] = str(err)
    result["load_params"] = _host(loopax.load_params(directory, step=6))

    loop = loopax.Loop(_trainer())
    checkpointer = hooks.checkpoint(loop, saved_directory)
    loop.run_to_step(Share(0, 0, 1), 4)
    checkpointer.wait()
    going_on = loopax.Loop(loop.trainer)  # on from step 4, saving nothing more
    going_on.run_to_step(Share(4, 0, 1), 8)
    result["one_process_params8"] = _host(going_on.trainer.params)
    return result


def resume_on_two_processes(saved_directory, damaged_directory):
    """2 processes resume a 1-process checkpoint of step 4 and train to 8; then they attach
    to a directory whose newest checkpoint has a corrupted shard."""
    import warnings

    import jax

    import loopax
    from loopax import hooks

    damaged = loopax.Loop(_trainer())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpointer = hooks.checkpoint(damaged, damaged_directory)
    result = {
        "damaged_restored": checkpointer.restored_step,
        "warnings": [str(w.message) for w in caught if "damaged" in str(w.message)],
        "damaged_steps": checkpointer.all_steps(),
    }

    loop = loopax.Loop(_trainer())
    checkpointer = hooks.checkpoint(loop, saved_directory, restore="latest", every_n_steps=100)
    restored = checkpointer.restored_step
    loop.run_to_step(Share(4, jax.process_index(), 2), 8)
    checkpointer.wait()
    return {**result, "restored": restored, "params8": _host(loop.trainer.params)}


def _die_at_step_4(loop, metrics):
    if loop.trainer.global_step == 4:
        import jax

        # Once the step's collectives are done: a peer killed inside one breaks gloo itself.
        jax.block_until_ready(metrics)
        print("process 1 dies now", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


class StepClock:
    """A clock that moves `seconds` at each reading (process 0) or never (`seconds=0`)."""

    def __init__(self, seconds):
        self.seconds, self.now = seconds, 0.0

    def __call__(self):
        self.now += self.seconds
        return self.now


def _full():
    return np.arange(8 * 64, dtype=np.float32).reshape(8, 64) / 7


def _sharded_fingerprint():
    """The fingerprint of an array sharded 2x2 over both processes' devices, from each
    process's part added up through the coordination service."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from loopax.hooks._checkpointing._coordination import Coordination
    from loopax.hooks._checkpointing._fingerprint import (
        combine,
        describe,
        device_checks,
        local_checks,
    )

    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    full = _full()
    sharding = NamedSharding(mesh, P("data", "model"))
    array = jax.make_array_from_callback(full.shape, sharding, lambda index: full[index])
    assert not array.is_fully_addressable
    parts = Coordination("fingerprint-test", BARRIER_TIMEOUT).all_gather(
        "parts", local_checks(device_checks([array])), "the fingerprint parts"
    )
    sums, finite = combine(parts)
    return [describe(full.dtype, full.shape, sums[0]), finite[0]]


def train_then_one_dies(directory):
    """First: saves every `period_seconds`, where only process 0's clock moves: both save the
    same steps. Then at step 4 process 1 is killed (SIGKILL) before its save: process 0's
    save fails within the barrier timeout, and the run that lost process 1 ends process 0
    with `LOST_PROCESS_EXIT` and a line naming process 1 (tests/loop/test_lost_process.py)."""
    import sys

    import jax

    import loopax
    from loopax import hooks

    print("SHARDED " + json.dumps(_sharded_fingerprint()), flush=True)
    clock = StepClock(0.6 if jax.process_index() == 0 else 0.0)
    timed = loopax.Loop(_trainer())
    checkpointer = hooks.checkpoint(
        timed, f"{directory}/timed", keep=None, period_seconds=1.0, clock=clock
    )
    timed.run_to_step(_shuffled(100 + jax.process_index()), 8)
    checkpointer.wait()
    print("TIMED " + json.dumps(checkpointer.all_steps()), flush=True)

    loop = loopax.Loop(_trainer())
    checkpointer = hooks.checkpoint(
        loop, f"{directory}/killed", every_n_steps=4, barrier_timeout=DEAD_TIMEOUT
    )
    if jax.process_index() == 1:
        loop.on_step("die", _die_at_step_4, loopax.Priority.VALIDATE)
    started = time.monotonic()
    try:
        loop.run_to_step(_shuffled(100 + jax.process_index()), 4)
        outcome = "saved"
    except Exception as err:  # noqa: BLE001 - the outcome is what the test reads
        outcome = f"{type(err).__name__}: {err}"
    print("OUTCOME " + json.dumps({"error": outcome, "seconds": time.monotonic() - started}))
    sys.stdout.flush()
    del checkpointer
    # The dead process would hold up JAX's own shutdown barrier: report and leave now.
    os._exit(0)


# -- the tests --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One 2-process run (saves, resume, reference) shared by the tests that read it."""
    root = tmp_path_factory.mktemp("multiprocess-checkpoints")
    directory, shared = root / "per-process", root / "shared"
    started = time.monotonic()
    values = multiprocess(2, 2, save_and_resume, str(directory), str(shared), timeout=TIMEOUT)
    return {
        "directory": directory,
        "shared": shared,
        "values": values,
        "root": root,
        "seconds": time.monotonic() - started,
    }


def test_background_saves_on_two_processes_finish_and_resume_exactly(saved):
    first, second = saved["values"]
    # The regression: the first background save used to hang both processes.
    assert first["steps"] == second["steps"] == [2, 4, 6]
    assert first["restored"] == second["restored"] == 6
    for value in (first, second):
        assert value["resumed_params"] == value["reference_params"]
        assert value["resumed_position"] == value["reference_position"]
    # Each process resumed its own data (seeds 100 and 101), not process 0's.
    assert first["resumed_position"]["seed"] == 100
    assert second["resumed_position"]["seed"] == 101
    assert first["back_to_4"][0] == second["back_to_4"][0] == 4
    assert first["back_to_4"][1] == second["back_to_4"][1]
    assert "process 1 could not restore its dataset position" in first["wrong_data"]
    assert "saved with seed 101 but this dataset has seed 1101" in second["wrong_data"]
    bundle = json.loads((saved["directory"] / "6" / "loopax" / "metadata").read_text())
    assert bundle["version"] == 3 and bundle["num_processes"] == 2
    assert [entry["train"]["seed"] for entry in bundle["process_datasets"]] == [100, 101]
    assert all(":" in value for value in bundle["fingerprints"].values())


@pytest.fixture(scope="module")
def moved(saved):
    """1 process reads the 2-process checkpoints; then 2 processes read a 1-process one and
    a copy of the 2-process one whose newest checkpoint has a corrupted shard."""
    import shutil

    root = saved["root"]
    one_process_directory, damaged = root / "one-process", root / "damaged"
    (one,) = multiprocess(
        1,
        4,
        restore_on_one_process,
        str(saved["directory"]),
        str(saved["shared"]),
        str(one_process_directory),
        timeout=TIMEOUT,
    )
    shutil.copytree(saved["directory"], damaged)
    # Corrupt the array data of checkpoint 10 (the newest; the resume saved 8 and 10).
    data_files = [
        path
        for path in (damaged / "10" / "state").rglob("*")
        if path.is_file() and "d" in path.parent.name.split(".")[-1]
    ]
    assert data_files
    for path in data_files:
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        path.write_bytes(bytes(raw))
    two = multiprocess(
        2,
        2,
        resume_on_two_processes,
        str(one_process_directory),
        str(damaged),
        timeout=TIMEOUT,
    )
    return {"one": one, "two": two, "damaged": damaged}


def test_a_two_process_checkpoint_restores_on_one_process_with_4_2_or_1_devices(saved, moved):
    first, result = saved["values"][0], moved["one"]
    for count in ("4", "2", "1"):
        step, params = result["restored"][count]
        assert step == 6 and params == first["shared_params6"], count
    losses = result["losses"]
    assert losses["4"] == pytest.approx(losses["1"], rel=1e-5)
    # Positions of two processes that differ do not map to one: refused, both counts named.
    assert "saved by 2 processes" in result["refused"]
    assert "this run has 1 processes" in result["refused"]
    assert result["load_params"] == first["params6"]


def test_a_one_process_checkpoint_resumes_on_two_processes(moved):
    for value in moved["two"]:
        assert value["restored"] == 4
        np.testing.assert_allclose(
            _leaves(value["params8"]),
            _leaves(moved["one"]["one_process_params8"]),
            rtol=1e-6,
            atol=1e-7,
        )


def _leaves(tree):
    import jax

    return np.concatenate([np.ravel(np.asarray(leaf)) for leaf in jax.tree.leaves(tree)])


def test_a_corrupted_shard_is_set_aside_on_every_process(moved):
    values = moved["two"]
    for value in values:
        assert value["damaged_restored"] == 8
        assert 10 not in value["damaged_steps"]
    assert any(values[0]["warnings"]) and (moved["damaged"] / "damaged" / "10").is_dir()


def test_a_dead_process_makes_the_survivors_save_fail_naming_it(tmp_path):
    with Processes(2, 2, train_then_one_dies, str(tmp_path), timeout=TIMEOUT) as group:
        results = group.wait(TIMEOUT)
    log = results[0].log
    assert results[1].returncode == -signal.SIGKILL
    # An array sharded over both processes: each adds its devices' part; the sum is the
    # host's fingerprint of the whole array.
    from loopax.hooks._checkpointing._fingerprint import host_fingerprint

    for result in results:
        line = next(line for line in result.log.splitlines() if line.startswith("SHARDED "))
        assert json.loads(line[len("SHARDED ") :]) == [host_fingerprint(_full()), True]
    # Process 0's clock decided the time-based saves of both (process 1's clock stood still).
    timed = [
        json.loads(next(line for line in r.log.splitlines() if line.startswith("TIMED "))[6:])
        for r in results
    ]
    assert timed[0] == timed[1] and len(timed[0]) > 1, timed
    # The save that lost process 1 never committed, and the run ends process 0 naming it.
    assert results[0].returncode == LOST_PROCESS_EXIT, log
    assert "OUTCOME " not in log
    line = log.strip().splitlines()[-1]
    assert line.startswith("loopax: lost process 1 of 2 ("), log
    assert "no checkpoint was committed in" in line, log
