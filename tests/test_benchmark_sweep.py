"""The device benchmark's flag sweep reads what XLA leaves behind (benchmarks/bench_sweep.py).

Its diagnostics only have data on a GPU, which CI lacks, so their readers are checked here on
lines and files in XLA's own formats (`benchmarks/_xla_logs.py` cites where each comes from),
and the flag check on a real XLA: a flag this jaxlib does not know, or a value it rejects,
aborts a process, and the sweep must drop it with a note instead of losing its variant.
"""

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.append(str(BENCHMARKS))

import _sweep_plan  # noqa: E402
import _sweep_report  # noqa: E402
import _xla_logs  # noqa: E402
import bench_sweep  # noqa: E402

PREFIX = "I1129 05:13:30.450287    1458 {file}] "
LOG = "\n".join(
    [
        PREFIX.format(file="command_buffer_thunk.cc:120")
        + "Initialize command buffer on device #0 by recoding command buffer cmd sequence; "
        "num_commands=5",
        f"{_xla_logs.MARK} begin hand-written step",
        *[
            PREFIX.format(file="command_buffer_thunk.cc:200")
            + "Update command buffer on device #0 by recoding command buffer cmd sequence after "
            "1 executions since last update; num_commands=5; updated_allocs=2",
            PREFIX.format(file="command_executor.cc:600")
            + "Updated 5 commands in 12 μs (skipped 3 command updates)",
            PREFIX.format(file="command_buffer_thunk.cc:230")
            + "Updated command buffer in 20 μs; num_commands=5",
            PREFIX.format(file="command_buffer_thunk.cc:240")
            + "Execute command buffer on device #0; num_executions=1",
        ]
        * 2,
        f"{_xla_logs.MARK} end hand-written step",
        PREFIX.format(file="command_buffer_thunk.cc:240")
        + "Execute command buffer on device #0; num_executions=7",
        f"{_xla_logs.MARK} begin loopax Loop, bare@8",
        PREFIX.format(file="command_buffer_thunk.cc:300")
        + "Evicted 3 command buffer thunk command buffers",
        f"{_xla_logs.MARK} end loopax Loop, bare@8",
    ]
)


def test_command_buffer_lines_are_counted_per_marked_run():
    counts = _xla_logs.marked_counts(LOG)
    assert set(counts) == {"hand-written step", "loopax Loop, bare@8"}
    step = counts["hand-written step"]
    # Two steps' worth: lines before the begin marker and after the end marker do not count.
    assert (step["launches"], step["updates"], step["initializations"]) == (2, 2, 0)
    assert (step["updated_allocs"], step["update_micros"]) == (4, 40)
    assert (step["commands_updated"], step["commands_skipped"]) == (4, 6)
    assert step["sample"][0].startswith("Update command buffer on device #0")
    loop = counts["loopax Loop, bare@8"]
    assert (loop["evicted"], loop["launches"], loop["updates"]) == (3, 0, 0)


def test_thunk_kinds_come_from_the_sequence_after_the_passes(tmp_path):
    before = "kKernel  fusion.1\nkGemm    dot.2\nkKernel  fusion.3\n"
    after = "kCommandBuffer \n  kKernel   fusion.1\n  kGemm     dot.2\nkKernel  fusion.3\n"
    (tmp_path / "module_0003.jit_step.thunk_sequence.txt").write_text(before)
    (tmp_path / "module_0003.jit_step.thunk_sequence_after_thunk_passes.txt").write_text(after)
    # Some XLA versions number the lines; a loop's body is nested like a graph's commands.
    loop = "000: kWhile   while.4\n  000: kKernel fusion.5\n  001: kKernel fusion.6\n"
    (tmp_path / "module_0004.jit_program.thunk_sequence.txt").write_text(loop)
    (tmp_path / "module_0004.jit_program.ir-with-opt.ll").write_text("kKernel, not a dump")
    modules = _xla_logs.dumped_thunks(tmp_path)
    assert modules["jit_step"]["top"] == {"kCommandBuffer": 1, "kKernel": 1}
    assert modules["jit_step"]["nested"] == {"kKernel": 1, "kGemm": 1}
    assert modules["jit_step"]["after_passes"] is True
    assert modules["jit_program"]["top"] == {"kWhile": 1}
    assert modules["jit_program"]["nested"] == {"kKernel": 2}
    assert modules["jit_program"]["text"] == loop


