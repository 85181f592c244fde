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

Its parts: `_sweep_plan.py` (the workloads, variants and sizes), `_sweep_child.py` (the fresh
process), `_xla_logs.py` (XLA's log lines, dumps and flag errors, read back), `_sweep_report.py`
(rows, verdicts, JSON); this module runs the children and makes the section.

Run: python benchmarks/run_all.py --device --only sweep [--size small|full]
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from _sweep_plan import (
    CPU_VARIANTS,
    MIN_START,
    PLANS,
    SPENT,
    VARIANTS,
    Plan,
    Variant,
)
from _sweep_report import SweepReport, describe_result
from _xla_logs import VMODULE, command_buffer_counts, dumped_thunks, marked_counts, rejected_flags

CHILD = Path(__file__).resolve().parent / "_sweep_child.py"

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
            label = step.label(self.flags[step.name])
            self.progress(f"  sweep: {describe_result(label, result)}")

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

    def report(self) -> SweepReport:
        return SweepReport(
            self.plan,
            self.backend,
            self.flags,
            self.results,
            self.diagnostics,
            self.status,
            self.notes,
            time.monotonic() - self.started,
        )


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
        result = sweep.report().section(variants, skipped)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # dumps and logs: their counts are kept
    if interrupted:
        result["interrupted"] = True
    return result


if __name__ == "__main__":
    import run_all

    sys.argv[1:1] = ["--device", "--only", "sweep"]
    run_all.main()
