"""The flag sweep's plan: its workloads, variants (XLA flags a process) and sizes.

Shared by the sweep's parent (`bench_sweep.py`), its child processes (`_sweep_child.py`) and
its report (`_sweep_report.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

# Workloads (candidate names inside a child; the per-step ones also carry "@<batches>").
PLAIN = "hand-written step"
AVERAGE = "hand-written step + loss average"
LOOPAX = "loopax Loop, bare"
SCAN = "hand-written scan of 32"
FUSED = "loopax fused K=32"
STEP_WORKLOADS = (PLAIN, AVERAGE, LOOPAX)
SHORT = {PLAIN: "plain", AVERAGE: "average", LOOPAX: "loopax", SCAN: "scan", FUSED: "fused"}
FUSED_WORKLOADS = (SCAN, FUSED)
DEFAULT_BATCHES = 16  # XLA:GPU's command-buffer trace cache holds 16 entries by default


@dataclasses.dataclass(frozen=True)
class Variant:
    """One fresh process: XLA flags, the workload groups it runs, the cycled batch counts."""

    name: str
    flags: tuple[str, ...]
    groups: tuple[str, ...] = ("step", "fused")
    batch_counts: tuple[int, ...] = (DEFAULT_BATCHES,)
    diagnose: bool = True  # a second process counting command-buffer updates (GPU only)

    def label(self, flags: Sequence[str] | None = None) -> str:
        shown = self.flags if flags is None else flags
        return f"{self.name} [{' '.join(shown) or 'no flags'}]"


VARIANTS = (
    Variant("default", (), batch_counts=(DEFAULT_BATCHES, 8, 64)),
    Variant("graphs off", ("--xla_gpu_enable_command_buffer=",), diagnose=False),
    Variant("trace cache 64", ("--xla_cmd_buffer_trace_cache_size=64",)),
    Variant(
        "graphed loop",
        ("--xla_gpu_enable_command_buffer=+WHILE", "--xla_gpu_command_buffer_unroll_loops=true"),
        groups=("fused",),
    ),
    Variant("min graph size 1", ("--xla_gpu_graph_min_graph_size=1",)),
)
# The order is the order they run in (the default first, then its diagnostics with the other
# variants'), by how much each answers: a child that would start past the share is skipped.
# On a CPU the flags change nothing (they are XLA:GPU's): the smoke run times the default
# process (all workloads and batch counts) and checks that every other variant's flags parse.
CPU_VARIANTS = ("default",)
MIN_START = 5  # seconds: a child is not started with less of the sweep's share left
SPENT = "not run: the sweep's share of the run was spent"


@dataclasses.dataclass(frozen=True)
class Plan:
    """How much each child runs, and the sweep's share of the device run."""

    step_steps: int  # per round, each per-step candidate
    fused_steps: int  # per round, each fused candidate (a multiple of 32)
    rounds: int
    warmup_rounds: int
    diag_step_steps: int  # the counted run of a diagnostic child
    diag_fused_steps: int
    budget: float  # seconds, the whole sweep
    child_timeout: float  # seconds, each child


PLANS = {
    "full": Plan(512, 1024, 5, 1, 64, 256, budget=90, child_timeout=45),
    "small": Plan(128, 256, 3, 1, 32, 64, budget=60, child_timeout=45),
}


def candidate_key(workload: str, batches: int) -> str:
    return workload if batches == DEFAULT_BATCHES else f"{workload}@{batches}"


def split_key(key: str) -> tuple[str, int]:
    workload, _, batches = key.partition("@")
    return workload, int(batches) if batches else DEFAULT_BATCHES


def short_key(key: str) -> str:
    workload, _, batches = key.partition("@")
    return SHORT.get(workload, workload) + (f" ({batches} batches)" if batches else "")
