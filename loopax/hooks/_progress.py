"""`progress_bar`: a tqdm bar with step k of N, steps/s, an ETA free of compile time, metrics."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from typing import Any, TextIO

from ..loop import Loop, Priority
from ..trainer import Trainer
from ._metric_info import is_writer_process, train_metric_infos
from ._schedules import ClockSchedule

_KNOWN_TOTAL_FORMAT = "{percentage:3.0f}%|{bar}| {status}"
_NO_BAR_FORMAT = "{percentage:3.0f}% {status}"
_UNKNOWN_TOTAL_FORMAT = "{status}"
_MIN_BAR = 10  # columns: a narrower bar says nothing, so the metrics get its room


class Throughput:
    """Steps per second and ETA that leave out the steps during which something compiled.

    The caller marks each finished step with `step_done(now)`; `compiled()` says an executable
    was compiled since the previous mark, so that interval (compile time plus a step) is not
    counted: otherwise the first step's compilation would skew every estimate.

    Example:
      >>> throughput = Throughput()
      >>> throughput.start(0.0)
      >>> throughput.compiled()
      >>> throughput.step_done(30.0)  # step 1 compiled for 30 s: not counted
      >>> for now in (30.5, 31.0, 31.5):
      ...     throughput.step_done(now)
      >>> throughput.steps_per_second(), throughput.eta_seconds(steps_left=10)
      (2.0, 5.0)
    """

    counted_steps: int
    counted_seconds: float

    def __init__(self) -> None:
        self.counted_steps = 0
        self.counted_seconds = 0.0
        self._last: float | None = None
        self._compiled = False

    def start(self, now: float) -> None:
        """Starts timing (a new run): the next interval ends at the next `step_done`."""
        self._last = now
        self._compiled = False

    def compiled(self) -> None:
        """Marks the current interval as including a compilation."""
        self._compiled = True

    def step_done(self, now: float, steps: int = 1) -> None:
        """Ends an interval of `steps` steps; counts it unless it included a compilation."""
        if self._last is not None and not self._compiled:
            self.counted_steps += steps
            self.counted_seconds += now - self._last
        self._last = now
        self._compiled = False

    def steps_per_second(self) -> float | None:
        """The mean rate over the counted steps, or None before any."""
        if self.counted_steps == 0 or self.counted_seconds <= 0:
            return None
        return self.counted_steps / self.counted_seconds

    def eta_seconds(self, steps_left: int) -> float | None:
        """Seconds for `steps_left` more steps at the current rate, or None if unknown."""
        rate = self.steps_per_second()
        return None if rate is None or steps_left < 0 else steps_left / rate


def _format_interval(seconds: float) -> str:
    from tqdm import tqdm

    return tqdm.format_interval(seconds)


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


class ProgressBar:
    """The progress bar hooks; created by `progress_bar`.

    Attributes:
      throughput: the `Throughput` (steps/s and ETA without compile time) of the current run.
      bar: the tqdm bar of the current run, or None.
    """

    throughput: Throughput

    def __init__(
        self,
        trainer: Trainer,
        clock: Callable[[], float],
        file: TextIO | None,
        notebook: bool | None,
        leave: bool,
        show_metrics: bool,
        summary: bool = False,
    ):
        self.clock = clock
        self.show_metrics = show_metrics
        self._summary_due = summary  # printed once, when the parameters first exist
        self.throughput = Throughput()
        self.bar: Any = None
        self._bar_class = _bar_class(notebook)
        # What every bar of this hook is built with, besides its run's total and format.
        self._bar_options = {
            "file": file,
            "leave": leave,
            "dynamic_ncols": True,
            "miniters": 1,
            "mininterval": 0,
        }
        self._infos = train_metric_infos(trainer)
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
        self.throughput.start(self.clock())
        known = loop.end_step >= 0
        # Shown by tqdm's first display, inside its constructor.
        self._bar_class.status = self.status(loop, loop.start_step, None)
        self.bar = self._bar_class(
            total=loop.end_step if known else None,
            initial=loop.start_step,
            bar_format=_KNOWN_TOTAL_FORMAT if known else _UNKNOWN_TOTAL_FORMAT,
            **self._bar_options,
        )
        self._refreshed_step = loop.start_step

    def status(self, loop: Loop, steps_done: int, host_metrics: dict[str, Any] | None) -> str:
        """The text after the bar: `step k of N [r steps/s, ETA t] metrics`."""
        return self._statuses(loop, steps_done, host_metrics)[0]

    def _statuses(
        self, loop: Loop, steps_done: int, host_metrics: dict[str, Any] | None
    ) -> list[str]:
        """The status text, longest first, then shorter forms that cut no value.

        The full `step k of N [r steps/s, ETA t] metrics`, then `k/N r/s t metrics`, then
        `k/N metrics`, then `k/N` with the first metrics dropped one by one.
        """
        total = "?" if loop.end_step < 0 else str(loop.end_step)
        rate = self.throughput.steps_per_second()
        rate_text = "?" if rate is None else f"{rate:.3g}"
        if loop.end_step < 0:
            eta_text = "?"
        else:
            eta = self.throughput.eta_seconds(loop.end_step - steps_done)
            eta_text = "?" if eta is None else _format_interval(eta)
        metrics = [
            f"{info.short_name}={info.pretty_print(host_metrics[info.key])}"
            for info in self._infos
            if host_metrics and info.key in host_metrics
        ]
        shown = "".join(" " + m for m in metrics)
        short = f"{steps_done}/{total}"
        texts = [
            f"step {steps_done} of {total} [{rate_text} steps/s, ETA {eta_text}]{shown}",
            f"{short} {rate_text}/s {eta_text}{shown}",
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

    def _refresh(self, loop: Loop, steps_done: int, display: bool = True) -> None:
        self._print_summary(loop)
        bar = self.bar
        if loop.end_step != self._end_step:
            # run_epochs learned the length of the run at the end of the first epoch.
            self._end_step = loop.end_step
            bar.total = loop.end_step if loop.end_step >= 0 else None
        host_metrics = loop.host_metrics() if self.show_metrics else None
        bar.n = steps_done
        statuses = self._statuses(loop, steps_done, host_metrics)
        bar.bar_format, bar.status = self._fit(loop.end_step >= 0, statuses)
        if display:
            bar.refresh()

    def __call__(self, loop: Loop, metrics: Any) -> None:
        """The OnStep hook: refreshes the bar.

        It runs on the steps its `ClockSchedule` picks (every `refresh_seconds`).
        """
        if self.bar is None:
            return
        now = self.clock()
        steps_done = loop.loop_step + 1
        self.throughput.step_done(now, steps_done - self._refreshed_step)
        self._refreshed_step = steps_done
        self._refresh(loop, steps_done)

    def on_end(self, loop: Loop, metrics: Any) -> None:
        if self.bar is None:
            return
        # close() displays the final state once more: no refresh of our own.
        steps_done = loop.trainer.global_step
        if steps_done != self._refreshed_step:
            self.throughput.step_done(self.clock(), steps_done - self._refreshed_step)
            self._refreshed_step = steps_done
        self._refresh(loop, steps_done, display=False)
        self._close_bar()

    def _close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


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
    priority: int = Priority.UI,
) -> ProgressBar:
    """Shows a tqdm progress bar: `step k of N`, steps/s, ETA and the train metrics.

    The bar reads `NN%|████| step 120 of 1000 [45.2 steps/s, ETA 00:19] batch=0.231
    ~loss=0.25 acc=93.41%`, with the metrics' short names and pretty-printed values. Steps
    during which an executable was compiled (reported by `trainer.on_exec_creation`) are left
    out of the rate and the ETA. With `run_epochs` the total shows `?` until the first epoch
    ends, then the bar gets its total. Each run (a second `run_steps` too) gets a new bar. It
    refreshes at most once every `refresh_seconds` and reads the metrics from the device only
    then. Only process 0 shows it.

    Args:
      loop: the `loopax.Loop`.
      refresh_seconds: the minimum time between refreshes (default 0.2: 5 a second).
      show_metrics: show the train metrics (reads them from the device at each refresh).
      clock: returns the time in seconds; inject a fake one in tests.
      file: where to write (default: tqdm's, `sys.stderr`).
      notebook: None picks a notebook widget or a terminal bar automatically; True/False
        force one.
      leave: keep the finished bar on screen.
      summary: print `trainer.summary()` (every parameter, Keras's `model.summary()`)
        once, above the bar, as soon as the parameters exist (the first step).
      priority: the hooks' priority (default `Priority.UI`: last).

    Returns:
      The `ProgressBar`.

    Raises:
      ValueError: `refresh_seconds` is negative.
      TypeError: `clock` is not callable.
    """
    if (
        isinstance(refresh_seconds, bool)
        or not isinstance(refresh_seconds, (int, float))
        or not refresh_seconds >= 0
    ):
        raise ValueError(f"refresh_seconds must be a number >= 0, got {refresh_seconds!r}")
    if not callable(clock):
        raise TypeError(f"clock must be a callable returning seconds, got {clock!r}")
    progress = ProgressBar(loop.trainer, clock, file, notebook, leave, show_metrics, summary)
    if is_writer_process():
        loop.trainer.on_exec_creation(progress.on_exec_creation)
        loop.on_start("progress_bar", progress.on_start, priority=priority)
        loop.on_step(
            "progress_bar",
            progress,
            priority=priority,
            check_finite=False,
            when=ClockSchedule(float(refresh_seconds), clock, fire_first=True),
        )
        loop.on_end("progress_bar", progress.on_end, priority=priority, check_finite=False)
    return progress
