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
import threading
import time

import jax
import pytest
from observability_helpers import make_data, make_trainer, model_fn

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
        loop.host_metrics()  # the step has finished when the bar, which never waits, reads it
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
    # A bar, though a StringIO is no terminal: its refreshes are what this test counts.
    hooks.progress_bar(loop, refresh_seconds=1.0, clock=lambda: now[0], file=out, lines=False)

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
    with pytest.raises(ValueError, match="line_seconds must be a number of seconds >= 0, got -1"):
        hooks.progress_bar(loop, line_seconds=-1)
    with pytest.raises(TypeError, match="lines must be None .* True or False, got 'yes'"):
        hooks.progress_bar(loop, lines="yes")


NARROW_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {helpers!r})
    from observability_helpers import make_data, new_trainer
    import loopax
    from loopax import hooks

    now = [0.0]
    loop = loopax.Loop(new_trainer())
    hooks.progress_bar(loop, refresh_seconds=0, clock=lambda: now[0], show_metrics={metrics})

    def advance_fake_clock(loop, metrics):
        now[0] += 0.5
        loop.host_metrics()  # the step has finished when the bar, which never waits, reads it

    loop.on_step("fake clock", advance_fake_clock)
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


def test_rates_read_as_people_read_them():
    format_rate = hooks.ProgressBar.format_rate
    assert format_rate(0.0) == "0 steps/s"
    assert format_rate(None) == "? steps/s" and format_rate(None, short=True) == "?/s"
    # Under a step a second: seconds per step, as tqdm's s/it; past a minute as a duration.
    assert format_rate(0.45) == "2.22 s/step" and format_rate(0.45, short=True) == "2.22s/step"
    assert format_rate(1 / 90) == "01:30/step"
    assert format_rate(1.0) == "1 steps/s" and format_rate(3.14159) == "3.14 steps/s"
    assert format_rate(280.0, short=True) == "280/s" and format_rate(999.4) == "999 steps/s"
    # Rounded before the prefix is chosen: never 1e+03, never 1000.
    assert format_rate(999.5) == "1k steps/s" and format_rate(1e3, short=True) == "1k/s"
    assert format_rate(2840.0, short=True) == "2.84k/s" and format_rate(123456.0) == "123k steps/s"
    assert format_rate(1e6) == "1M steps/s" and format_rate(2.5e12, short=True) == "2.5T/s"


LINES_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {helpers!r})
    from observability_helpers import make_data, new_trainer
    import loopax
    from loopax import hooks

    now = [0.0]
    loop = loopax.Loop(new_trainer())
    progress = hooks.progress_bar(loop, refresh_seconds=0, clock=lambda: now[0])
    loop.on_step("fake clock", lambda loop, metrics: now.__setitem__(0, now[0] + 0.5))
    loop.run_steps(make_data(loop_forever=True), 20)
    print("EXPECTED", progress.status(loop, 20, loop.host_metrics()).split("] ")[1], flush=True)