def xla_stderr(flags: str) -> subprocess.CompletedProcess:
    env = {"XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-c", "import jax; jax.devices()"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    ("flag", "named"),
    [
        ("--xla_gpu_no_such_flag=1", "--xla_gpu_no_such_flag=1"),
        ("--xla_gpu_enable_command_buffer=+NO_SUCH_TYPE", "--xla_gpu_enable_command_buffer"),
    ],
)
def test_a_flag_xla_rejects_is_named(flag, named):
    done = xla_stderr(flag)
    assert done.returncode != 0
    assert named in _xla_logs.rejected_flags(done.stderr)


def test_the_sweep_drops_the_flags_this_xla_lacks_and_keeps_the_rest(tmp_path):
    known = "--xla_gpu_graph_min_graph_size=1"
    variants = [
        _sweep_plan.Variant("known", (known,)),
        _sweep_plan.Variant("mixed", (known, "--xla_gpu_no_such_flag=1")),
        _sweep_plan.Variant("unknown", ("--xla_gpu_enable_command_buffer=+NO_SUCH_TYPE",)),
    ]
    sweep = bench_sweep.Sweep(_sweep_plan.PLANS["small"], "cpu", tmp_path, lambda message: None)
    sweep.check_flags(variants)
    assert sweep.flags == {"known": (known,), "mixed": (known,), "unknown": ()}
    assert set(sweep.status) == {"unknown"}  # skipped: none of its flags is left
    assert any("--xla_gpu_no_such_flag=1" in note for note in sweep.notes)


def test_the_sweeps_own_flags_parse_in_this_xla(tmp_path):
    sweep = bench_sweep.Sweep(_sweep_plan.PLANS["small"], "cpu", tmp_path, lambda message: None)
    sweep.check_flags(_sweep_plan.VARIANTS)
    assert sweep.flags == {variant.name: variant.flags for variant in _sweep_plan.VARIANTS}
    assert not sweep.status


def test_the_report_names_the_fastest_variant_and_the_closest_gap():
    plan, step = _sweep_plan, _sweep_plan.PLAIN
    average, loopax = _sweep_plan.AVERAGE, _sweep_plan.LOOPAX

    def timed(plain: float, with_average: float, loop: float) -> dict:
        seconds = {step: [plain] * 3, average: [with_average] * 3, loopax: [loop] * 3}
        group = {"steps": 100, "seconds": seconds, "built_during_timing": []}
        return {"groups": {"step": group}, "unavailable": [], "thunks": {}}

    counts = _xla_logs.marked_counts(LOG)["hand-written step"]  # two steps' worth
    report = _sweep_report.SweepReport(
        plan=plan.PLANS["full"],
        backend="gpu",
        flags={"default": (), "graphs off": ("--xla_gpu_enable_command_buffer=",)},
        results={"default": timed(1.0, 1.5, 2.0), "graphs off": timed(0.9, 1.0, 1.0)},
        diagnostics={"default": {step: counts | {"steps": 2}}},
        status={},
        notes=[],
        seconds=1.0,
    )
    variants = [plan.VARIANTS[0], plan.VARIANTS[1]]
    rows = dict(report.section(variants, [])["rows"])
    graphs_off = "graphs off [--xla_gpu_enable_command_buffer=]"
    assert rows["verdict plain"].startswith(f"fastest {graphs_off}: 111/s, +11.1% over")
    assert rows["verdict gap loopax / plain"].startswith(
        f"closest {graphs_off}: 0.90x against 0.50x by default"
    )
    assert rows["updates per step: default [no flags]"].startswith(
        "plain: 1.00 updates (2.0 allocations, 2.0 commands, 20.0 µs), 1.00 graph launches "
        "(per step"
    )
    assert rows["thunks: default [no flags]"] == "n/a (no thunk sequence in the dump)"
