"""What XLA:GPU leaves behind, read back: command-buffer log lines, thunk dumps, flag errors.

For the device benchmark's flag sweep (`bench_sweep.py`). The formats are XLA's own
(openxla/xla, 2025-26): `command_buffer_thunk.cc` logs at VLOG(3) "Execute command buffer on
device #0; num_executions=N" for each graph launch, "Update command buffer on device #0 by
recoding command buffer cmd sequence after N executions since last update; num_commands=C;
updated_allocs=A" and "Updated command buffer in X μs" for each re-recording after an address
changed, "Initialize command buffer ..." for a recording from scratch and "Evicted N command
buffer thunk command buffers" when a new executable evicts them; the command executor
(`command_executor.cc`, formerly `command_buffer_cmd.cc`) logs at VLOG(1) "Updated N commands
in X μs (skipped K command updates)". With `--xla_dump_to`, `gpu_compiler.cc` writes each
module's `module_NNNN.<name>.thunk_sequence.txt` and `gpu_executable.cc`, when its thunk passes
formed command buffers, `...thunk_sequence_after_thunk_passes.txt`: one line a thunk, its kind
first (`kKernel`, `kGemm`, `kCommandBuffer`, `kWhile`, ...; some versions number the lines
`000: `), nested thunks (a graph's, a loop's body) indented. An unknown flag in `XLA_FLAGS`
aborts the process with "Unknown flag in XLA_FLAGS: --name=value", a bad value with "Illegal
value for --name".
"""

from __future__ import annotations

import collections
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

# The command-buffer log of a diagnostic child (gpu-notes §2; XLA's own module names: the
# executor's VLOG(1) lines moved from command_buffer_cmd.cc to command_executor.cc in 2026).
VMODULE = "command_buffer_thunk=3,command_executor=1,command_buffer_cmd=1"
MARK = "LOOPAX-SWEEP-MARK"
UNKNOWN_FLAG = re.compile(r"Unknown flags? in XLA_FLAGS: (.*)")
ILLEGAL_VALUE = re.compile(r"Illegal value for (--\w+)")


LOG_PATTERNS = {
    "launches": re.compile(r"Execute command buffer on device"),
    "updates": re.compile(r"Update command buffer on device"),
    "initializations": re.compile(r"Initialize command buffer on device"),
    "warmups": re.compile(r"Executing warm up iteration of command buffer"),
}
UPDATED_ALLOCS = re.compile(r"Update command buffer on device.*updated_allocs=(\d+)")
UPDATE_MICROS = re.compile(r"Updated command buffer in (\d+)")
UPDATED_COMMANDS = re.compile(r"Updated (\d+) commands in (\d+) .*?\(skipped (\d+)")
EVICTED = re.compile(r"Evicted (\d+) command buffer")


def command_buffer_counts(lines: Iterable[str]) -> dict[str, int]:
    """Counts of XLA:GPU's command-buffer log lines (gpu-notes §2), summed over `lines`."""
    counts = dict.fromkeys(
        (
            *LOG_PATTERNS,
            "updated_allocs",
            "update_micros",
            "commands_updated",
            "commands_skipped",
            "evicted",
            "lines",
        ),
        0,
    )
    for line in lines:
        counts["lines"] += 1
        for name, pattern in LOG_PATTERNS.items():
            if pattern.search(line):
                counts[name] += 1
        if found := UPDATED_ALLOCS.search(line):
            counts["updated_allocs"] += int(found.group(1))
        if found := UPDATE_MICROS.search(line):
            counts["update_micros"] += int(found.group(1))
        if found := UPDATED_COMMANDS.search(line):
            commands, skipped = int(found.group(1)), int(found.group(3))
            counts["commands_updated"] += commands - skipped
            counts["commands_skipped"] += skipped
        if found := EVICTED.search(line):
            counts["evicted"] += int(found.group(1))
    return counts


def marked_counts(log: str) -> dict[str, dict[str, Any]]:
    """Per candidate, the command-buffer counts between its begin and end markers."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in log.splitlines():
        if line.startswith(MARK):
            _, what, key = line.split(" ", 2)
            current = sections.setdefault(key, []) if what == "begin" else None
        elif current is not None:
            current.append(line)
    return {
        key: command_buffer_counts(lines) | {"sample": command_buffer_sample(lines)}
        for key, lines in sections.items()
    }


SAMPLED = (*LOG_PATTERNS.values(), UPDATE_MICROS, UPDATED_COMMANDS, EVICTED)


def command_buffer_sample(lines: Sequence[str], limit: int = 8) -> list[str]:
    """The first command-buffer log lines of a counted run, without the log's prefix."""
    sample = []
    for line in lines:
        if any(pattern.search(line) for pattern in SAMPLED):
            sample.append(line.split("] ", 1)[-1][:200])
            if len(sample) == limit:
                break
    return sample


THUNK_LINE = re.compile(r"^(\s*)(?:\d+:\s*)?(k[A-Z][A-Za-z0-9]*)\b")
MODULE_FILE = re.compile(r"^module_(\d+)\.(.+?)\.thunk_sequence(_after_thunk_passes)?\.txt$")


def thunk_kinds(text: str) -> tuple[collections.Counter, collections.Counter]:
    """Thunk kinds in a thunk-sequence dump: at top level, and nested (graphs, loop bodies)."""
    top: collections.Counter = collections.Counter()
    nested: collections.Counter = collections.Counter()
    for line in text.splitlines():
        found = THUNK_LINE.match(line)
        if found is None:
            continue
        (nested if found.group(1) else top)[found.group(2)] += 1
    return top, nested


def dumped_thunks(directory: Path, keep: int = 20_000) -> dict[str, dict[str, Any]]:
    """`{module: {"top": kinds, "nested": kinds, "text": ...}}` from the dump, per module.

    The sequence after XLA's thunk passes (where the graphs are formed) where it was
    written, else the one before; `text`, its first `keep` characters, for programs of 3
    thunks or more (the next session reads them without a run).
    """
    chosen: dict[tuple[str, str], tuple[bool, Path]] = {}
    for path in sorted(directory.glob("*thunk_sequence*.txt")) if directory.is_dir() else ():
        found = MODULE_FILE.match(path.name)
        if found is None:
            continue
        key = (found.group(1), found.group(2))
        after = found.group(3) is not None
        if key not in chosen or after:
            chosen[key] = (after, path)
    modules: dict[str, dict[str, Any]] = {}
    for (number, name), (after, path) in sorted(chosen.items()):
        text = path.read_text(errors="replace")
        top, nested = thunk_kinds(text)
        label = name if name not in modules else f"{name}#{number}"
        modules[label] = {"top": dict(top), "nested": dict(nested), "after_passes": after}
        if sum(top.values()) + sum(nested.values()) >= 3:
            modules[label]["text"] = text[:keep]
    return modules


def describe_kinds(kinds: dict[str, int]) -> str:
    return ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items())) or "none"


def rejected_flags(log: str) -> set[str]:
    """The flags XLA's parser named as unknown (with their values) or of illegal value."""
    named: set[str] = set()
    for found in UNKNOWN_FLAG.finditer(log):
        named |= set(found.group(1).split())
    named |= {found.group(1) for found in ILLEGAL_VALUE.finditer(log)}
    return named
