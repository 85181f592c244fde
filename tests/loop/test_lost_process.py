"""A lost process: SIGKILL to one of 2 processes, at a step or during a background save, or
an error that ends one alone; the survivor ends with one line (the lost process, the newest
checkpoint both committed, the command that resumes) and `loopax.LOST_PROCESS_EXIT`, and a
rerun resumes from that checkpoint exactly.

Each case runs real JAX processes joined by `jax.distributed` (2 processes x 1 CPU device,
gloo) through `loopax.testing`; the functions they run are at the top level of this module.
JAX's own heartbeat timeout is set far past the group's timeout, so a survivor that waited
for it would hang and fail the test: only loopax's bound (`LOOPAX_LOST_PROCESS_TIMEOUT`)
or a lost coordinator ends it; one case turns the bounds around, so that JAX's abort comes
first and loopax must catch it. The detector's own rules (the bound, a process that ended,
a report from another process, the wait after an error) are checked on a fake clock.
"""

from __future__ import annotations

import os
import re
import signal
import threading
from pathlib import Path

import pytest

import loopax
from loopax.loop._lost_process import TIMEOUT_VARIABLE, Heartbeat, Lost, lost_process_timeout
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


def _kill():
    os.kill(os.getpid(), signal.SIGKILL)


def _raise():
    raise RuntimeError("this process fails alone")


def _die_once(directory, ready, what, die=_kill):
    """Dies (SIGKILL) once `ready(names in directory)` (waits up to 60 s)."""
    import time

    for _ in range(12000):
        if ready(os.listdir(directory)):
            print(f"dying {what}", flush=True)
            die()
        time.sleep(0.005)
    print(f"never got to die {what}", flush=True)


def _die(directory, when):
    def die(loop, metrics):
        step = loop.trainer.global_step
        if when == "step" and step == KILLED_AT:
            # After the background commit of checkpoint 4, whose writer thread runs on.
            _die_once(directory, lambda names: "4" in names, f"after step {step}")
        if when == "error" and step == KILLED_AT:
            _die_once(directory, lambda names: "4" in names, "of an error", _raise)
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


# Whose bound ends the survivor: loopax's (2 s; JAX's far past the group's timeout), or JAX's
# own heartbeat timeout (5 s; loopax's far past it), whose C++ abort loopax catches.
BOUNDS = {"loopax": (2, 10 * TIMEOUT), "jax": (10 * TIMEOUT, 5)}


@pytest.mark.parametrize(
    ("victim", "when", "bound"),
    [(1, "step", "loopax"), (0, "step", "loopax"), (1, "save", "loopax"),
     (0, "save", "loopax"), (1, "step", "jax"), (1, "error", "loopax")],
)  # fmt: skip
def test_a_lost_process_ends_the_survivor_with_one_line_and_a_rerun_resumes(
    tmp_path, victim, when, bound
):
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    loopax_seconds, jax_seconds = BOUNDS[bound]
    with Processes(
        2, 1, train_until_one_dies, str(directory), victim, when,
        env={TIMEOUT_VARIABLE: str(loopax_seconds)}, heartbeat_timeout=jax_seconds,
        timeout=TIMEOUT,
    ) as group:  # fmt: skip
        results = group.wait(TIMEOUT)
    logs = "\n".join(
        f"----- process {r.process_id} (exit {r.returncode}) -----\n{r.log}" for r in results
    )
    survivor = results[1 - victim]
    if when == "error":  # an uncaught error ends its interpreter: a traceback, no beats
        assert "RuntimeError: this process fails alone" in results[victim].log, logs
        assert not results[victim].timed_out, logs
    else:
        assert results[victim].returncode == -signal.SIGKILL, logs
    assert "dying" in results[victim].log, logs
    assert survivor.returncode == loopax.LOST_PROCESS_EXIT == 75, logs
    # The save cut off is no checkpoint: it stays under its temporary name, and the newest
    # step directory is what the line names. (Its writer threads race the victim's death:
    # a save that committed first is a checkpoint like any other.)
    committed = _committed(directory)
    expected = committed[-1]
    if when != "save":
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


