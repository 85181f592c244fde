"""A lost process: SIGKILL one of 2 processes, at a step or during a background save; the
survivor ends with one line (the lost process, the newest checkpoint both committed, the
command that resumes) and `loopax.LOST_PROCESS_EXIT`, and a rerun resumes from that
checkpoint exactly.

Each case runs real JAX processes joined by `jax.distributed` (2 processes x 1 CPU device,
gloo) through `loopax.testing`; the functions they run are at the top level of this module.
JAX's own heartbeat timeout is set far past the group's timeout, so a survivor that waited
for it would hang and fail the test: only loopax's bound (`LOOPAX_LOST_PROCESS_TIMEOUT`)
or a lost coordinator ends it.
"""

from __future__ import annotations

import os
import re
import signal
import threading
from pathlib import Path

import pytest

import loopax
from loopax.loop._lost_process import TIMEOUT_VARIABLE, lost_process_timeout
from loopax.testing import Processes, multiprocess

# Their processes fork from one pre-imported interpreter (conftest.py, tests/zygote.py).
pytestmark = pytest.mark.usefixtures("forked_processes")

TIMEOUT = 120  # per group of processes: a survivor that hangs fails the test
EVERY = 4  # a checkpoint every 4 steps
KILLED_AT = 6  # "step": the victim dies after step 6 (checkpoint 4 committed)
SAVE_CUT = 8  # "save": the victim dies while checkpoint 8 is being written
RESUME_TO = 12


def _loop():
    import flax.linen as nn
    import jax
    import numpy as np
    import optax

    trainer = loopax.Trainer(
        lambda ctx, spec, x: nn.Dense(1)(nn.Dense(8)(x[0])),
        loopax.losses.mean_squared_error,
        optax.adam(0.01),
        devices=jax.devices(),
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype(np.float32)
    data = loopax.ArrayDataset(
        x, x.sum(axis=1, keepdims=True), batch_size=8, loop_forever=True, shard_by_process=True
    )
    return loopax.Loop(trainer), data


def _die_once(directory, ready, what):
    """SIGKILL to this process once `ready(names in directory)` (waits up to 60 s)."""
    import time

    for _ in range(12000):
        if ready(os.listdir(directory)):
            print(f"dying {what}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.005)
    print(f"never got to die {what}", flush=True)


def _die(directory, when):
    def die(loop, metrics):
        step = loop.trainer.global_step
        if when == "step" and step == KILLED_AT:
            # After the background commit of checkpoint 4, whose writer thread runs on.
            _die_once(directory, lambda names: "4" in names, f"after step {step}")
        if when == "save" and step == SAVE_CUT:
            # The checkpoint hook has taken the save (its writer thread commits it while the
            # steps go on): die once Orbax is writing it, under its temporary name.
            def started(names):
                return any(name.startswith(f"{SAVE_CUT}.") for name in names)

            what = f"during the save of step {step}"
            threading.Thread(target=_die_once, args=(directory, started, what)).start()

    return die


def train_until_one_dies(directory, victim, when):
    import jax

    loop, data = _loop()
    loopax.hooks.checkpoint(loop, directory, every_n_steps=EVERY)
    if jax.process_index() == victim:
        loop.on_step("die", _die(directory, when), loopax.Priority.UI)
    loop.run_to_step(data, 1000)
    return "finished"


def resume_and_compare(directory):
    """The rerun: resumes from the newest checkpoint to RESUME_TO, and an uninterrupted run
    to RESUME_TO in the same process as the reference."""
    import jax
    import numpy as np

    def host(tree):
        return [np.asarray(leaf.addressable_data(0)).tolist() for leaf in jax.tree.leaves(tree)]

    loop, data = _loop()
    checkpointer = loopax.hooks.checkpoint(loop, directory, every_n_steps=EVERY)
    restored = checkpointer.restored_step
    loop.run_to_step(data, RESUME_TO)
    checkpointer.wait()
    reference, reference_data = _loop()
    reference.run_to_step(reference_data, RESUME_TO)
    return {
        "restored": restored,
        "same": host(loop.trainer.params) == host(reference.trainer.params),
    }


def _committed(directory: Path) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())


@pytest.mark.parametrize(("victim", "when"), [(1, "step"), (0, "step"), (1, "save"), (0, "save")])
def test_a_lost_process_ends_the_survivor_with_one_line_and_a_rerun_resumes(tmp_path, victim, when):
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    env = {TIMEOUT_VARIABLE: "2"}
    with Processes(
        2, 1, train_until_one_dies, str(directory), victim, when,
        env=env, heartbeat_timeout=10 * TIMEOUT, timeout=TIMEOUT,
    ) as group:  # fmt: skip
        results = group.wait(TIMEOUT)
    logs = "\n".join(
        f"----- process {r.process_id} (exit {r.returncode}) -----\n{r.log}" for r in results
    )
    survivor = results[1 - victim]
    assert results[victim].returncode == -signal.SIGKILL, logs
    assert "dying" in results[victim].log, logs
    assert survivor.returncode == loopax.LOST_PROCESS_EXIT == 75, logs
    # The save cut off is no checkpoint: it stays under its temporary name, and the newest
    # step directory is what the line names. (Its writer threads race the victim's death:
    # a save that committed first is a checkpoint like any other.)
    committed = _committed(directory)
    expected = committed[-1]
    if when == "step":
        assert expected == 4, (os.listdir(directory), logs)
    else:
        cut = [name for name in os.listdir(directory) if name.startswith(f"{SAVE_CUT}.")]
        assert expected == (SAVE_CUT if SAVE_CUT in committed else 4), logs
        assert expected == SAVE_CUT or cut, (os.listdir(directory), logs)
    line = survivor.log.strip().splitlines()[-1]
    assert line.startswith(f"loopax: lost process {victim} of 2 ("), logs
    how = "no heartbeat for" if victim == 1 else "the coordinator"
    assert how in line, logs
    assert (
        f"the last checkpoint every process committed is step {expected} "
        f"('{directory / str(expected)}')" in line
    ), logs
    assert f"process {1 - victim} exits with status 75 (LOST_PROCESS_EXIT)" in line, logs
    assert re.search(r"run every process again, this one with: \S", line), logs

    rerun = multiprocess(2, 1, resume_and_compare, str(directory), timeout=TIMEOUT)
    assert [value["restored"] for value in rerun] == [expected, expected]
    assert all(value["same"] for value in rerun), rerun
    assert _committed(directory)[-1] == RESUME_TO
    assert not [p.name for p in directory.iterdir() if "tmp" in p.name]  # cleaned up


def test_the_bound_is_read_from_the_environment_and_checked():
    assert lost_process_timeout({}) == 10.0
    assert lost_process_timeout({TIMEOUT_VARIABLE: "2.5"}) == 2.5
    for bad in ("0", "-1", "nan", "ten"):
        with pytest.raises(ValueError, match=rf"{TIMEOUT_VARIABLE}='{bad}' is not a positive"):
            lost_process_timeout({TIMEOUT_VARIABLE: bad})
