"""The checkpoint hook's background writer: saves off the training thread, one at a time."""

from __future__ import annotations

import atexit
import concurrent.futures
import threading
from typing import Any, Callable


class BackgroundWriter:
    """Runs save functions on one worker thread, one save in flight at a time.

    Orbax's "async" save still blocks its caller for tens of milliseconds (threads,
    directories, metadata) whatever the state's size; making that call here leaves the
    training thread only the copy of the state off the device. `submit` first waits for
    the previous save, so memory holds at most one extra copy of the state and a save is
    committed before the next one starts.
    """

    def __init__(self, where: str, *, in_background: bool = True):
        self.where = where
        self.in_background = bool(in_background)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="loopax-checkpoint"
        )
        self._pending: list[concurrent.futures.Future] = []

    def submit(self, save: Callable[..., None], *args: Any) -> None:
        """Runs `save(*args)` in the background (or now, when not `in_background`)."""
        self.wait()
        if self.in_background:
            self._pending.append(self._pool.submit(save, *args))
        else:
            save(*args)

    def wait(self) -> None:
        """Blocks until the submitted saves are done.

        Raises:
          RuntimeError: a save failed (the original error is chained).
        """
        pending, self._pending = self._pending, []
        for future in pending:
            try:
                future.result()
            except Exception as err:
                raise RuntimeError(
                    f"saving a checkpoint to {self.where!r} failed: {type(err).__name__}: {err}"
                ) from err

    def close(self) -> None:
        """Waits for the saves and stops the worker thread."""
        self.wait()
        self._pool.shutdown(wait=True)


def wait_at_exit(wait: Callable[[], None]) -> None:
    """Runs `wait` at interpreter exit, early enough for Orbax's threads to finish the save.

    Plain `atexit` handlers run after `concurrent.futures` has refused new work, which makes
    an in-flight Orbax save fail; `threading._register_atexit` callbacks run before that
    (last registered first), which is where `concurrent.futures` registers its own.
    """
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        atexit.register(wait)
        return
    try:
        register(wait)
    except RuntimeError:  # the interpreter is already shutting down
        pass