class Store:
    """The coordination service's key-value store, as JAX's client shows it."""

    def __init__(self):
        self.values, self.down = {}, False

    def _answer(self):
        if self.down:
            raise RuntimeError("UNAVAILABLE: Failed to send RPC to coordination service")

    def key_value_set(self, key, value, allow_overwrite=False):
        self._answer()
        if key in self.values and not allow_overwrite:
            raise RuntimeError(f"ALREADY_EXISTS: {key}")
        self.values[key] = value

    def key_value_dir_get(self, prefix):
        self._answer()
        return [(key, value) for key, value in self.values.items() if key.startswith(prefix)]

    def key_value_try_get(self, key):
        self._answer()
        if key not in self.values:
            raise RuntimeError(f"NOT_FOUND: {key}")
        return self.values[key]


def test_a_process_is_lost_after_the_bound_of_silence_and_not_before():
    store, now, found = Store(), [0.0], []
    beats = [
        Heartbeat(store, process, 4, 2.0, found.append, clock=lambda: now[0])
        for process in range(4)
    ]
    beats[0].add_watcher()  # in a run; process 1 is not (yet)
    beats[3].stop()  # ended: its interpreter exits; never waited for

    def tick(*processes):
        for process in processes:
            beats[process].tick()
        now[0] += 0.5

    for _ in range(4):
        tick(0, 1, 2)
    # Process 2 stops answering; process 0 (which read its last beat at 2.0 s) sees it lost
    # once more than 2 s have passed, not before.
    for _ in range(5):
        tick(0, 1)
    assert found == []
    tick(0, 1)
    assert found == [Lost(2, "no heartbeat for 2.5 s")]
    # Process 0 writes it down; process 1, in a run now, ends with what process 0 found.
    beats[0].write_lost(found[0])
    beats[1].add_watcher()
    tick(1)
    assert found[1] == Lost(2, "no heartbeat for 2.5 s; process 0 found it")
    # Not watching (between runs): nothing happens.
    quiet_store, quiet = Store(), []
    idle = Heartbeat(quiet_store, 1, 2, 2.0, quiet.append, clock=lambda: now[0])
    quiet_store.values["loopax/alive/0"] = "1"
    for _ in range(10):
        idle.tick()
        now[0] += 0.5
    assert quiet == [] and idle.stalest(now[0], 2.0) == Lost(0, "no heartbeat for 5.0 s")
    # The coordinator's service out of reach: lost only after the bound, not at one failure.
    idle.add_watcher()
    quiet_store.down = True
    for _ in range(5):
        idle.tick()
        now[0] += 0.5
    assert quiet == []
    idle.tick()
    assert quiet == [Lost(0, "its coordination service did not answer for 2.5 s")]


def test_after_an_error_a_run_waits_for_two_more_beats_of_every_process():
    store, now = Store(), [0.0]
    alive, dead, me = (
        Heartbeat(store, process, 3, 2.0, pytest.fail, clock=lambda: now[0]) for process in range(3)
    )
    for beat in (alive, dead, me, alive, dead, me):
        beat.tick()
    dead.tick()  # its last beat, written before it died, read after the error
    slept = []

    def sleep(seconds):
        slept.append(seconds)
        now[0] += seconds
        if len(slept) % 2:
            alive.tick()
        me.tick()

    me.wait_for_beats(sleep)  # not watching: returns at its deadline, the dead one silent
    assert now[0] == pytest.approx(2.0 + 3 * 0.5)
    dead.stop()  # once it ended, no one waits for it
    slept.clear()
    started = now[0]
    me.wait_for_beats(sleep)
    assert now[0] - started == pytest.approx(3 * 0.125)  # alive beat at the 1st and 3rd sleep
