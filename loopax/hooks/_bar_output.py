"""Lines printed while a progress bar is shown: each on its own line, the bar redrawn below.

A terminal bar is one line that tqdm redraws after a carriage return, with no newline at
its end: anything else written to the terminal would continue that line
(`...~acc=99.93%early stopping: ...`). While the bar is open, `sys.stdout`, `sys.stderr`
and the logging handlers that write to them go through `LinesAboveBar`, which clears the
bar, writes whole lines and draws the bar again. So a `print` in a hook, a warning, a
logged line and loopax's own lines all land above the bar.
"""

from __future__ import annotations

import logging
import sys
from typing import Any


class LinesAboveBar:
    """A text stream in front of `target` that writes whole lines above `bar`.

    A partial line (`print(..., end="")`) waits for its newline, or for the bar to close,
    so that it never lands on the bar's line. Once the bar is closed (`release`) it passes
    everything straight to `target`.

    Attributes:
      target: the stream written to (the `sys.stdout` or `sys.stderr` it replaced).
    """

    def __init__(self, target: Any, bar: Any):
        self.target = target
        self._bar: Any = bar
        self._lock = type(bar).get_lock()
        self._pending = ""

    def write(self, text: str) -> int:
        with self._lock:
            bar = self._bar
            if bar is None:
                return self.target.write(text)
            self._pending += text
            lines, newline, self._pending = self._pending.rpartition("\n")
            if newline:
                bar.clear(nolock=True)
                bar.fp.flush()  # tqdm leaves its last carriage return in the buffer
                self.target.write(lines + newline)
                self.target.flush()
                bar.refresh(nolock=True)
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        # A partial line stays pending: flushed now, it would continue the bar's line.
        self.target.flush()

    def release(self) -> None:
        """The bar has closed: writes what is pending and passes everything on from now."""
        with self._lock:
            self._bar = None
            pending, self._pending = self._pending, ""
            if pending:
                self.target.write(pending)
                self.target.flush()

    def __getattr__(self, name: str) -> Any:
        # encoding, isatty, fileno, buffer, ...: the stream's own.
        return getattr(self.target, name)


class BarOutput:
    """Routes `sys.stdout`, `sys.stderr` and their logging handlers above a bar, and back.

    `open(bar)` installs the streams; `close()` restores every one that is still ours (a
    stream someone replaced meanwhile is left as they set it; ours then writes through).
    """

    def __init__(self) -> None:
        self._streams: dict[str, LinesAboveBar] = {}
        self._handlers: list[tuple[logging.StreamHandler, LinesAboveBar]] = []

    def open(self, bar: Any) -> None:
        self.close()
        originals: dict[int, LinesAboveBar] = {}
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            if stream is None:  # pythonw: no console
                continue
            wrapper = LinesAboveBar(stream, bar)
            originals[id(stream)] = wrapper
            self._streams[name] = wrapper
            setattr(sys, name, wrapper)
        # Handlers hold the stream they were given (logging.basicConfig: sys.stderr then).
        for handler in _stream_handlers():
            wrapper = originals.get(id(handler.stream))
            if wrapper is not None:
                handler.setStream(wrapper)  # type: ignore[arg-type]
                self._handlers.append((handler, wrapper))

    def close(self) -> None:
        for handler, wrapper in self._handlers:
            if handler.stream is wrapper:
                handler.setStream(wrapper.target)
        for name, wrapper in self._streams.items():
            if getattr(sys, name) is wrapper:
                setattr(sys, name, wrapper.target)
        for wrapper in self._streams.values():
            wrapper.release()
        self._streams, self._handlers = {}, []


def _stream_handlers() -> list[logging.StreamHandler]:
    """Every `StreamHandler` attached to the root logger or any logger created so far."""
    loggers: list[Any] = [logging.getLogger()]
    loggers += [
        logger
        for logger in list(logging.Logger.manager.loggerDict.values())
        if isinstance(logger, logging.Logger)
    ]
    found: dict[int, logging.StreamHandler] = {}
    for logger in loggers:
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler):
                found[id(handler)] = handler
    return list(found.values())
