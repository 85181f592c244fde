"""SIGINT and SIGTERM during a run: the first finishes the step and ends the run cleanly."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM") if hasattr(signal, name))


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Interrupts:
    """Installs SIGINT/SIGTERM handlers for the duration of a run (main thread only).

    The first signal calls `on_first(signum)`, which asks the loop to stop after the
    current step; the loop then saves, runs its OnEnd hooks and exits. A second signal
    exits the process at once with status 128 + signum: every checkpoint save is atomic, so
    a save cut off by it is never taken for a checkpoint. Outside the main thread (where
    Python cannot install handlers) nothing is installed.
    """

    def __init__(self, on_first: Callable[[int], None]):
        self._on_first = on_first
        self._previous: dict[int, Any] = {}
        self.received: int | None = None

    def __enter__(self) -> Interrupts:
        self.received = None
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                try:
                    self._previous[signum] = signal.signal(signum, self._handle)
                except (ValueError, OSError):  # e.g. an embedding that forbids it
                    continue
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        del frame
        if self.received is None:
            self.received = signum
            self._on_first(signum)
            return
        print(f"loopax: second {signal_name(signum)}: exiting now", file=sys.stderr, flush=True)
        os._exit(128 + signum)


def exit_interrupted(signum: int, step: int, checkpointed_step: int | None) -> None:
    """Ends the process after a run stopped by `signum` at global step `step`, in one line.

    The line says whether a checkpoint holds that step (`checkpointed_step`: the newest
    saved, or None).

    Raises:
      SystemExit: always, with status 128 + signum.
    """
    if checkpointed_step == step:
        saved = f"saved checkpoint {step}; run again to resume"
    elif checkpointed_step is not None:
        saved = f"the newest checkpoint is {checkpointed_step}; run again to resume"
    else:
        saved = "no checkpoint hook is attached, so nothing was saved"
    print(f"interrupted at step {step}; {saved}", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)
