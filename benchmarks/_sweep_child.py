"""A child process of the flag sweep (`bench_sweep.py`): one variant's XLA flags, fresh.

`python benchmarks/_sweep_child.py SPEC` (SPEC: JSON, `Sweep.start` writes it) builds the
variant's candidates, times them (`"mode": "time"`) or runs each once between two marker lines
on stderr with XLA's command-buffer logging on (`"mode": "diag"`), and prints its result as
one `SWEEP-JSON` line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common
import bench_fused
import jax
from _sweep_plan import AVERAGE, FUSED, LOOPAX, PLAIN, SCAN, candidate_key
from _xla_logs import MARK

from loopax.testing import count_compilations


def build_candidates(spec: dict, steps: int, fused_steps: int) -> tuple[dict, dict, list[str]]:
    """The child's candidates: `{key: run}` per group, compiled and run once; and n/a rows."""
    workload = _common.TINY
    step_runs: dict[str, Callable] = {}
    fused_runs: dict[str, Callable] = {}
    unavailable: list[str] = []
    if "step" in spec["groups"]:
        # One program per workload, whatever the batch count: the same jitted step (a cache
        # hit for each new state) and the same Loop, reading another cycling dataset.
        steppers = {
            name: _common._hand_written_step(workload, None, moving_average=average)
            for name, average in ((PLAIN, False), (AVERAGE, True))
        }
        jitted = {name: jax.jit(step, donate_argnums=0) for name, (step, _) in steppers.items()}
        captured: dict[str, Any] = {}
        for count in spec["batch_counts"]:
            batches = _common.make_batches(workload, count=count)
            for name, (_, init) in steppers.items():
                state = init(batches[0][1][0])
                run = _common._cycle(jitted[name], state, batches, steps, None)
                step_runs[candidate_key(name, count)] = run
            if "loop" not in captured:
                step_runs[candidate_key(LOOPAX, count)] = _common.loopax_loop(
                    workload, batches, steps, attach=lambda loop: captured.setdefault("loop", loop)
                )
            else:
                step_runs[candidate_key(LOOPAX, count)] = loop_run(
                    captured["loop"], _common.CyclingDataset(batches), steps
                )
    if "fused" in spec["groups"]:
        arrays = bench_fused.shuffled_arrays(workload)
        fused_runs[SCAN] = bench_fused.prestacked_scan(workload, arrays, fused_steps)
        rows = ((bench_fused.SHUFFLED_BARE, None, True),)
        directory = Path(spec["directory"])  # in the parent's scratch folder: removed with it
        fused, missing = bench_fused.shuffled_candidates(
            workload, arrays, fused_steps, rows, directory
        )
        if bench_fused.SHUFFLED_BARE in fused:
            fused_runs[FUSED] = fused[bench_fused.SHUFFLED_BARE]
        unavailable += [f"{FUSED}: {why}" for why in missing.values()]
    return step_runs, fused_runs, unavailable


def loop_run(loop: Any, dataset: Any, steps: int) -> Callable[[], None]:
    """`loop.run_steps(dataset, steps)`, waited for; run once now (no new program: same shapes)."""
    loop.run_steps(dataset, 2)

    def run() -> None:
        loop.run_steps(dataset, steps)["loss"].block_until_ready()

    return run


def time_worker(spec: dict) -> dict:
    """Timing child: candidates built, one warm-up round, then paired rotating rounds."""
    started = time.perf_counter()
    with count_compilations() as compiled:
        step_runs, fused_runs, unavailable = build_candidates(
            spec, spec["step_steps"], spec["fused_steps"]
        )
    built_at = time.perf_counter()
    result: dict[str, Any] = {
        "backend": jax.default_backend(),
        "unavailable": unavailable,
        "programs": len(compiled.names),
        "build_seconds": built_at - started,
        "groups": {},
    }
    for group, runs, steps in (
        ("step", step_runs, spec["step_steps"]),
        ("fused", fused_runs, spec["fused_steps"]),
    ):
        if not runs:
            continue
        # warm-up: each program runs at least 3 times after the last compilation anywhere
        _common.interleave(runs, steps, spec["warmup_rounds"], warmup=0)
        with count_compilations() as during:
            timings = _common.interleave(runs, steps, spec["rounds"], warmup=0)
        result["groups"][group] = {
            "steps": steps,
            "seconds": timings.seconds,
            "built_during_timing": during.names,
        }
    result["seconds"] = time.perf_counter() - started
    return result


def mark(text: str) -> None:
    """A marker line on the process's stderr, in order with XLA's own log lines."""
    os.write(2, f"{MARK} {text}\n".encode())


def diag_worker(spec: dict) -> dict:
    """Diagnostic child (command-buffer logging on): each candidate's counted run, marked."""
    step_runs, fused_runs, unavailable = build_candidates(
        spec, spec["diag_step_steps"], spec["diag_fused_steps"]
    )
    counted: dict[str, int] = {}
    runs = {**step_runs, **fused_runs}
    for run in runs.values():  # every program at least 3 times after the last compilation
        for _ in range(3):
            run()
    for key, run in runs.items():
        steps = spec["diag_fused_steps"] if key in fused_runs else spec["diag_step_steps"]
        mark(f"begin {key}")
        run()
        mark(f"end {key}")
        counted[key] = steps
    return {"counted": counted, "unavailable": unavailable}


def worker_main(argument: str) -> None:
    spec = json.loads(argument)
    result = diag_worker(spec) if spec["mode"] == "diag" else time_worker(spec)
    print("SWEEP-JSON " + json.dumps(result), flush=True)


if __name__ == "__main__":
    worker_main(sys.argv[1])