""")


def test_a_log_that_is_no_terminal_gets_lines_and_the_final_state():
    # As a CI log or `python train.py 2> log` gets it: stderr is a pipe, not a terminal.
    result = subprocess.run(
        [sys.executable, "-c", LINES_SCRIPT.format(helpers=HELPERS)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    expected = result.stdout.split("EXPECTED ")[1].strip()
    assert re.fullmatch(r"batch=\S+ ~loss=\S+ ~acc=\d+\.\d\d%", expected), expected
    # No carriage-return redraws, whose first frame (0% step 0 of 20) is all a log would show.
    assert "\r" not in result.stderr and "step 0 of 20" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("step ")]
    # 10 s of fake time: no line is due before the end (every 30 s); the last one always is.
    assert lines == [f"step 20 of 20 [2 steps/s, elapsed 00:10] {expected}"], result.stderr


def test_lines_come_every_line_seconds_and_the_last_one_at_the_end():
    now = [0.0]
    loop = loopax.Loop(make_trainer())
    out = io.StringIO()
    progress = hooks.progress_bar(
        loop, refresh_seconds=0, clock=lambda: now[0], file=out, line_seconds=2
    )
    shown = {}

    def advance_fake_clock(loop, metrics):
        now[0] += 0.5 if loop.loop_step < 10 else 4.0  # then slow steps: 4 s each
        step = loop.loop_step + 1
        # Read here, the step has finished when the bar, which never waits, looks at it.
        shown[step] = progress.status(loop, step, loop.host_metrics()).split("] ")[1]

    loop.on_step("fake clock", advance_fake_clock)
    loop.run_steps(make_data(loop_forever=True), 12)
    assert progress.lines  # a StringIO is no terminal: lines, without being asked
    # 0.5 s steps (2 steps/s), a line every 2 s; two 4 s steps: 12 steps in 13 s. A line
    # due at the run's last step is left to the final line, which has no ETA.
    assert out.getvalue().splitlines() == [
        f"step 4 of 12 [2 steps/s, ETA 00:04, elapsed 00:02] {shown[4]}",
        f"step 8 of 12 [2 steps/s, ETA 00:02, elapsed 00:04] {shown[8]}",
        f"step 11 of 12 [1.22 steps/s, ETA 00:00, elapsed 00:09] {shown[11]}",
        f"step 12 of 12 [1.08 s/step, elapsed 00:13] {shown[12]}",
    ]
    assert progress.shown_step == 12 and progress.shown_metrics == loop.host_metrics()


@pytest.mark.cpu_devices
def test_with_fused_steps_the_bar_shows_the_newest_finished_step_and_never_waits(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # the whole status, whatever runs the tests
    # Each step waits on the device for this gate, which the test closes while a group of
    # 32 steps is in flight, and opens only after the bar's refresh: a bar that waited for
    # that group would wait for the gate (20 s, then the test fails).
    gate = threading.Event()
    gate.set()
    timed_out = []

    def wait_at_gate(_):
        if not gate.wait(timeout=20):
            timed_out.append(True)
            gate.set()

    def gated_model(ctx, spec, inputs):
        jax.debug.callback(wait_at_gate, inputs[0][0, 0])
        return model_fn(ctx, spec, inputs)

    trainer = loopax.Trainer(
        gated_model,
        loopax.losses.sparse_categorical_crossentropy_logits,
        loopax.optimizers.sgd(0.1),
        train_metrics=[loopax.metrics.MovingAverageSparseCategoricalAccuracy()],
        # Several devices: on one, the CPU runs a program on the thread that dispatches it.
        devices=jax.devices()[:4],
    )
    loop = loopax.Loop(trainer, steps_per_execution=32)
    now = [0.0]
    progress = hooks.progress_bar(
        loop, refresh_seconds=0, clock=lambda: now[0], file=io.StringIO(), lines=False
    )
    groups = {}
    seen = {}

    def before_the_bar(loop, metrics):
        now[0] += 1.0
        if loop.loop_step == 31:
            groups[1] = loop.host_metrics()  # waits: the first group has finished
            gate.clear()  # the second group will wait on the device

    def after_the_bar(loop, metrics):
        seen[loop.loop_step] = progress.shown_step, progress.shown_metrics, progress.bar.status
        if loop.loop_step == 63:
            gate.set()
            groups[2] = loop.host_metrics()  # waits for the second group, now let through

    # Without finite checks, which wait for the steps in flight.
    loop.on_step("before", before_the_bar, priority=loopax.Priority.UI - 1, check_finite=False)
    loop.on_step("after", after_the_bar, priority=loopax.Priority.UI + 1, check_finite=False)
    loop.run_steps(make_data(loop_forever=True), 96)
    assert not timed_out, "the bar waited for the group in flight"
    first_text = seen[31][2].split("] ")[1]
    assert seen[31][:2] == (32, groups[1]) and seen[31][2].startswith("step 32 of 96 [")
    # The second group was still at the gate: the bar counted its steps, showed the first's.
    assert seen[63][:2] == (32, groups[1]) and groups[2] != groups[1]
    assert seen[63][2].startswith("step 64 of 96 [") and seen[63][2].endswith("] " + first_text)
    # At the end the loop waited for every step: the bar shows the last one's.
    assert progress.shown_step == 96 and progress.shown_metrics == loop.host_metrics()


def terminal_screen(output):
    """The lines a terminal shows after `output`: carriage returns overwrite, as on screen.

    Only what tqdm and Python write to a terminal is understood (carriage return, newline,
    cursor up, erase to the end of the line); anything else fails the test. A line longer
    than the terminal stays one line (a terminal would wrap it).
    """
    screen, row, column = [[]], 0, 0
    position = 0
    while position < len(output):
        char = output[position]
        position += 1
        if char == "\x1b":
            match = re.match(r"\[(\d*)([A-Za-z])", output[position:])
            assert match and match.group(2) in "AK", repr(output[position - 1 : position + 9])
            position += match.end()
            if match.group(2) == "A":
                row = max(0, row - int(match.group(1) or 1))
            else:
                del screen[row][column:]
        elif char == "\r":
            column = 0
        elif char == "\n":
            row += 1
            if row == len(screen):
                screen.append([])
        else:
            line = screen[row]
            line.extend(" " * (column + 1 - len(line)))
            line[column] = char
            column += 1
    return ["".join(line).rstrip() for line in screen]


PRINTING_SCRIPT = textwrap.dedent("""
    import logging, sys, warnings
    sys.path.insert(0, {helpers!r})
    from observability_helpers import make_data, new_trainer
    import loopax
    from loopax import hooks

    # Configured before the bar: this handler holds the real sys.stderr.
    logging.basicConfig(level=logging.INFO, format="log: %(message)s")
    now = [0.0]
    loop = loopax.Loop(new_trainer())
    hooks.progress_bar(loop, refresh_seconds=0, clock=lambda: now[0])
    hooks.evaluate(loop, [make_data("val", 2)], every_n_steps=4)
    # Never improves by 1e9: stops at its second check, and says so (print and log).
    hooks.early_stopping(loop, "eval/val/mean_loss", patience=1, min_delta=1e9)

    def user_hook(loop, metrics):
        now[0] += 0.5
        loop.host_metrics()  # the step has finished when the bar, which never waits, reads it
        step = loop.loop_step
        if step == 2:
            print("a user's print at step", step)
        elif step == 3:
            print("a user's line on stderr", file=sys.stderr)
        elif step == 4:
            warnings.warn("a user's warning")
        elif step == 5:
            print("a line in", end="", flush=True)
            print(" two writes")

    loop.on_step("user", user_hook)
    loop.run_steps(make_data(loop_forever=True), 20)
    print("DONE", flush=True)
