"""`progress_bar`: a tqdm bar with step k of N, steps/s, an ETA free of compile time, metrics."""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from ..loop import Loop, Priority
from ..trainer import Trainer
from ._bar_output import BarOutput
from ._metric_info import is_writer_process, train_metric_infos
from ._progress_status import FinishedMetrics, Throughput, format_interval, format_rate
from ._schedules import ClockSchedule

_KNOWN_TOTAL_FORMAT = "{percentage:3.0f}%|{bar}| {status}"
_NO_BAR_FORMAT = "{percentage:3.0f}% {status}"
_UNKNOWN_TOTAL_FORMAT = "{status}"
_MIN_BAR = 10  # columns: a narrower bar says nothing, so the metrics get its room


def _bar_class(notebook: bool | None) -> type:
    if notebook is None:
        from tqdm.auto import tqdm as base
    elif notebook:
        from tqdm.notebook import tqdm as base
    else:
        from tqdm import tqdm as base

    class _Bar(base):  # type: ignore[misc, valid-type]
        """tqdm showing our own status text: its own rate and ETA would include compilation."""

        status = ""

        @property
        def format_dict(self) -> dict[str, Any]:
            return {**super().format_dict, "status": self.status}

    return _Bar


def _uses_widgets(bar_class: type) -> bool:
    """Whether tqdm picked its notebook widget (never without ipywidgets)."""
    return any(cls.__module__ == "tqdm.notebook" for cls in bar_class.__mro__)


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed file
        return False


