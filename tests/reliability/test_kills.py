"""The kill matrix: a training run with every persistent hook is SIGKILLed at many points, in
real subprocesses, and rerun in the same directory until it completes. The result must be
the uninterrupted run's, bit for bit: the final parameters, the TensorBoard scalars (read with
TensorBoard's own reader), the metrics_log CSV, the plot's points and `loop.history`. So must
it after SIGTERM or SIGINT (Ctrl-C), which end the run cleanly at the step they come in.

The uninterrupted reference and every scenario run once per test session, 3 processes at a
time (the compiled steps are shared through JAX's disk cache); with pytest-xdist, the first
worker to need them runs them and the others read its results. Each run is a child forked
from one interpreter that imported JAX and loopax once (`zygote.py`: the ~45 processes spent
~1.4 s of CPU each importing them).
"""

import concurrent.futures
import csv
import fcntl
import itertools
import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from tensorboard_runs import keyed_scalars
from zygote import Zygote

WORKER = Path(__file__).with_name("reliability_worker.py")
TARGET = 32  # saves at 5, 10, ..., 30 (keep=2) and the end-of-run save at 32
CONCURRENT_PROCESSES = 3
RUN_TIMEOUT_SECONDS = 180
TMP = ".orbax-checkpoint-tmp"

# name -> (the --kill of each killed run in order, the steps the final run may resume from
# (more than one where a background save may or may not have committed when the kill came),
# entries the checkpoint directory must hold right after the last kill)
SCENARIOS = {
    "before the first save": (["at-step:3"], {None}, set()),
    "right after a save was issued": (["after-save-issued:10"], {5, 10}, set()),
    "inside the commit of a periodic save": (["in-commit:15"], {10}, {"10", f"15{TMP}"}),
    "right after the commit of a periodic save": (["after-commit:10"], {10}, {"10"}),
    "between a commit and the deletion of an old checkpoint": (
        ["before-delete:10"],
        {20},
        {"10", "15", "20"},
    ),
    "during an evaluation": (["in-eval:12"], {5, 10}, set()),
    "after a TensorBoard write, before any flush": (["tensorboard-write:9"], {None, 5}, set()),
    "after a metrics_log write, before its checkpoint": (["metrics-log-write:14"], {5, 10}, set()),
    "after a plot write, before its checkpoint": (["plot-write:19"], {10, 15}, set()),
    "between saves at step 7": (["at-step:7"], {None, 5}, set()),
    "between saves at step 18": (["at-step:18"], {10, 15}, set()),
    "between the last periodic save and the end": (["at-step:27"], {20, 25}, set()),
    "inside the commit of the end-of-run save": (["in-commit:32"], {30}, {"30", f"32{TMP}"}),
    "right after the commit of the end-of-run save": (["after-commit:32"], {32}, {"30", "32"}),
    # The run returns while its end-of-run save commits in the background: a kill right
    # then may cut the save off (the rerun resumes from 30 and runs the last 2 steps again).
    "after the run, before the program wrote its results": (["after-run:32"], {30, 32}, {"30"}),
    "twice, inside a commit then during an evaluation": (
        ["in-commit:20", "in-eval:24"],
        {15, 20},
        set(),
    ),
    # A signal ends the run after its step, saved: the end of the run does not write the
    # last points (evaluation, train scalars) an uninterrupted run never writes there.
    "SIGTERM between evaluations and logs": (["sigterm-at-step:7"], {7}, {"5", "7"}),
    "SIGINT between evaluations and logs": (["sigint-at-step:13"], {13}, {"10", "13"}),
    "SIGTERM at a step that saves and evaluates": (["sigterm-at-step:20"], {20}, {"15", "20"}),
    "SIGTERM, then SIGKILL after the next save": (
        ["sigterm-at-step:11", "at-step:16"],
        {11, 15},
        set(),
    ),
}
# The exit status of a run stopped at a kill point: SIGKILL, or 128 + the signal's number
# for the points that send SIGTERM or SIGINT (the run ends cleanly there).
EXIT_STATUS = {"sigterm-at-step": 128 + signal.SIGTERM, "sigint-at-step": 128 + signal.SIGINT}


def exit_status(kill):
    return EXIT_STATUS.get(kill.partition(":")[0], -signal.SIGKILL)


REFERENCE = "uninterrupted"
MOVING_AVERAGES = ("train/moving_average_loss", "train/Moving Average Accuracy")


def worker_env(cache):
    return dict(
        os.environ,
        JAX_COMPILATION_CACHE_DIR=str(cache),
        JAX_PLATFORMS="cpu",
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )


def run_sequence(run_dir, kills, zygote):
    """Runs the worker once per kill, then once more to completion; returns what each run
    did and what the checkpoint directory held after it."""
    runs = []
    for kill in [*kills, None]:
        command = [str(WORKER), str(run_dir), str(TARGET)]
        if kill is not None:
            command += ["--kill", kill]
        done = zygote.run(command, timeout=RUN_TIMEOUT_SECONDS)
        checkpoints = run_dir / "ckpt"
        runs.append(
            {
                "kill": kill,
                "returncode": done.returncode,
                "stdout": done.stdout,
                "stderr": done.stderr[-20000:],
                "checkpoints": sorted(os.listdir(checkpoints)) if checkpoints.is_dir() else [],
            }
        )
        if kill is not None and done.returncode != exit_status(kill):
            break  # the kill did not come: what follows would test nothing
    return runs


def run_matrix(root):
    env = worker_env(root / "jax-cache")
    jobs = {REFERENCE: []} | {name: kills for name, (kills, _, _) in SCENARIOS.items()}
    with (
        Zygote(env) as zygote,
        concurrent.futures.ThreadPoolExecutor(CONCURRENT_PROCESSES) as pool,
    ):
        futures = {
            name: pool.submit(run_sequence, root / f"run{index}", kills, zygote)
            for index, (name, kills) in enumerate(jobs.items())
        }
    return {
        name: {"run_dir": str(root / f"run{index}"), "runs": futures[name].result()}
        for index, name in enumerate(jobs)
    }