""")


def test_a_line_printed_while_the_bar_is_shown_gets_its_own_line_above_the_bar():
    columns = 120
    returncode, output = run_in_terminal(PRINTING_SCRIPT.format(helpers=HELPERS), columns=columns)
    assert returncode == 0, output[-3000:]
    screen = [line for line in terminal_screen(output) if line]
    printed = [
        "a user's print at step 2",
        "a user's line on stderr",
        "a line in two writes",
        "early stopping: eval/val/mean_loss did not improve on",  # loopax's print
        "log: early stopping: eval/val/mean_loss did not improve on",  # and its log line
    ]
    for text in printed:
        lines = [line for line in screen if line.startswith(text)]
        assert len(lines) == 1, f"{text!r} is not alone on a line:\n" + "\n".join(screen)
    warning = [line for line in screen if "UserWarning: a user's warning" in line]
    assert len(warning) == 1 and warning[0].endswith("UserWarning: a user's warning"), screen
    # Every bar drawn above a printed line was cleared from it and drawn again below: the
    # only bar left on screen is the final one, after every printed line.
    bars = [index for index, line in enumerate(screen) if re.search(r"step \d+ of 20", line)]
    assert len(bars) == 1, "\n".join(screen)
    assert re.match(r"^\s*\d+%\|.*\| step 8 of 20 ", screen[bars[0]]), screen[bars[0]]
    assert screen[bars[0] + 1 :] == ["DONE"], screen


def test_the_streams_come_back_when_the_bar_closes_also_when_the_run_raises(monkeypatch):
    import logging

    stdout, stderr, bar_output = io.StringIO(), io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", stdout)
    monkeypatch.setattr(sys, "stderr", stderr)
    handler = logging.StreamHandler(stderr)
    logger = logging.getLogger("loopax.test_progress")
    logger.addHandler(handler)
    loop = loopax.Loop(make_trainer())
    progress = hooks.progress_bar(loop, refresh_seconds=0, file=bar_output, lines=False)
    fail_at = [None]
    seen_while_open = []

    def print_then_fail(loop, metrics):
        seen_while_open.append((sys.stdout is stdout, handler.stream is stderr))
        print(f"<{loop.loop_step}>", end="")  # a partial line: it waits for the bar to close
        if loop.loop_step == fail_at[0]:
            raise RuntimeError("the hook failed")

    loop.on_step("printing", print_then_fail)
    try:
        loop.run_steps(make_data(loop_forever=True), 2)
        assert sys.stdout is stdout and sys.stderr is stderr and handler.stream is stderr
        fail_at[0] = 3
        with pytest.raises(loopax.HookError, match="the hook failed"):
            loop.run_steps(make_data(loop_forever=True), 5)
        # The bar closed, and every stream is the one it replaced, the handler's too.
        assert progress.bar is None
        assert sys.stdout is stdout and sys.stderr is stderr and handler.stream is stderr
    finally:
        logger.removeHandler(handler)
    # While the bar was open, the streams went through it.
    assert seen_while_open == [(False, False)] * 4  # loop steps 0, 1, then 2, 3
    # The partial lines came when each bar closed, none of them on a bar's line.
    assert stdout.getvalue() == "<0><1><2><3>"
    assert "<" not in bar_output.getvalue() and stderr.getvalue() == ""
