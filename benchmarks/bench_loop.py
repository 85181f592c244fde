"""Loop overhead: loopax's Loop with no-op hooks against a hand-written `jax.jit` loop.

Workload: a tiny MLP (64 -> 128 -> 10, batch 64, adam), small enough that per-step
Python overhead shows. Both sides train from the same device-resident batches with
donated state and no per-step host sync. Rounds are interleaved (A, B, A, B, ...) and
the reported figure is the median of the per-round ratios, which cancels slow drifts
of a shared machine. `run_all.py` runs this comparison as part of the whole suite.

A third row attaches the README's hooks (progress bar, TensorBoard, checkpoints every 60 s),
timed up to the end of the steps (the end-of-run checkpoint save is a once-per-run cost).

Run: python benchmarks/bench_loop.py [--steps 2000] [--rounds 7] [--hooks 5]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from _common import (
    TINY,
    hand_written,
    interleave,
    loopax_loop,
    make_batches,
    noop_hooks,
    readme_hooks,
    split_end_of_run,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--hooks", type=int, default=5)
    args = parser.parse_args()
    batches = make_batches(TINY)
    attach_readme_hooks, why = readme_hooks(Path(tempfile.mkdtemp(prefix="loopax-bench-")))
    if attach_readme_hooks is None:
        raise SystemExit(why)
    captured = {}

    def attach_and_keep(loop):
        attach_readme_hooks(loop)
        captured["loop"] = loop

    readme_run = loopax_loop(TINY, batches, args.steps, attach=attach_and_keep)
    timings = interleave(
        {
            "hand-written": hand_written(TINY, batches, args.steps),
            "loopax": loopax_loop(TINY, batches, args.steps, attach=noop_hooks(args.hooks)),
            # Timed up to the end of the steps: the end-of-run checkpoint is once per run.
            "readme": split_end_of_run(readme_run, captured["loop"]),
        },
        args.steps,
        args.rounds,
    )
    print(f"workload: {TINY.description}, {args.steps} steps x {args.rounds} rounds")
    print(f"hand-written jax.jit loop : {timings.rate('hand-written'):9.0f} steps/s")
    print(f"loopax Loop + {args.hooks} hooks    : {timings.rate('loopax'):9.0f} steps/s")
    print(f"loopax Loop + README hooks: {timings.rate('readme'):9.0f} steps/s")
    for row, label in (("loopax", f"{args.hooks} hooks"), ("readme", "README hooks")):
        print(
            f"ratio ({label} / hand-written, median of paired rounds): "
            f"{timings.ratio(row, 'hand-written'):.3f} "
            f"(± {timings.spread(row, 'hand-written'):.3f})"
        )


if __name__ == "__main__":
    main()
