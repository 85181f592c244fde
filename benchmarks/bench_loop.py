"""Loop overhead: loopax's Loop with no-op hooks against a hand-written `jax.jit` loop.

Workload: a tiny MLP (64 -> 128 -> 10, batch 64, adam), small enough that per-step
Python overhead shows. Both sides train from the same device-resident batches with
donated state and no per-step host sync. Rounds are interleaved (A, B, A, B, ...) and
the reported figure is the median of the per-round ratios, which cancels slow drifts
of a shared machine. `run_all.py` runs this comparison as part of the whole suite.

Run: python benchmarks/bench_loop.py [--steps 2000] [--rounds 7] [--hooks 5]
"""

from __future__ import annotations

import argparse

from _common import TINY, hand_written, interleave, loopax_loop, make_batches, noop_hooks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--hooks", type=int, default=5)
    args = parser.parse_args()
    batches = make_batches(TINY)
    timings = interleave(
        {
            "hand-written": hand_written(TINY, batches, args.steps),
            "loopax": loopax_loop(TINY, batches, args.steps, attach=noop_hooks(args.hooks)),
        },
        args.steps,
        args.rounds,
    )
    print(f"workload: {TINY.description}, {args.steps} steps x {args.rounds} rounds")
    print(f"hand-written jax.jit loop : {timings.rate('hand-written'):9.0f} steps/s")
    print(f"loopax Loop + {args.hooks} hooks    : {timings.rate('loopax'):9.0f} steps/s")
    print(
        "ratio (loopax / hand-written, median of paired rounds): "
        f"{timings.ratio('loopax', 'hand-written'):.3f} "
        f"(± {timings.spread('loopax', 'hand-written'):.3f})"
    )


if __name__ == "__main__":
    main()
