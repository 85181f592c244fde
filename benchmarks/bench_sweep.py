"""The GPU flag sweep of the device benchmark (issue 33; gpu-notes recommendations 8, 9, 11).

On an H200 loopax's tiny per-step Loop ran at 0.52 of a hand-written step, and a hand-written
step that merely also keeps the loss's moving average at 0.67 of the plain one: too much for
three more kernels. `gpu-notes.md` §2 suspects XLA:GPU's command buffers (CUDA graphs):
updated whenever a buffer address changes (every new, non-donated output; every cycled batch),
traced library calls cached by address (16 entries), small regions left out of graphs. This
section measures the same workloads under XLA flags that switch each suspect off or enlarge
it, so one device run says which it is:

- workloads: the hand-written tiny step (`_common.hand_written`'s), the same keeping the
  loss's moving average, loopax's bare Loop per step (`_common.loopax_loop`), and loopax's
  fused Loop, K=32, on shuffled on-device data against the hand-written scan of 32 over
  pre-stacked batches (`bench_fused`'s candidates);
- variants (`VARIANTS`): the default flags (the per-step workloads also over 8 and 64 cycled
  batches besides 16, the trace cache's size); command buffers off; regions of any size
  graphed; a trace cache of 64; and, fused only, the loop itself graphed (`+WHILE`, unrolled);
- each variant in a fresh process (XLA reads `XLA_FLAGS` once a process), its candidates
  compiled first, then one untimed warm-up round (every program runs at least 3 times after
  the last compilation: a new executable evicts every CUDA graph), then paired rounds whose
  order rotates; the ratios inside a process are paired (medians of per-round ratios), those
  between processes are not;
- diagnostics, where the backend is a GPU: the thunk kinds of every program (`kKernel`,
  `kGemm`, `kCommandBuffer`, `kWhile`, ...: top level, and inside graphs and loops) from an
  XLA dump (`--xla_dump_to`, `*thunk_sequence_after_thunk_passes.txt`, else
  `*thunk_sequence.txt`, as `gpu_compiler.cc`/`gpu_executable.cc` name them), and, in a second
  fresh process per variant run with `TF_CPP_VMODULE=command_buffer_thunk=3,
  command_executor=1,command_buffer_cmd=1`, the command-buffer log lines per step of a short
  counted run: graph launches, updates (re-recordings after an address changed), the
  allocations and commands each update touched and its microseconds, initializations and
  evictions (`command_buffer_thunk.cc`, `command_executor.cc`). On a CPU they print "n/a on cpu".

Every flag is first checked against this jaxlib's XLA in one short CPU process (an unknown
flag in `XLA_FLAGS` aborts a process): a flag it does not know is dropped with a note, and a
variant left with no flag is skipped. The sweep has a fixed share of the device run
(`budget` seconds); each child has a time limit and is killed by its pid when it runs past it
or when the sweep is interrupted; each result is printed to the progress log as it comes, and
what was measured is kept.

Run: python benchmarks/run_all.py --device --only sweep [--size small|full]
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from _xla_logs import (
    LOG_PATTERNS,
    VMODULE,
    command_buffer_counts,
    describe_kinds,
    dumped_thunks,
    marked_counts,
    rejected_flags,
)

CHILD = Path(__file__).resolve().parent / "_sweep_child.py"

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


# -- the parent -----------------------------------------------------------------------------


@dataclasses.dataclass
class Child:
    """A running child: its process, where its stderr goes, when it must be done."""

    variant: Variant
    mode: str
    process: subprocess.Popen
    stderr: Path
    deadline: float
    started: float


class Sweep:
    """Runs the variants' children within the budget; collects rows, JSON and verdicts."""

    def __init__(self, plan: Plan, backend: str, scratch: Path, progress: Callable[[str], None]):
        self.plan = plan
        self.backend = backend
        self.on_cpu = backend == "cpu"
        self.scratch = scratch
        self.progress = progress
        self.started = time.monotonic()
        self.deadline = self.started + plan.budget
        self.running: list[Child] = []
        self.notes: list[str] = []
        self.flags: dict[str, tuple[str, ...]] = {}  # variant -> the flags it runs with
        self.results: dict[str, dict] = {}  # variant -> the timing child's result
        self.diagnostics: dict[str, dict] = {}  # variant -> counts per candidate
        self.status: dict[str, str] = {}  # variant -> why it has no figures

    # ---- processes

    def environment(self, variant: Variant, mode: str) -> dict[str, str]:
        env = dict(os.environ, LOOPAX_COMPILATION_CACHE="off")
        # A program loaded from a cache is neither dumped nor compiled under the flags.
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        flags = [os.environ.get("XLA_FLAGS", ""), *self.flags[variant.name]]
        if mode == "time" and not self.on_cpu:
            flags.append(f"--xla_dump_to={self.dump_directory(variant)}")
        if mode == "diag":
            env.update(TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE=VMODULE)
        env["XLA_FLAGS"] = " ".join(flag for flag in flags if flag)
        return env

    def dump_directory(self, variant: Variant) -> Path:
        return self.scratch / "dump" / re.sub(r"[^A-Za-z0-9]+", "-", variant.name)

    def start(self, variant: Variant, mode: str) -> Child | None:
        if self.deadline - time.monotonic() < MIN_START:
            return None
        spec = dataclasses.asdict(self.plan) | {
            "mode": mode,
            "groups": list(variant.groups),
            "batch_counts": list(variant.batch_counts),
        }
        stem = f"{self.dump_directory(variant).name}-{mode}"
        spec["directory"] = str(self.scratch / stem)
        stderr = self.scratch / f"{stem}.log"
        with stderr.open("w") as sink:
            process = subprocess.Popen(
                [sys.executable, str(CHILD), json.dumps(spec)],
                env=self.environment(variant, mode),
                stdout=subprocess.PIPE,
                stderr=sink,
                text=True,
                start_new_session=True,  # a Ctrl-C reaches the parent, which ends it
            )
        now = time.monotonic()
        child = Child(
            variant, mode, process, stderr, min(now + self.plan.child_timeout, self.deadline), now
        )
        self.running.append(child)
        return child

    def finish(self, child: Child) -> dict | None:
        """Waits for `child` until its deadline (killed by its pid past it); its JSON or None."""
        try:
            stdout, _ = child.process.communicate(
                timeout=max(0.0, child.deadline - time.monotonic())
            )
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.communicate()
            self.running.remove(child)
            why = f"{child.mode} child killed after {time.monotonic() - child.started:.0f} s"
            self.progress(f"  sweep: {child.variant.label(self.flags[child.variant.name])}: {why}")
            return {"error": why}
        self.running.remove(child)
        lines = [line for line in stdout.splitlines() if line.startswith("SWEEP-JSON ")]
        if child.process.returncode == 0 and lines:
            return json.loads(lines[-1][len("SWEEP-JSON ") :])
        log = child.stderr.read_text(errors="replace")
        rejected = rejected_flags(log)
        tail = " | ".join(line for line in log.strip().splitlines()[-2:])[:300]
        why = (
            f"XLA rejects {' '.join(sorted(rejected))}"
            if rejected
            else f"{child.mode} child failed with exit code {child.process.returncode}: {tail}"
        )
        return {"error": why}

    def stop_all(self) -> None:
        for child in list(self.running):
            if child.process.poll() is None:
                child.process.kill()
            child.process.communicate()
            self.running.remove(child)

    # ---- the flags this XLA knows

    def check_flags(self, variants: Sequence[Variant]) -> None:
        """Drops the flags this jaxlib's XLA does not parse.

        One short CPU process parses them all (XLA parses every flag, GPU ones too, on any
        backend); only if it fails, one process a flag finds the culprits (a flag of illegal
        value taints the others of its name in a shared process).
        """
        flags = sorted({flag for variant in variants for flag in variant.flags})
        unknown: set[str] = set()
        together = self.parses(flags) if flags else True
        if together is None:
            self.notes.append("flag check timed out after 60 s: flags used unchecked")
        elif not together:
            for flag in flags:
                alone = self.parses([flag])
                if alone is False:
                    unknown.add(flag)
                elif alone is None:
                    self.notes.append(f"flag check of {flag} timed out: used unchecked")
            if not unknown:
                self.notes.append("flags fail together but each parses alone: used unchecked")
        for variant in variants:
            kept = tuple(flag for flag in variant.flags if flag not in unknown)
            dropped = [flag for flag in variant.flags if flag in unknown]
            if dropped:
                self.notes.append(
                    f"{variant.name}: dropped {' '.join(dropped)} (this XLA does not parse it)"
                )
            self.flags[variant.name] = kept
            if variant.flags and not kept:
                self.status[variant.name] = "skipped: none of its flags exists in this XLA"

    def parses(self, flags: Sequence[str]) -> bool | None:
        """Whether XLA starts with `flags` (a CPU process; None: it hung past 60 s)."""
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags))
        try:
            done = subprocess.run(
                [sys.executable, "-c", "import jax; jax.devices()"],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return None
        if done.returncode != 0 and not rejected_flags(done.stderr):
            self.notes.append(
                f"flag check with {' '.join(flags)}: exit code {done.returncode}, no flag named"
            )
        return done.returncode == 0

    # ---- the run

    def run(self, variants: Sequence[Variant]) -> None:
        runnable = [variant for variant in variants if variant.name not in self.status]
        order = runnable[:1] + (["diag"] if not self.on_cpu else []) + runnable[1:]
        for step in order:
            if step == "diag":
                self.run_diagnostics([variant for variant in runnable if variant.diagnose])
                continue
            assert isinstance(step, Variant)
            child = self.start(step, "time")
            if child is None:
                self.status[step.name] = SPENT
                continue
            result = self.finish(child)
            if result is None or "error" in result:
                self.status[step.name] = (result or {}).get("error", "no result")
                continue
            self.results[step.name] = result
            if not self.on_cpu:
                result["thunks"] = dumped_thunks(self.dump_directory(step))
            self.progress(f"  sweep: {self.describe_result(step, result)}")

    def run_diagnostics(self, variants: Sequence[Variant]) -> None:
        """The diagnostic children side by side (counts, not timings, so they may share)."""
        children = []
        for variant in variants:
            child = self.start(variant, "diag")
            if child is None:
                self.diagnostics[variant.name] = {"error": SPENT}
            else:
                children.append(child)
        for child in children:
            result = self.finish(child)
            name = child.variant.name
            if result is None or "error" in result:
                self.diagnostics[name] = {"error": (result or {}).get("error", "no result")}
                continue
            counts = marked_counts(child.stderr.read_text(errors="replace"))
            self.diagnostics[name] = {
                key: counts.get(key, command_buffer_counts(())) | {"steps": steps}
                for key, steps in result["counted"].items()
            }
            self.progress(f"  sweep: diagnostics {child.variant.label(self.flags[name])} done")

    # ---- figures

    def rate(self, variant: str, key: str) -> float | None:
        result = self.results.get(variant)
        for group in (result or {}).get("groups", {}).values():
            if key in group["seconds"]:
                return group["steps"] / statistics.median(group["seconds"][key])
        return None

    def paired(self, variant: str, key: str, reference: str) -> float | None:
        """Median per-round steps/s of `key` over `reference`, in one child (paired)."""
        result = self.results.get(variant)
        for group in (result or {}).get("groups", {}).values():
            seconds = group["seconds"]
            if key in seconds and reference in seconds:
                pairs = zip(seconds[key], seconds[reference], strict=True)
                return statistics.median(ref / own for own, ref in pairs)
        return None

    def rates(self, variant: str) -> dict[str, float]:
        result = self.results.get(variant) or {}
        return {
            key: rate
            for group in result.get("groups", {}).values()
            for key in group["seconds"]
            if (rate := self.rate(variant, key)) is not None
        }

    def ratios(self, variant: str) -> dict[str, float]:
        """The paired ratios the rows print, named `workload/reference[@batches]`."""
        pairs = [(LOOPAX, PLAIN), (LOOPAX, AVERAGE), (AVERAGE, PLAIN), (FUSED, SCAN)]
        figures = {}
        for batches in (DEFAULT_BATCHES, 8, 64):
            for key, reference in pairs:
                own, other = candidate_key(key, batches), candidate_key(reference, batches)
                if (ratio := self.paired(variant, own, other)) is not None:
                    suffix = "" if batches == DEFAULT_BATCHES else f"@{batches}"
                    figures[f"{SHORT[key]}/{SHORT[reference]}{suffix}"] = ratio
        return figures

    def describe_result(self, variant: Variant, result: dict) -> str:
        parts = []
        for group in result["groups"].values():
            for key, seconds in group["seconds"].items():
                parts.append(f"{key} {group['steps'] / statistics.median(seconds):.0f}/s")
        return (
            f"{variant.label(self.flags[variant.name])}: {', '.join(parts)} "
            f"({result['seconds']:.0f} s, {result['programs']} programs)"
        )

    def step_row(self, variant: Variant, batches: int) -> tuple[str, str] | None:
        name = variant.name
        keys = [candidate_key(workload, batches) for workload in STEP_WORKLOADS]
        rates = [self.rate(name, key) for key in keys]
        if all(rate is None for rate in rates):
            return None
        plain, average, loopax = keys
        texts = []
        for key, rate in zip(keys, rates, strict=True):
            if rate is None:
                continue
            text = f"{SHORT[split_key(key)[0]]} {rate:.0f}/s"
            if key != plain and (ratio := self.paired(name, key, plain)) is not None:
                text += f" ({ratio:.2f}x plain"
                if key == loopax and (versus := self.paired(name, key, average)) is not None:
                    text += f", {versus:.2f}x average"
                text += ")"
            texts.append(text)
        label = f"per step, {batches} batches: {variant.label(self.flags[name])}"
        return label, "; ".join(texts)

    def fused_row(self, variant: Variant) -> tuple[str, str] | None:
        name = variant.name
        scan, fused = self.rate(name, SCAN), self.rate(name, FUSED)
        if scan is None and fused is None:
            return None
        texts = [f"scan {scan:.0f}/s"] if scan is not None else []
        if fused is not None:
            ratio = self.paired(name, FUSED, SCAN)
            texts.append(f"fused {fused:.0f}/s" + (f" ({ratio:.2f}x scan)" if ratio else ""))
        label = f"fused K=32: {variant.label(self.flags[name])}"
        return label, "; ".join(texts)

    def diagnostic_rows(self, variants: Sequence[Variant]) -> list[tuple[str, str]]:
        if self.on_cpu:
            return [
                ("command-buffer updates per step", "n/a on cpu"),
                ("thunk kinds (XLA dump)", "n/a on cpu"),
            ]
        rows = []
        for variant in variants:
            counts = self.diagnostics.get(variant.name)
            label = f"updates per step: {variant.label(self.flags[variant.name])}"
            if counts is None:
                continue
            if "error" in counts:
                rows.append((label, f"n/a ({counts['error']})"))
                continue
            if not any(figures[name] for figures in counts.values() for name in LOG_PATTERNS):
                why = "no graph in these programs, or this XLA logs them otherwise"
                rows.append((label, f"no command-buffer log line in any counted run ({why})"))
                continue
            parts = []
            for key, figures in counts.items():
                steps = figures["steps"]
                if not any(figures[name] for name in LOG_PATTERNS):
                    parts.append(f"{short_key(key)}: no command-buffer log line")
                    continue
                parts.append(
                    f"{short_key(key)}: {figures['updates'] / steps:.2f} updates "
                    f"({figures['updated_allocs'] / steps:.1f} allocations, "
                    f"{figures['commands_updated'] / steps:.1f} commands, "
                    f"{figures['update_micros'] / steps:.1f} µs), "
                    f"{figures['launches'] / steps:.2f} graph launches"
                    + (
                        f", {figures['initializations']} re-recorded"
                        if figures["initializations"]
                        else ""
                    )
                    + (f", {figures['evicted']} evicted" if figures["evicted"] else "")
                )
            rows.append((label, "; ".join(parts) + " (per step; a fused call is 32)"))
        for variant in variants:
            result = self.results.get(variant.name)
            if result is None:
                continue
            thunks = result.get("thunks") or {}
            label = f"thunks: {variant.label(self.flags[variant.name])}"
            if not thunks:
                rows.append((label, "n/a (no thunk sequence in the dump)"))
                continue
            parts = [
                f"{module}: top {describe_kinds(kinds['top'])}"
                + (f"; inside {describe_kinds(kinds['nested'])}" if kinds["nested"] else "")
                for module, kinds in thunks.items()
                if sum(kinds["top"].values()) + sum(kinds["nested"].values()) >= 3
            ]
            rows.append((label, " | ".join(parts) or "only programs of under 3 thunks"))
        return rows

    def verdicts(self, variants: Sequence[Variant]) -> list[tuple[str, str]]:
        """Per workload: the fastest variant (steps/s across processes) and by how much."""
        rows = []
        where = " [cpu: the flags are XLA:GPU's]" if self.on_cpu else ""
        for workload in (*STEP_WORKLOADS, *FUSED_WORKLOADS):
            options: list[tuple[float, str]] = []
            for variant in variants:
                for batches in variant.batch_counts:
                    rate = self.rate(variant.name, candidate_key(workload, batches))
                    if rate is not None:
                        suffix = "" if batches == DEFAULT_BATCHES else f", {batches} batches"
                        options.append((rate, variant.label(self.flags[variant.name]) + suffix))
            if not options:
                continue
            options.sort(reverse=True)
            (best_rate, best), default = options[0], self.rate("default", workload)
            if default is None or best_rate == default:
                text = f"fastest {best}: {best_rate:.0f}/s"
                if len(options) > 1:
                    rate, label = options[1]
                    text += f"; next {label}: {rate:.0f}/s ({rate / best_rate - 1:+.1%})"
            else:
                text = (
                    f"fastest {best}: {best_rate:.0f}/s, {best_rate / default - 1:+.1%} over "
                    f"the default's {default:.0f}/s"
                )
            rows.append((f"verdict {SHORT[workload]}", text + " (separate processes)" + where))
        for label, key, reference in (
            ("gap loopax / plain", LOOPAX, PLAIN),
            ("gap average / plain", AVERAGE, PLAIN),
            ("gap fused / scan", FUSED, SCAN),
        ):
            ratios = [
                (ratio, variant.label(self.flags[variant.name]))
                for variant in variants
                if (ratio := self.paired(variant.name, key, reference)) is not None
            ]
            if ratios:
                best_ratio, best = max(ratios)
                default = self.paired("default", key, reference)
                text = f"closest {best}: {best_ratio:.2f}x"
                if default is not None:
                    text += f" against {default:.2f}x by default"
                rows.append((f"verdict {label}", text + " (paired in one process)" + where))
        return rows

    def section(self, variants: Sequence[Variant], skipped: Sequence[Variant]) -> dict:
        rows: list[tuple] = []
        for variant in variants:
            if variant.name in self.status:
                rows.append(
                    (variant.label(self.flags.get(variant.name)), self.status[variant.name])
                )
                continue
            for batches in variant.batch_counts:
                if "step" in variant.groups and (row := self.step_row(variant, batches)):
                    rows.append(row)
        for variant in variants:
            if "fused" in variant.groups and (row := self.fused_row(variant)):
                rows.append(row)
        for variant in variants:
            result = self.results.get(variant.name) or {}
            built = [
                name
                for group in result.get("groups", {}).values()
                for name in group["built_during_timing"]
            ]
            if built:
                rows.append(
                    (f"programs built while timing: {variant.name}", ", ".join(sorted(set(built))))
                )
            for why in result.get("unavailable", ()):
                rows.append((f"{variant.name}", f"n/a ({why})"))
        rows += self.diagnostic_rows([v for v in variants if v.name not in self.status])
        rows += self.verdicts(variants)
        for variant in skipped:
            flags = self.flags.get(variant.name)
            why = "XLA:GPU flags, they parse here" if flags == variant.flags else "see the notes"
            rows.append((variant.label(flags), f"not run on cpu ({why})"))
        rows += [("note", note) for note in self.notes]
        seconds = time.monotonic() - self.started
        cpu = "CPU FIGURES (the flags are XLA:GPU's: a smoke run); " if self.on_cpu else ""
        plan = self.plan
        return {
            "title": f"device sweep (gpu-notes 8, 9, 11) on {self.backend}: {cpu}each variant "
            f"a fresh process; per step {plan.step_steps} steps, fused {plan.fused_steps}, "
            f"x {plan.rounds} rounds after {plan.warmup_rounds} warm-up; steps/s medians, "
            f"ratios paired within a process; {seconds:.0f} s of a {plan.budget:.0f} s share",
            "rows": rows,
            "header": False,
            "sweep": {
                "backend": self.backend,
                "seconds": seconds,
                "plan": dataclasses.asdict(plan),
                "variants": [
                    {
                        "name": variant.name,
                        "flags": list(self.flags.get(variant.name, variant.flags)),
                        "asked_flags": list(variant.flags),
                        "status": self.status.get(variant.name, "measured"),
                        "steps_per_second": self.rates(variant.name),
                        "paired_ratios": self.ratios(variant.name),
                        "result": self.results.get(variant.name),
                        "diagnostics": self.diagnostics.get(variant.name),
                    }
                    for variant in variants
                ],
                "notes": self.notes,
            },
        }


def section(size: str, backend: str, progress: Callable[[str], None]) -> dict:
    """The sweep as one device section (`run_all.py --device --only sweep`).

    Interrupted (SIGINT: the device run's time limit), it ends its children and returns what
    was measured, with `interrupted` set.
    """
    plan = PLANS[size]
    scratch = Path(tempfile.mkdtemp(prefix="loopax-sweep-"))
    variants = list(VARIANTS)
    skipped: list[Variant] = []
    if backend == "cpu":
        skipped = [variant for variant in variants if variant.name not in CPU_VARIANTS]
        variants = [variant for variant in variants if variant.name in CPU_VARIANTS]
    sweep = Sweep(plan, backend, scratch, progress)
    interrupted = False
    try:
        try:
            sweep.check_flags(VARIANTS)  # also those of the variants not run on a CPU
            sweep.run(variants)
        except KeyboardInterrupt:
            interrupted = True
            sweep.notes.append("interrupted: the children running were ended")
        finally:
            sweep.stop_all()
        result = sweep.section(variants, skipped)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # dumps and logs: their counts are kept
    if interrupted:
        result["interrupted"] = True
    return result


if __name__ == "__main__":
    import run_all

    sys.argv[1:1] = ["--device", "--only", "sweep"]
    run_all.main()
