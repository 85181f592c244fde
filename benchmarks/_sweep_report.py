"""The flag sweep's report: its rows, verdicts and JSON, from what its children measured."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence

from _sweep_plan import (
    AVERAGE,
    DEFAULT_BATCHES,
    FUSED,
    FUSED_WORKLOADS,
    LOOPAX,
    PLAIN,
    SCAN,
    SHORT,
    STEP_WORKLOADS,
    Plan,
    Variant,
    candidate_key,
    short_key,
    split_key,
)
from _xla_logs import LOG_PATTERNS, describe_kinds


def describe_result(label: str, result: dict) -> str:
    """A timing child's rates on one line (the progress log, as each child ends)."""
    parts = []
    for group in result["groups"].values():
        for key, seconds in group["seconds"].items():
            parts.append(f"{key} {group['steps'] / statistics.median(seconds):.0f}/s")
    return f"{label}: {', '.join(parts)} ({result['seconds']:.0f} s, {result['programs']} programs)"


@dataclasses.dataclass
class SweepReport:
    """What the sweep measured, as the device section's rows, verdicts and JSON."""

    plan: Plan
    backend: str
    flags: dict[str, tuple[str, ...]]  # variant -> the flags it ran with
    results: dict[str, dict]  # variant -> its timing child's result
    diagnostics: dict[str, dict]  # variant -> command-buffer counts per candidate
    status: dict[str, str]  # variant -> why it has no figures
    notes: list[str]
    seconds: float

    @property
    def on_cpu(self) -> bool:
        return self.backend == "cpu"

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
        seconds = self.seconds
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
