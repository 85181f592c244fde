"""`progress_bar`: its output in a real terminal (a pseudo-terminal subprocess), fake clock."""

import fcntl
import io
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import textwrap
import time

import pytest
from observability_helpers import make_data, make_trainer

import loopax
from loopax import hooks

HELPERS = os.path.dirname(os.path.abspath(__file__))

# Each step takes 0.5 s of fake time; loop step 4 also takes 100 s and reports a compilation,
# which the rate and ETA must leave out: 2 steps/s, ETA (steps left) / 2 seconds.
SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {helpers!r})
    from observability_helpers import make_data, new_trainer
    import loopax
    from loopax import hooks

    now = [0.0]
    trainer = new_trainer()
    loop = loopax.Loop(trainer)
    progress = hooks.progress_bar(loop, refresh_seconds=0, clock=lambda: now[0])

    def advance_fake_clock(loop, metrics):
        now[0] += 0.5
        if loop.loop_step == 4:
            now[0] += 100.0
            progress.on_exec_creation(None)  # as the trainer reports a compilation

    loop.on_step("fake clock", advance_fake_clock)
    loop.run_steps(make_data(loop_forever=True), 20)
    loop.run_steps(make_data(loop_forever=True), 4)   # a second run of the same loop
    loop.run_epochs(make_data(batches=3), 2)          # the total is unknown in epoch 1
    print("DONE", flush=True)
""")


def run_in_terminal(script, timeout=120, columns=200):
    """Runs `script` with stdout and stderr on a pseudo-terminal; returns what it wrote."""
    controller, terminal = pty.openpty()
    # A 40-row terminal: a new pseudo-terminal reports 0 columns, and tqdm fits bars to it.
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.DEVNULL,
        stdout=terminal,
        stderr=terminal,
        close_fds=True,
    )
    os.close(terminal)
    output = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([controller], [], [], deadline - time.monotonic())
            if not ready:
                break
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # the terminal closed: the process exited
                break
            if not chunk:
                break
            output += chunk
    finally:
        os.close(controller)
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
    return process.returncode, output.decode("utf-8", "replace")


def terminal_lines(script, columns=200):
    returncode, output = run_in_terminal(script, columns=columns)
    assert returncode == 0, output[-3000:]
    assert "DONE" in output
    # tqdm redraws its line with carriage returns (and ANSI codes in a terminal).
    lines = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", output).replace("\r", "\n").split("\n")
    return [line.rstrip() for line in lines if "step " in line or re.match(r"\d+/\S+ ", line)]


@pytest.fixture(scope="module")
def terminal_output():
    return [line.strip() for line in terminal_lines(SCRIPT.format(helpers=HELPERS))]


def line_for(lines, text):
    matching = [line for line in lines if text in line]
    assert matching, f"no line contains {text!r}:\n" + "\n".join(lines)
    return matching[-1]


def test_shows_step_k_of_n_rate_eta_and_metrics(terminal_output):
    first = line_for(terminal_output, "step 1 of 20 ")
    assert re.search(
        r"^\s*5%\|.*\| step 1 of 20 \[\? steps/s, ETA \?\] batch=\S+ ~loss=\S+ "
        r"~acc=\d+\.\d\d%$",
        first,
    ), first
    # Compile-free steps take 0.5 s: 2 steps/s; the 100 s step with a compile is left out.
    assert "step 10 of 20 [2 steps/s, ETA 00:05]" in line_for(terminal_output, "step 10 of 20 ")
    last = line_for(terminal_output, "step 20 of 20 ")
    assert last.startswith("100%|") and "[2 steps/s, ETA 00:00]" in last


def test_a_second_run_gets_a_new_bar(terminal_output):
    # The second run starts at global step 20 and ends at 24, with its own rate.
    assert line_for(terminal_output, "step 21 of 24 ").startswith("88%|")
    assert "[2 steps/s, ETA 00:00]" in line_for(terminal_output, "step 24 of 24 ")


def test_run_epochs_total_unknown_then_corrected(terminal_output):
    # 3 batches per epoch: the end is unknown in the first epoch, then 24 + 6 = 30.
    assert re.match(r"^step 25 of \? \[.*ETA \?\]", line_for(terminal_output, "step 25 of ?"))
    assert line_for(terminal_output, "step 28 of 30 ").startswith("93%|")
    assert line_for(terminal_output, "step 30 of 30 ").startswith("100%|")


def test_refreshes_at_most_every_refresh_seconds():
    now = [0.0]
    loop = loopax.Loop(make_trainer())
    out = io.StringIO()
    hooks.progress_bar(loop, refresh_seconds=1.0, clock=lambda: now[0], file=out)

    def advance_fake_clock(loop, metrics):
        now[0] += 0.25

    loop.on_step("fake clock", advance_fake_clock)
    loop.run_steps(make_data(loop_forever=True), 10)
    displayed = [int(step) for step in re.findall(r"step (\d+) of 10", out.getvalue())]
    # At the start, step 1 (the first refresh), then every 4 steps of 0.25 s, then the end.
    assert displayed == [0, 1, 5, 9, 10]
    assert "step 10 of 10 [4 steps/s, ETA 00:00]" in out.getvalue()


def test_rejects_bad_arguments():
    loop = loopax.Loop(make_trainer())
    with pytest.raises(ValueError, match="refresh_seconds"):
        hooks.progress_bar(loop, refresh_seconds=-1)
    with pytest.raises(TypeError, match="clock"):
        hooks.progress_bar(loop, clock=3)


NARROW_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {helpers!r})
    from observability_helpers import make_data, new_trainer
    import loopax
    from loopax import hooks

    now = [0.0]
    loop = loopax.Loop(new_trainer())
    hooks.progress_bar(loop, refresh_seconds=0, clock=lambda: now[0], show_metrics={metrics})
    loop.on_step("fake clock", lambda loop, metrics: now.__setitem__(0, now[0] + 0.5))
    loop.run_steps(make_data(loop_forever=True), 20)
    print("DONE", flush=True)
""")


def test_at_80_columns_the_bar_goes_before_any_metric_value_is_cut():
    lines = terminal_lines(NARROW_SCRIPT.format(helpers=HELPERS, metrics=True), columns=80)
    status = [line for line in lines if re.search(r"step \d+ of 20 .*batch=", line)]
    assert len(status) >= 20
    for line in status:
        assert len(line) <= 80, line
        # Every metric is there with its whole value, and no bar took their room.
        assert re.search(r"batch=\S+ ~loss=\S+ ~acc=\d+\.\d\d%$", line), line
        assert "|" not in line
    # Narrower: the rate and ETA shorten, then whole metrics go, never part of a value.
    for columns in (60, 28):
        lines = terminal_lines(NARROW_SCRIPT.format(helpers=HELPERS, metrics=True), columns)
        status = [line for line in lines if re.match(r"\d+/20 ", line)]
        assert len(status) >= 20, lines
        for line in status:
            assert len(line) <= columns, line
            assert re.search(r" ~acc=\d+\.\d\d%$", line), line
        # At 60 columns all three metrics fit; at 28 some lines had to drop one.
        assert all(" ~loss=" in line for line in status) == (columns == 60)
    # With the metrics hidden there is room again, and the bar comes back.
    lines = terminal_lines(NARROW_SCRIPT.format(helpers=HELPERS, metrics=False), columns=80)
    last = [line for line in lines if "step 20 of 20" in line][-1]
    assert last.startswith("100%|") and len(last) <= 80, last
