"""SIGINT and SIGTERM while a save is still committing, after its run returned.

A run returns before its end-of-run save is committed (Orbax writes it in the background).
A signal that came then would end the process by its default action (a `KeyboardInterrupt`
traceback, or death by SIGTERM) and lose that save. So while a save is in flight a signal
keeps the run's contract instead: the save finishes, one line says so
(`interrupted at step K; saved checkpoint K; ...`), and the process exits with 128 +
the signal (130, 143); a second signal exits at once, as during a run. With no save in
flight the handler hands the signal on to the one it replaced, so it changes nothing
else. It is installed (main thread only) when the first checkpoint hook is attached; a
run's own handlers replace it while the run lasts and put it back after.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

from ...loop._internal import SIGNALS, exit_interrupted, signal_name
from ._writer import wait_at_exit

_CHECKPOINTERS: weakref.WeakSet[Any] = weakref.WeakSet()  # each has `saving()`, `settle()`
_previous: dict[int, Any] = {}  # the handler each signal had before this one
_state = {"waiting": False, "exiting": False}


def guard(checkpointer: Any) -> None:
    """Guards `checkpointer`'s saves in flight against SIGINT and SIGTERM (see the module).

    Also has the interpreter's exit wait for them (`wait_quietly`). `checkpointer` has
    `saving()` (whether a save is in flight), `settle()` (waits for its saves, raising
    nothing), `trainer.global_step` and `loop.checkpointed_step`.
    """
    wait_at_exit(_at_exit(checkpointer.wait_quietly))
    _CHECKPOINTERS.add(checkpointer)
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in SIGNALS:
        try:
            current = signal.getsignal(signum)
            if current is _handle:
                continue
            signal.signal(signum, _handle)
        except (ValueError, OSError):  # e.g. an embedding that forbids it
            continue
        _previous[signum] = current


def _at_exit(wait: Callable[[], None]) -> Callable[[], None]:
    """`wait`, marking that the interpreter is exiting while it runs (for the handler)."""

    def waiting_at_exit() -> None:
        _state["exiting"] = True
        wait()

    return waiting_at_exit


def _handle(signum: int, frame: Any) -> None:
    if _state["waiting"]:
        print(f"loopax: second {signal_name(signum)}: exiting now", file=sys.stderr, flush=True)
        os._exit(128 + signum)
    saving = [checkpointer for checkpointer in list(_CHECKPOINTERS) if checkpointer.saving()]
    if not saving:
        _hand_on(signum, frame)
        return
    _state["waiting"] = True
    try:
        for checkpointer in saving:
            checkpointer.settle()
    finally:
        _state["waiting"] = False
    last = saving[-1]
    code = 128 + signum
    try:
        exit_interrupted(signum, last.trainer.global_step, last.loop.checkpointed_step)
    except SystemExit:
        if not _state["exiting"]:
            raise
    # The interpreter was already exiting (waiting for this save): its status is fixed by
    # now, so finish its exit functions here and leave with the signal's status.
    exit_functions = getattr(atexit, "_run_exitfuncs", None)
    if exit_functions is not None:
        exit_functions()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _hand_on(signum: int, frame: Any) -> None:
    """What the signal would have done without this handler."""
    previous = _previous.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:  # the default action (or a handler set outside Python)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