@pytest.fixture(scope="session")
def matrix(tmp_path_factory):
    """Every scenario's runs, made once per session even across xdist workers."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    root = shared / "reliability-kill-matrix"
    root.mkdir(exist_ok=True)
    with open(shared / "reliability-kill-matrix.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other workers wait for the first one's results
        results = root / "results.json"
        if not results.exists():
            results.write_text(json.dumps(run_matrix(root)))
    return json.loads(results.read_text())


# -- reading what a run left ---------------------------------------------------------------


def final_params(run_dir):
    with np.load(Path(run_dir) / "params.npz") as saved:
        return {name: saved[name] for name in saved.files}


def tensorboard_scalars(run_dir):
    """{key: [(step, value)]} as TensorBoard shows them, every run directory's (`train`,
    `eval/<dataset>`) by loopax key: its reader drops the events that a `SessionLog.START`
    (written by loopax on resume, into each run directory) says were superseded."""
    return keyed_scalars(Path(run_dir) / "tb")


def metrics_log_points(run_dir):
    """The CSV's rows as (metric, step, value), sorted: the order within a step may differ."""
    with open(Path(run_dir) / "log.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    return sorted((row["metric"], int(row["step"]), row["value"]) for row in rows)


def plot_points(run_dir):
    lines = (Path(run_dir) / "plot" / "plot_points.jsonl").read_text().splitlines()
    points = [json.loads(line) for line in lines]
    return sorted((point["metric"], point["step"], point["value"]) for point in points)


def history(run_dir):
    return json.loads((Path(run_dir) / "history.json").read_text())


def logs(run_dir):
    """Every log as {(output, series): points}."""
    series = {}
    for tag, points in tensorboard_scalars(run_dir).items():
        series[("tensorboard", tag)] = points
    for name, read in (("metrics_log", metrics_log_points), ("plot", plot_points)):
        for metric, step, value in read(run_dir):
            series.setdefault((name, metric), []).append((step, value))
    for key, points in history(run_dir).items():
        series[("history", key)] = [tuple(point) for point in points]
    return series


def resumed_from(run):
    line = next(line for line in run["stdout"].splitlines() if line.startswith("resumed from"))
    step = line.rsplit(" ", 1)[1]
    return None if step == "None" else int(step)


def describe(runs):
    return "\n".join(
        f"--kill {run['kill']}: returncode {run['returncode']}, checkpoints "
        f"{run['checkpoints']}\n{run['stdout']}{run['stderr'][-1500:]}"
        for run in runs
    )


@pytest.fixture(scope="session")
def reference(matrix):
    result = matrix[REFERENCE]
    (run,) = result["runs"]
    assert run["returncode"] == 0, describe(result["runs"])
    assert run["checkpoints"] == ["30", "32"]
    return {"params": final_params(result["run_dir"]), "logs": logs(result["run_dir"])}


# -- the tests -------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_killed_then_resumed_run_has_the_uninterrupted_parameters(matrix, reference, scenario):
    kills, resume_steps, left_after_kill = SCENARIOS[scenario]
    runs = matrix[scenario]["runs"]
    assert [run["kill"] for run in runs] == [*kills, None], describe(runs)
    for run in runs[:-1]:
        assert run["returncode"] == exit_status(run["kill"]), describe(runs)
    assert left_after_kill <= set(runs[-2]["checkpoints"]), describe(runs)
    final = runs[-1]
    assert final["returncode"] == 0, describe(runs)
    assert resumed_from(final) in resume_steps, describe(runs)
    assert f"done at step {TARGET}" in final["stdout"]
    for killed, rerun in itertools.pairwise(runs):
        if any(TMP in entry for entry in killed["checkpoints"]):
            # A save cut off before its commit never became a checkpoint; the rerun says so.
            assert "incomplete save(s)" in rerun["stderr"], describe(runs)
    # Leftovers removed; the newest two kept. A kill between a commit and the keep policy's
    # deletion leaves an older checkpoint too, until the next save applies the policy again.
    assert not [entry for entry in final["checkpoints"] if TMP in entry], describe(runs)
    assert final["checkpoints"][-2:] == ["30", "32"], describe(runs)

    want, got = reference["params"], final_params(matrix[scenario]["run_dir"])
    assert sorted(want) == sorted(got)
    for name in want:
        assert np.array_equal(want[name], got[name]), name  # bit for bit


def differences(want, got):
    return sorted(key for key in set(want) | set(got) if want.get(key) != got.get(key))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_killed_then_resumed_run_has_the_uninterrupted_logs(matrix, reference, scenario):
    runs = matrix[scenario]["runs"]
    assert runs[-1]["returncode"] == 0, describe(runs)
    want, got = reference["logs"], logs(matrix[scenario]["run_dir"])
    assert sorted(want) == sorted(got)
    differing = differences(want, got)
    assert not differing, {key: (want.get(key), got.get(key)) for key in differing}


def test_a_resumed_run_continues_the_moving_averages_of_its_checkpoint(matrix, reference):
    # Killed right after checkpoint 10 committed: the rerun resumes from step 10.
    scenario = "right after the commit of a periodic save"
    runs = matrix[scenario]["runs"]
    assert resumed_from(runs[-1]) == 10, describe(runs)
    got = logs(matrix[scenario]["run_dir"])
    for output in ("tensorboard", "metrics_log", "plot", "history"):
        for metric in MOVING_AVERAGES:
            key = (output, metric)
            assert got[key] == reference["logs"][key], key