class ProgressBar:
    """The progress bar hooks; created by `progress_bar`.

    `ProgressBar.format_rate(steps_per_second, short=False)` is how it writes a rate.

    Attributes:
      throughput: the `Throughput` (steps/s and ETA without compile time) of the current run.
      bar: the tqdm bar of the current run, or None (between runs, and when writing lines).
      lines: whether the current run writes plain lines instead of a bar.
      shown_step: the global step of the metrics shown, or None while no step of the run
        has finished on the device.
      shown_metrics: those metrics as Python floats, by name.
    """

    throughput: Throughput
    format_rate = staticmethod(format_rate)

    def __init__(
        self,
        trainer: Trainer,
        clock: Callable[[], float],
        file: TextIO | None,
        notebook: bool | None,
        leave: bool,
        show_metrics: bool,
        summary: bool = False,
        lines: bool | None = None,
        line_seconds: float = 30.0,
    ):
        self.clock = clock
        self.show_metrics = show_metrics
        self._summary_due = summary  # printed once, when the parameters first exist
        self.throughput = Throughput()
        self.bar: Any = None
        self.lines = False
        self.shown_step: int | None = None
        self.shown_metrics: dict[str, float] = {}
        self._bar_class = _bar_class(notebook)
        self._file = file
        self._want_lines = lines
        self._line_seconds = line_seconds
        # What every bar of this hook is built with, besides its run's total and format.
        self._bar_options = {
            "file": file,
            "leave": leave,
            "dynamic_ncols": True,
            "miniters": 1,
            "mininterval": 0,
        }
        self._infos = train_metric_infos(trainer)
        self._output = BarOutput()
        self._finished = FinishedMetrics()
        self._running = False
        self._stream: Any = None
        self._started = 0.0
        self._next_line = 0.0
        self._refreshed_step = 0
        self._end_step = -1

    def on_exec_creation(self, info: Any) -> None:
        """Called by the trainer when it compiled an executable: that step is not timed."""
        del info
        self.throughput.compiled()

    def on_start(self, loop: Loop, dataset: Any) -> None:
        del dataset
        self._close_bar()
        self._print_summary(loop)  # a resumed or initialized state exists already
        self._end_step = loop.end_step
        self.throughput = Throughput()
        self._started = self.clock()
        self.throughput.start(self._started)
        self._finished = FinishedMetrics()
        self.shown_step, self.shown_metrics = None, {}
        self._refreshed_step = loop.start_step
        self._running = True
        self._stream = sys.stderr if self._file is None else self._file  # tqdm's default
        self.lines = self._writes_lines()
        if self.lines:
            self._next_line = self._started + self._line_seconds
            return
        known = loop.end_step >= 0
        # Shown by tqdm's first display, inside its constructor.
        self._bar_class.status = self.status(loop, loop.start_step, None)
        self.bar = self._bar_class(
            total=loop.end_step if known else None,
            initial=loop.start_step,
            bar_format=_KNOWN_TOTAL_FORMAT if known else _UNKNOWN_TOTAL_FORMAT,
            **self._bar_options,
        )
        if not _uses_widgets(self._bar_class):  # a widget is no line that prints continue
            self._output.open(self.bar)

    def _writes_lines(self) -> bool:
        """Lines, unless asked otherwise, where carriage-return redraws would not show.

        A log file, a CI log or a notebook rendered from its saved output keeps every
        redraw of a tqdm line, or only its first: neither shows where the run is.
        """
        if self._want_lines is not None:
            return self._want_lines
        return not _uses_widgets(self._bar_class) and not _is_terminal(self._stream)

    def status(self, loop: Loop, steps_done: int, host_metrics: dict[str, Any] | None) -> str:
        """The text after the bar: `step k of N [r steps/s, ETA t] metrics`."""
        return self._statuses(loop, steps_done, host_metrics)[0]

    def _eta_text(self, loop: Loop, steps_done: int) -> str:
        if loop.end_step < 0:
            return "?"
        eta = self.throughput.eta_seconds(loop.end_step - steps_done)
        return "?" if eta is None else format_interval(eta)

    def _metric_texts(self, host_metrics: dict[str, Any] | None) -> list[str]:
        return [
            f"{info.short_name}={info.pretty_print(host_metrics[info.key])}"
            for info in self._infos
            if host_metrics and info.key in host_metrics
        ]

    def _statuses(
        self, loop: Loop, steps_done: int, host_metrics: dict[str, Any] | None
    ) -> list[str]:
        """The status text, longest first, then shorter forms that cut no value.

        The full `step k of N [r steps/s, ETA t] metrics`, then `k/N r/s t metrics`, then
        `k/N metrics`, then `k/N` with the first metrics dropped one by one.
        """
        total = "?" if loop.end_step < 0 else str(loop.end_step)
        rate = self.throughput.steps_per_second()
        eta_text = self._eta_text(loop, steps_done)
        metrics = self._metric_texts(host_metrics)
        shown = "".join(" " + m for m in metrics)
        short = f"{steps_done}/{total}"
        texts = [
            f"step {steps_done} of {total} [{format_rate(rate)}, ETA {eta_text}]{shown}",
            f"{short} {format_rate(rate, short=True)} {eta_text}{shown}",
        ]
        texts += [short + "".join(" " + m for m in metrics[i:]) for i in range(len(metrics) + 1)]
        return texts

    def _width(self) -> int:
        columns = getattr(self.bar, "ncols", None)
        if not columns:
            columns = shutil.get_terminal_size((80, 24)).columns
        return int(columns)

    def _fit(self, known_total: bool, statuses: list[str]) -> tuple[str, str]:
        """The bar format and status for the width; no value is ever cut.

        The bar goes first, then the rate and ETA shorten, then whole metrics drop.
        """
        width = self._width()
        full = statuses[0]
        if known_total:
            if len("100%|| ") + _MIN_BAR + len(full) <= width:
                return _KNOWN_TOTAL_FORMAT, full
            if len("100% ") + len(full) <= width:
                return _NO_BAR_FORMAT, full
        for status in statuses:
            if len(status) <= width:
                return _UNKNOWN_TOTAL_FORMAT, status
        return _UNKNOWN_TOTAL_FORMAT, statuses[-1]

    def _print_summary(self, loop: Loop) -> None:
        if self._summary_due and loop.trainer.state is not None:
            self._summary_due = False
            self._bar_class.write(loop.trainer.summary(), file=self._bar_options["file"])

    def _take_metrics(self, steps_done: int, metrics: Any) -> None:
        """Offers the step's metrics and moves to the newest finished ones, never waiting."""
        finished = self._finished
        finished.forget_after(steps_done)  # a rollback went back before them
        finished.offer(steps_done, metrics)
        finished.advance()

    def _show_finished(self) -> None:
        """Shows the newest finished metrics: read from the device once per step shown."""
        finished = self._finished
        if self.show_metrics and finished.step != self.shown_step:
            self.shown_step = finished.step
            self.shown_metrics = dict(finished.values())

    def _refresh(self, loop: Loop, steps_done: int, display: bool = True) -> None:
        self._print_summary(loop)
        bar = self.bar
        if loop.end_step != self._end_step:
            # run_epochs learned the length of the run at the end of the first epoch.
            self._end_step = loop.end_step
            bar.total = loop.end_step if loop.end_step >= 0 else None
        bar.n = steps_done
        self._show_finished()
        statuses = self._statuses(loop, steps_done, self.shown_metrics)
        bar.bar_format, bar.status = self._fit(loop.end_step >= 0, statuses)
        if display:
            bar.refresh()

    def _write_line(self, loop: Loop, steps_done: int, now: float, final: bool) -> None:
        """One plain line: `step k of N [r steps/s, ETA t, elapsed e] metrics`."""
        self._print_summary(loop)
        self._show_finished()
        total = "?" if loop.end_step < 0 else str(loop.end_step)
        facts = [format_rate(self.throughput.steps_per_second())]
        if not final:
            facts.append(f"ETA {self._eta_text(loop, steps_done)}")
        facts.append(f"elapsed {format_interval(now - self._started)}")
        shown = "".join(" " + m for m in self._metric_texts(self.shown_metrics))
        print(f"step {steps_done} of {total} [{', '.join(facts)}]{shown}", file=self._stream)
        self._stream.flush()

    def __call__(self, loop: Loop, metrics: Any) -> None:
        """The OnStep hook: refreshes the bar, or writes a line when one is due.

        It runs on the steps its `ClockSchedule` picks (every `refresh_seconds`).
        """
        if not self._running:
            return
        now = self.clock()
        steps_done = loop.loop_step + 1
        self.throughput.step_done(now, steps_done - self._refreshed_step)
        self._refreshed_step = steps_done
        if self.show_metrics:
            self._take_metrics(steps_done, metrics)
        if not self.lines:
            self._refresh(loop, steps_done)
            return
        self._print_summary(loop)
        # At the run's last step the final line comes at once.
        if now >= self._next_line and steps_done != loop.end_step:
            self._next_line = now + self._line_seconds
            self._write_line(loop, steps_done, now, final=False)

    def on_end(self, loop: Loop, metrics: Any) -> None:
        if not self._running:
            return
        self._running = False
        now = self.clock()
        steps_done = loop.trainer.global_step
        if steps_done != self._refreshed_step:
            self.throughput.step_done(now, steps_done - self._refreshed_step)
            self._refreshed_step = steps_done
        if self.show_metrics:  # the loop waited for every step: the last one has finished
            self._finished.settle(steps_done, metrics)
        if self.lines:
            self._write_line(loop, steps_done, now, final=True)
            return
        # close() displays the final state once more: no refresh of our own.
        self._refresh(loop, steps_done, display=False)
        self._close_bar()

    def on_error(self, loop: Loop, error: BaseException) -> None:
        """The OnError hook: closes the bar, so that the error prints below it."""
        del loop, error
        self._running = False
        self._close_bar()

    def _close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self._output.close()


