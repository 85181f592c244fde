"""The moving average of the parameters (`Trainer(ema_decay=...)`, issue 23) costs per step.

On the tiny and the medium workload: loopax's bare Loop with `ema_decay=0.999` against the
same Loop without it, side by side from the same device-resident batches. The average is
updated inside the compiled step (a multiply-add per parameter, one more state leaf per
parameter); the target is within 3%: the Loop with it >= 0.97x the Loop without it. The
same pair written by hand (a jitted step with donated state, with and without the average)
shows what the average itself costs on the machine, whoever keeps it.

Rounds are interleaved, the order rotating; a ratio is the median of the per-round paired
ratios, "±" half their interquartile range. `run_all.py --only ema` runs the same comparison
as a section of the suite.

Run: python benchmarks/bench_ema.py [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from _common import WORKLOADS, hand_written, interleave, loopax_loop, make_batches

DECAY = 0.999
TARGET = 0.97
STEPS = {"tiny": (8192, 512), "medium": (512, 64)}  # per round: full run, --quick
ROUNDS = (9, 3)
WARMUP_ROUNDS = (1, 0)
WITHOUT = "loopax Loop, bare"
WITH = f"loopax Loop, bare, ema_decay={DECAY}"
HAND = "hand-written jit"
HAND_WITH = f"hand-written jit, EMA {DECAY}"


def ema_comparison(
    name: str, quick: int, rounds: int, on_round: Callable[[int], None] | None = None
) -> dict[str, Any]:
    """The Loop with and without `ema_decay` on workload `name`; a run_all.py section."""
    workload = WORKLOADS[name]
    steps = STEPS[name][quick]
    batches = make_batches(workload)
    candidates = {
        WITHOUT: loopax_loop(workload, batches, steps),
        WITH: loopax_loop(workload, batches, steps, ema_decay=DECAY),
        HAND: hand_written(workload, batches, steps),
        HAND_WITH: hand_written(workload, batches, steps, ema_decay=DECAY),
    }
    timings = interleave(candidates, steps, rounds, WARMUP_ROUNDS[quick], on_round=on_round)
    rows = [(WITHOUT, timings.rate(WITHOUT), 1.0, 0.0)]
    rows.append((WITH, timings.rate(WITH), timings.ratio(WITH, WITHOUT),
                 timings.spread(WITH, WITHOUT)))  # fmt: skip
    # What the same average costs a careful user: their step with it against without it.
    rows.append((HAND, timings.rate(HAND), timings.ratio(HAND, WITHOUT),
                 timings.spread(HAND, WITHOUT)))  # fmt: skip
    rows.append((f"{HAND_WITH} (vs hand-written)", timings.rate(HAND_WITH),
                 timings.ratio(HAND_WITH, HAND), timings.spread(HAND_WITH, HAND)))  # fmt: skip
    return {
        "title": f"ema {name}: {workload.description}, {steps} steps x {rounds} rounds",
        "rows": rows,
        "reference": WITHOUT,
        "targets": {WITH: TARGET},
    }


def sections(
    args: argparse.Namespace, on_round: Callable[[str], Callable[[int], None]] | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """Both workloads' comparisons, as `run_all.py` prints them."""
    return [
        (
            f"ema-{name}",
            ema_comparison(
                name, args.quick, args.rounds, None if on_round is None else on_round(name)
            ),
        )
        for name in ("tiny", "medium")
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    args.quick = int(args.quick)
    args.rounds = args.rounds or ROUNDS[args.quick]
    for _, section in sections(args):
        print(section["title"])
        for label, rate, ratio, spread in section["rows"]:
            ratio_text = "1 (reference)" if label == WITHOUT else f"{ratio:.3f} ± {spread:.3f}"
            goal = ""
            if label in section["targets"]:
                target = section["targets"][label]
                goal = f"  target >= {target}  " + ("PASS" if ratio >= target else "FAIL")
            print(f"  {label:50} {rate:9.0f} steps/s  {ratio_text:>13}{goal}")


if __name__ == "__main__":
    main()
