"""Kill and resume with fused steps: a run with `steps_per_execution=32` is SIGKILLed in real
subprocesses (at a group end, in the middle of reading a group) and rerun in the same
directory, with the same or another K, until it completes. The result must be the
uninterrupted single-step run's, bit for bit: the final parameters, `loop.history` and the
metrics_log rows. Each run is a child forked from one interpreter that imported JAX and
loopax once (`zygote.py`).
"""

import concurrent.futures
import csv
import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from zygote import Zygote

WORKER = Path(__file__).with_name("fused_worker.py")
TARGET = 160  # checkpoints at 48, 96, 144 (keep=2) and the end-of-run save at 160
RUN_TIMEOUT_SECONDS = 180

# name -> ([(K, --kill) of each run in order; the last one is not killed], the steps the
# last run may resume from: more than one where a background save may or may not have
# committed when the kill came)
SCENARIOS = {
    "reference: single steps": ([(1, None)], {None}),
    "uninterrupted, K=32": ([(32, None)], {None}),
    "at a group end, resumed with K=32": ([(32, "group-end:100"), (32, None)], {48, 96}),
    "while reading a group, resumed with K=8": ([(32, "mid-group:110"), (8, None)], {48, 96}),
    "twice, resumed with K=1 then K=32": (
        [(32, "mid-group:20"), (1, "group-end:60"), (32, None)],
        {None, 48},
    ),
    # On-device data: the fused steps take their batches from the device arrays.
    "on-device data, at a group end, resumed with K=32": (
        [(32, "group-end:100 on-device"), (32, "on-device")],
        {48, 96},
    ),
    "on-device data, while reading a group, resumed with K=1 then K=32": (
        [(32, "mid-group:70 on-device"), (1, "group-end:90 on-device"), (32, "on-device")],
        {None, 48},
    ),
}
REFERENCE = "reference: single steps"


def kill_and_data(options):
    """A run's `--kill` (or None) and whether it reads on-device data, from its options."""
    words = (options or "").split()
    kills = [word for word in words if word != "on-device"]
    return (kills[0] if kills else None), "on-device" in words


def run_sequence(run_dir, runs, zygote):
    results = []
    for steps_per_execution, options in runs:
        command = [str(WORKER), str(run_dir), str(TARGET), str(steps_per_execution)]
        kill, on_device = kill_and_data(options)
        if kill is not None:
            command += ["--kill", kill]
        if on_device:
            command += ["--on-device"]
        done = zygote.run(command, timeout=RUN_TIMEOUT_SECONDS)
        results.append((kill, done.returncode, done.stdout, done.stderr[-20000:]))
        if kill is not None and done.returncode != -signal.SIGKILL:
            break  # the kill did not come: what follows would test nothing
    return results


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused-kills")
    env = dict(
        os.environ,
        JAX_COMPILATION_CACHE_DIR=str(root / "jax-cache"),
        JAX_PLATFORMS="cpu",
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
        PYTHONPATH=os.pathsep.join([str(WORKER.parent), os.environ.get("PYTHONPATH", "")]),
    )
    with Zygote(env) as zygote, concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = {
            name: pool.submit(run_sequence, root / f"run{index}", runs, zygote)
            for index, (name, (runs, _)) in enumerate(SCENARIOS.items())
        }
    return {
        name: (root / f"run{index}", futures[name].result()) for index, name in enumerate(SCENARIOS)
    }


def longest_group(start, steps_per_execution):
    """The longest fused group a run from `start` to TARGET makes: groups end where the
    worker's hooks fire (every 48 and every 40 steps) and hold a power of two of steps, at
    most K. A run resumed from 96 has 24-step stretches (16 + 8), one from 48 a 32-step one.
    """
    ends = {step for step in range(start + 1, TARGET + 1) if step % 48 == 0 or step % 40 == 0}
    edges = sorted({start, TARGET} | ends)
    stretch = max(b - a for a, b in zip(edges, edges[1:], strict=False))
    return min(steps_per_execution, 1 << (stretch.bit_length() - 1))


def test_longest_group_follows_the_hooks():
    assert [longest_group(start, 32) for start in (0, 48, 96)] == [32, 32, 16]


def outputs(run_dir):
    with np.load(run_dir / "params.npz") as saved:
        params = {name: saved[name] for name in saved.files}
    history = json.loads((run_dir / "history.json").read_text())
    with open(run_dir / "log.csv", newline="") as file:
        rows = sorted(csv.reader(file))
    return params, history, rows


@pytest.mark.parametrize("name", [name for name in SCENARIOS if name != REFERENCE])
def test_a_killed_fused_run_resumes_to_the_uninterrupted_result(scenarios, name):
    run_dir, results = scenarios[name]
    runs, resumable = SCENARIOS[name]
    for (kill, returncode, stdout, stderr), (_, options) in zip(results, runs, strict=False):
        assert kill == kill_and_data(options)[0]
        want_code = 0 if kill is None else -signal.SIGKILL
        assert returncode == want_code, f"run {kill}: {returncode}\n{stdout}\n{stderr}"
    assert len(results) == len(runs)
    last_stdout = results[-1][2]
    resumed = last_stdout.splitlines()[0].removeprefix("resumed from step ")
    assert (None if resumed == "None" else int(resumed)) in resumable, last_stdout
    assert f"done at step {TARGET}" in last_stdout
    if runs[-1][0] == 32:
        start = 0 if resumed == "None" else int(resumed)
        assert f"longest group {longest_group(start, 32)}" in last_stdout, last_stdout

    want_params, want_history, want_rows = outputs(scenarios[REFERENCE][0])
    params, history, rows = outputs(run_dir)
    assert params.keys() == want_params.keys()
    for key, want in want_params.items():
        assert np.array_equal(params[key], want), key
    assert history == want_history
    assert rows == want_rows
