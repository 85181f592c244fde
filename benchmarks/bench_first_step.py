"""Time to first step (issue 33 item 4): a fused run's against a per-step run's, tiny MLP.

Each run is a fresh process with every compilation cache off (JAX's persistent cache and
loopax's default one), so each compiles all its programs, and no run reuses another's
compilations or autotuning results. A run builds its Trainer and Loop (the tiny MLP of
`_common.TINY`, on-device data reshuffled every epoch, as the `fused` section's), then times
`loop.run_steps(data, STEPS)` with a hook every `CUT_EVERY` steps (so groups of fewer than K
steps come too: tails before each firing), from the call to the first step's loss on the
host: for a fused run, the end of its first group, read by a hook that fires at group ends
without cutting them short. It also names the programs compiled before that and in the
whole run. Runs of the candidates alternate, `rounds` each; the ratio is the median over
rounds of fused / per-step.

Run: python benchmarks/bench_first_step.py [--rounds N]   (= run_all.py --device --only first-step)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import jax

STEPS = 256
CUT_EVERY = 100  # a hook's period: K=8 groups 8 x 12 + 4 before each firing, K=32 32 x 3 + 4
KINDS = (1, 8, 32)  # steps per execution; 1 is the per-step run
TARGET = 1.2  # issue 33: a fused run's time to first step <= 1.2x the per-step run's
MARK = "FIRST-STEP-JSON "


def worker(k: int) -> dict[str, Any]:
    """One run of `STEPS` steps with `steps_per_execution=k`, in this (fresh) process."""
    jax.config.update("jax_enable_compilation_cache", False)
    import _common
    import bench_fused

    import loopax
    from loopax import hooks
    from loopax.testing import count_compilations

    class FirstGroupEnd(loopax.hooks.Schedule):
        """Fires once, at the first group's end (a clock's kind: it cuts no group short)."""

        time_based = True
        checks_every_step = True

        def start_run(self, run: Any) -> None:
            self.fired_once = False

        def should_fire(self, run: Any) -> bool:
            fire, self.fired_once = not self.fired_once, True
            return fire

    workload = _common.TINY
    x, y = bench_fused.shuffled_arrays(workload)
    data = loopax.ArrayDataset(
        x,
        y,
        workload.batch_size,
        seed=bench_fused.SHUFFLE_SEED,
        loop_forever=True,
        on_device=True,
        devices=jax.devices()[:1],
    )
    trainer = loopax.Trainer(
        workload.model_fn, _common.loss_fn, workload.optimizer(), devices=jax.devices()[:1]
    )
    loop = loopax.Loop(trainer, steps_per_execution=k)
    first: dict[str, Any] = {}

    with count_compilations() as built:

        def at_first_group_end(loop: Any, metrics: dict) -> None:
            jax.block_until_ready(metrics["loss"])
            first["seconds"] = time.perf_counter() - started
            first["steps"] = loop.trainer.global_step
            first["programs"] = list(built.names)

        loop.on_step("first step", at_first_group_end, when=FirstGroupEnd())
        hooks.every_n_steps(loop, CUT_EVERY, "cut", lambda loop, metrics: None)
        started = time.perf_counter()
        loop.run_steps(data, STEPS)["loss"].block_until_ready()
        whole = time.perf_counter() - started
    return {
        "k": k,
        "first_step": first["seconds"],
        "first_steps": first["steps"],
        "before": first["programs"],
        "programs": built.names,
        "whole": whole,
        "group_sizes": sorted(executor.info.steps for executor in trainer.executors()),
    }


def run_worker(k: int, timeout: float) -> tuple[dict | None, str]:
    """`worker(k)` in a fresh process with the caches off; its figures, or None and why not."""
    env = dict(os.environ, LOOPAX_COMPILATION_CACHE="off", JAX_ENABLE_COMPILATION_CACHE="false")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    command = [sys.executable, __file__, "--worker", str(k)]
    try:
        done = subprocess.run(
            command, env=env, stdout=subprocess.PIPE, text=True, check=False, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return None, f"n/a (worker timed out after {timeout:.0f} s)"
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if not lines:
        return None, f"n/a (worker failed with exit code {done.returncode})"
    return json.loads(lines[-1][len(MARK) :]), ""


def _programs(names: list[str]) -> str:
    counts: dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{name} x{n}" if n > 1 else name for name, n in counts.items())


def section(rounds: int, timeout: float = 120.0) -> dict:
    """The rows: each candidate's median time to first step, its programs, fused / per-step."""
    figures: dict[int, list[dict]] = {k: [] for k in KINDS}
    failed: dict[int, str] = {}
    for index in range(rounds):
        order = KINDS[index % len(KINDS) :] + KINDS[: index % len(KINDS)]  # rotated
        for k in order:
            if k in failed:
                continue
            result, why = run_worker(k, timeout)
            if result is None:
                failed[k] = why
            else:
                figures[k].append(result)
    rows: list[tuple[str, str]] = []
    for k in KINDS:
        name = "per step (K=1)" if k == 1 else f"fused K={k}"
        if k in failed or not figures[k]:
            rows.append((name, failed.get(k, "n/a")))
            continue
        runs = figures[k]
        seconds = statistics.median(run["first_step"] for run in runs)
        last = runs[-1]
        rows.append(
            (
                f"{name}: time to first step",
                f"{seconds:.2f} s (median of {len(runs)}; its first {last['first_steps']} "
                f"step(s)); before it: {_programs(last['before'])}; whole run: "
                f"{_programs(last['programs'])} (group sizes {last['group_sizes']})",
            )
        )
    base = figures[KINDS[0]]
    for k in KINDS[1:]:
        pairs = list(zip(base, figures[k], strict=False))
        if not pairs:
            continue
        ratio = statistics.median(fused["first_step"] / one["first_step"] for one, fused in pairs)
        passed = "PASS" if ratio <= TARGET else "FAIL"
        rows.append(
            (
                f"time to first step, fused K={k} / per step",
                f"{ratio:.2f}x  target <= {TARGET}  {passed}",
            )
        )
    return {
        "title": f"device first-step: tiny MLP ({STEPS}-step run, a hook every {CUT_EVERY} "
        "steps, on-device data reshuffled every epoch), each run a fresh process with the "
        f"compilation caches off; {rounds} rounds, rotated",
        "rows": rows,
        "header": False,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.worker is not None:
        print(MARK + json.dumps(worker(args.worker)), flush=True)
        return
    result = section(args.rounds)
    print(result["title"])
    for name, value in result["rows"]:
        print(f"  {name}: {value}")


if __name__ == "__main__":
    main()
