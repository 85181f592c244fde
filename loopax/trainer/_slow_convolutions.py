"""Convolutions a fused program leaves to XLA:CPU's generic loops, found in its optimized HLO.

XLA:CPU's `ConvCanonicalization` rewrites every convolution of a program's entry
computation into the order of dimensions its library kernels take (`b01f_01io->b01f` for
2-D: batch first and features last, the kernel's spatial dimensions before its input and
output features); it never visits a loop's body. The gradient convolutions JAX derives
from a model's own come in other orders (`f01b_i01o->01bf`), so in a fused program's
`lax.scan` they stay `convolution` ops in that order and run as XLA's generic loops, about
an order of magnitude slower per step. XLA:GPU rewrites convolutions in every computation.
"""

from __future__ import annotations

import re

# `%name = f32[...] convolution(%a, %b), window={...}, dim_labels=b01f_01io->b01f, ...`
_CONVOLUTION = re.compile(r" convolution\(.*?dim_labels=(\w+)_(\w+)->(\w+)")

GUIDE = "docs/guides/fused.md#convolutional-models-on-a-cpu"


def _canonical(lhs: str, rhs: str, out: str) -> bool:
    """Whether dimension labels are the canonical order XLA:CPU's convolution kernels take."""
    spatial = "".join(str(i) for i in range(len(lhs) - 2))
    return lhs == f"b{spatial}f" and rhs == f"{spatial}io" and out == f"b{spatial}f"


def slow_convolutions(text: str) -> list[str]:
    """The dimension labels of `text`'s convolutions left outside XLA:CPU's canonical order.

    Only convolutions outside the entry computation count (in a loop's body or another
    called computation): the entry's are always rewritten into the canonical order.

    Args:
      text: a compiled program's optimized HLO module, as `compiled.as_text()` gives it.

    Returns:
      Each such convolution's `dim_labels`, in the order they appear (empty when none).
    """
    found = []
    entry = False
    for line in text.splitlines():
        if line.startswith("ENTRY "):
            entry = True
        elif line.startswith("%"):  # another computation's header
            entry = False
        elif not entry and " convolution(" in line:
            match = _CONVOLUTION.search(line)
            if match is not None and not _canonical(*match.groups()):
                found.append("{}_{}->{}".format(*match.groups()))
    return found


def slow_convolutions_message(steps: int, accumulating: bool, labels: list[str]) -> str:
    """The warning for a train program whose convolutions `labels` run in a loop, slowly.

    Args:
      steps: the optimizer steps the program runs (more than one: a fused group).
      accumulating: whether each step loops over micro-batches (`accumulate_steps > 1`).
      labels: the slow convolutions' dimension labels (`slow_convolutions`).
    """
    loops, fixes = [], []
    if steps > 1:
        loops.append(
            f"a fused training program (Loop steps_per_execution > 1; this group: {steps} steps)"
        )
        fixes.append("Loop(trainer, steps_per_execution=1)")
    if accumulating:
        loops.append("a train step that accumulates micro-batches (Trainer accumulate_steps > 1)")
        fixes.append("accumulate_steps=1 with a larger batch")
    shown = ", ".join(sorted(set(labels)))
    looping = " and ".join(loops)
    verb = "run" if len(loops) > 1 else "runs"
    return (
        f"{looping[0].upper()}{looping[1:]} {verb} convolutions inside a loop on XLA:CPU's "
        f"slow generic path (dimension labels {shown}): XLA:CPU rewrites convolutions into "
        "its fast library form only outside loops, so each step runs about an order of "
        "magnitude slower than a single step without the loop. On a CPU, train "
        f"convolutional models with {' and '.join(fixes)} (GPUs and TPUs are not affected); "
        f"see {GUIDE}."
    )
