"""Warm restarts: how long a resumed process waits for its first step, against a cold one.

Issue 25's target: a resumed process reaches its first step in <= 0.4x the time of a cold
one, with nothing configured by the user. Both run `examples/digits.py` as a user would, in a
fresh process, and read the line it prints at its first step ("first step X s after start
(Y s of it compiling)"), X measured from the script's first line:
- cold: an empty compilation cache (a fresh `$XDG_CACHE_HOME`) and no checkpoint: the first
  process on a machine, compiling every program;
- resumed: the same cache directory after a run to step 300 filled it, resuming that run's
  checkpoint to step 600: the restart of a job, which loads its programs from JAX's
  persistent compilation cache (on by default, `loopax/_compilation_cache.py`) and restores
  its state.
Rounds alternate cold and resumed; the ratio is the median of each round's resumed/cold.

Run: python benchmarks/bench_restart.py [--quick] [--rounds N]; `run_all.py` runs it as its
"restart" section.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

DIGITS = Path(__file__).resolve().parent.parent / "examples" / "digits.py"
ROUNDS = (5, 2)  # full run / --quick
TARGET = 0.4
FIRST_STEP = re.compile(r"first step ([0-9.]+) s after start \(([0-9.]+) s of it compiling\)")


def first_step(directory: Path, cache: Path, steps: int) -> tuple[float, float]:
    """Runs digits to `steps` in `directory`; (seconds to its first step, compiling in them)."""
    env = dict(os.environ, XDG_CACHE_HOME=str(cache), JAX_PLATFORMS="cpu")
    for variable in ("LOOPAX_COMPILATION_CACHE", "JAX_COMPILATION_CACHE_DIR", "XLA_FLAGS"):
        env.pop(variable, None)  # as a user runs it: loopax's default cache, one device
    command = [sys.executable, str(DIGITS), "--steps", str(steps), "--dir", str(directory),
               "--no-progress"]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    found = FIRST_STEP.search(done.stdout)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"digits failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return float(found.group(1)), float(found.group(2))


def measure(rounds: int) -> dict[str, list[tuple[float, float]]]:
    """`rounds` cold and resumed first steps, alternating; each in fresh directories."""
    figures: dict[str, list[tuple[float, float]]] = {"cold": [], "resumed": []}
    for _ in range(rounds):
        with tempfile.TemporaryDirectory(prefix="loopax-restart-") as tmp:
            root = Path(tmp)
            figures["cold"].append(first_step(root / "cold", root / "cold-cache", 300))
            first_step(root / "job", root / "cache", 300)  # the first run of the job
            figures["resumed"].append(first_step(root / "job", root / "cache", 600))
    return figures


def rows(figures: dict[str, list[tuple[float, float]]]) -> list[tuple[str, str]]:
    """The table's rows: medians of each kind, then the ratio against the target."""
    table = []
    for kind, label in (("cold", "cold process (empty cache, no checkpoint)"),
                        ("resumed", "resumed process (cache filled, checkpoint)")):  # fmt: skip
        seconds = statistics.median(s for s, _ in figures[kind])
        compiling = statistics.median(c for _, c in figures[kind])
        table.append((label, f"{seconds:.2f} s to the first step, {compiling:.2f} s compiling"))
    ratios = [r / c for (r, _), (c, _) in zip(figures["resumed"], figures["cold"], strict=True)]
    ratio = statistics.median(ratios)
    spread = (max(ratios) - min(ratios)) / 2
    verdict = "PASS" if ratio <= TARGET else "FAIL"
    table.append(("resumed / cold", f"{ratio:.2f} ± {spread:.2f}  <= {TARGET}  {verdict}"))
    return table


def sections(args: argparse.Namespace) -> list[tuple[str, dict]]:
    """`run_all.py`'s "restart" section."""
    title = "Warm restart: examples/digits.py, seconds from the process's start to its 1st step"
    figures = measure(ROUNDS[args.quick])  # its own rounds: each takes ~20 s
    return [("restart", {"title": title, "rows": rows(figures), "header": False})]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    print(f"load {os.getloadavg()[0]:.2f}")
    for label, text in rows(measure(args.rounds or ROUNDS[int(args.quick)])):
        print(f"  {label:45} {text}")


if __name__ == "__main__":
    main()