def _seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
    return float(value)


def progress_bar(
    loop: Loop,
    *,
    refresh_seconds: float = 0.2,
    show_metrics: bool = True,
    clock: Callable[[], float] = time.monotonic,
    file: TextIO | None = None,
    notebook: bool | None = None,
    leave: bool = True,
    summary: bool = False,
    lines: bool | None = None,
    line_seconds: float = 30.0,
    priority: int = Priority.UI,
) -> ProgressBar:
    """Shows a tqdm progress bar: `step k of N`, steps/s, ETA and the train metrics.

    The bar reads `NN%|████| step 120 of 1000 [45.2 steps/s, ETA 00:19] batch=0.231
    ~loss=0.25 acc=93.41%`, with the metrics' short names and pretty-printed values. Rates
    read `2.84k steps/s` past a thousand, `2.22 s/step` under one a second. Steps during
    which an executable was compiled (reported by `trainer.on_exec_creation`) are left out
    of the rate and the ETA. With `run_epochs` the total shows `?` until the first epoch
    ends, then the bar gets its total. Each run (a second `run_steps` too) gets a new bar.
    It refreshes at most once every `refresh_seconds`. Only process 0 shows it.

    Whatever is printed while the bar is shown (a `print` in a hook, a warning, a logged
    line, loopax's own messages) goes on its own line above the bar, which is drawn again
    below it: while the bar is open `sys.stdout`, `sys.stderr` and the logging handlers
    writing to them pass through it (a partial line waits for its newline). They are
    restored when the bar closes: at the end of the run, or when the run raises.

    The metrics shown are those of the newest step that finished on the device: a refresh
    never waits for the steps in flight (with `steps_per_execution=32`, a whole group), so
    they may be a few steps behind the step count; at the end of the run they are the last
    step's.

    Where a redrawn line would not show (the output is not a terminal: a log file, a CI
    log, a notebook without widgets or rendered from its saved output), it writes plain
    lines instead (Keras's `verbose=2`): `step 120 of 1000 [45.2 steps/s, ETA 00:19,
    elapsed 00:03] ~loss=0.25 ...` every `line_seconds`, and always a last line at the end
    of each run with the steps done, the rate, the elapsed time (compilation included) and
    the last step's metrics.

    Args:
      loop: the `loopax.Loop`.
      refresh_seconds: the minimum time between refreshes (default 0.2: 5 a second).
      show_metrics: show the train metrics (reads the newest finished step's from the
        device at each refresh).
      clock: returns the time in seconds; inject a fake one in tests.
      file: where to write (default: tqdm's, `sys.stderr`).
      notebook: None picks a notebook widget or a terminal bar automatically; True/False
        force one.
      leave: keep the finished bar on screen (lines always stay).
      summary: print `trainer.summary()` (every parameter, Keras's `model.summary()`)
        once, above the bar, as soon as the parameters exist (the first step).
      lines: None writes lines when the output is neither a terminal nor a notebook
        widget, a bar otherwise; True always lines, False always a bar.
      line_seconds: the time between two lines (default 30); the last line comes anyway.
      priority: the hooks' priority (default `Priority.UI`: last).

    Returns:
      The `ProgressBar`.

    Raises:
      ValueError: `refresh_seconds` or `line_seconds` is negative.
      TypeError: `clock` is not callable, or `lines` is not None or a bool.
    """
    refresh_seconds = _seconds("refresh_seconds", refresh_seconds)
    line_seconds = _seconds("line_seconds", line_seconds)
    if not callable(clock):
        raise TypeError(f"clock must be a callable returning seconds, got {clock!r}")
    if lines is not None and not isinstance(lines, bool):
        raise TypeError(
            f"lines must be None (lines only where the output is no terminal), True or "
            f"False, got {lines!r}"
        )
    progress = ProgressBar(
        loop.trainer, clock, file, notebook, leave, show_metrics, summary, lines, line_seconds
    )
    if is_writer_process():
        loop.trainer.on_exec_creation(progress.on_exec_creation)
        loop.on_start("progress_bar", progress.on_start, priority=priority)
        loop.on_step(
            "progress_bar",
            progress,
            priority=priority,
            check_finite=False,
            when=ClockSchedule(refresh_seconds, clock, fire_first=True),
        )
        loop.on_end("progress_bar", progress.on_end, priority=priority, check_finite=False)
        loop.on_error("progress_bar", progress.on_error, priority=priority)
    return progress
