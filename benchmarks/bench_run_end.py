"""What a short run costs as a whole: `run_steps` with the README's hooks against the bare Loop.

Workload: the tiny MLP (64 -> 128 -> 10, batch 64, adam), 3000 steps a run (issue 25: a
notebook cell, a loop of `run_steps` calls, evaluation rounds). Each candidate is timed over
the whole `run_steps` call, its end included: the README hooks' end-of-run checkpoint save,
the TensorBoard flush, the progress bar's close. The run returns once the saved state is in
memory; Orbax writes it in the background (the next save, a restore, `wait()` and the exit
wait for it), so what is left at the end is the copy off the device and the log flush. A
second README row stops the clock at the first OnEnd hook (the steps alone), to show what
the end costs. Rounds are interleaved as in every benchmark here (`_common.interleave`);
the ratio is the median of the paired per-round ratios. Target (issue 25): the whole run
with the README hooks >= 0.97x the bare Loop.

Run: python benchmarks/bench_run_end.py [--rounds 21]
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common

STEPS = 3000
ROUNDS = (21, 5)  # full run / --quick
TARGET = 0.97
BARE = "loopax Loop, bare, whole run_steps"
README_WHOLE = "loopax Loop + README hooks, whole run_steps"
README_STEPS = "  same, steps only (to the first OnEnd hook)"


def candidates(steps: int, directory: Path) -> dict[str, Callable[[], Any]]:
    """The bare Loop and the README-hooks Loop, each a fresh trainer on the tiny batches."""
    workload = _common.TINY
    batches = _common.make_batches(workload)
    attach, why = _common.readme_hooks(directory)
    if attach is None:
        raise SystemExit(why)
    captured: dict[str, Any] = {}

    def attach_and_keep(loop: Any) -> None:
        attach(loop)
        captured["loop"] = loop

    readme = _common.loopax_loop(workload, batches, steps, attach=attach_and_keep)
    return {
        BARE: _common.loopax_loop(workload, batches, steps),
        # {"": steps only, "whole": the whole call}, recorded as two rows.
        README_WHOLE: _common.split_end_of_run(readme, captured["loop"]),
    }


def section(quick: bool, rounds: int | None = None, on_round: Callable | None = None) -> dict:
    """The run-end comparison as a `run_all.py` section (title, rows, pairs)."""
    directory = Path(tempfile.mkdtemp(prefix="loopax-bench-run-end-"))
    # Registered before the checkpoint hook's own exit wait, so it runs after it.
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    rounds = rounds if rounds is not None else ROUNDS[quick]
    timings = _common.interleave(candidates(STEPS, directory), STEPS, rounds, on_round=on_round)
    # split_end_of_run records the steps-only time under the row's name, the whole call
    # under name + "whole".
    whole, steps_only = README_WHOLE + "whole", README_WHOLE
    rows = [(BARE, timings.rate(BARE), 1.0, 0.0)]
    for label, row in ((README_WHOLE, whole), (README_STEPS, steps_only)):
        rows.append((label, timings.rate(row), timings.ratio(row, BARE), timings.spread(row, BARE)))
    return {
        "title": f"run end, tiny: {_common.TINY.description}, whole runs of {STEPS} steps x "
        f"{rounds} rounds",
        "rows": rows,
        "reference": BARE,
        "pairs": [
            (
                "README hooks vs the bare Loop, whole runs",
                timings.ratio(whole, BARE),
                timings.spread(whole, BARE),
                TARGET,
            )
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS[0])
    args = parser.parse_args()
    result = section(quick=False, rounds=args.rounds)
    print(result["title"])
    for label, rate, ratio, spread in result["rows"]:
        print(f"  {label:48} {rate:9.0f} steps/s  {ratio:.3f} ± {spread:.3f}")
    for label, ratio, spread, target in result["pairs"]:
        mark = "PASS" if ratio >= target else "FAIL"
        print(f"  {label:48} {ratio:.3f} ± {spread:.3f}  target >= {target}  {mark}")


if __name__ == "__main__":
    main()
