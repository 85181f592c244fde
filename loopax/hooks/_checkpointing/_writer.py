"""The checkpoint hook's background writer: saves off the training thread, one at a time."""

from __future__ import annotations

import atexit
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

from ...loop import NonFiniteLossError


class BackgroundSaveError(RuntimeError):
    """A checkpoint save in the background failed; the message names the directory."""


class NonFiniteSaveError(NonFiniteLossError):
    """A save refused because the state holds NaN or infinite values.

    A `loopax.NonFiniteLossError`: `except NonFiniteLossError` catches it wherever it
    surfaces (`wait()`, the next step), as it catches a non-finite loss.
    """


class BackgroundWriter:
    """Runs save functions on one worker thread, one save in flight at a time.

    Orbax's "async" save still blocks its caller for tens of milliseconds (threads,
    directories, metadata) whatever the state's size; making that call here leaves the
    training thread only the copy of the state off the device. `submit` first waits for
    the previous save, so memory holds at most one extra copy of the state and a save is
    committed before the next one starts. A failed save is reported to `on_failure` from
    the worker thread as soon as it fails (the loop raises it at its next step), and raised
    by the next `wait` unless it was reported there already.
    """

    def __init__(
        self,
        where: str,
        *,
        in_background: bool = True,
        on_failure: Callable[[BaseException], None] | None = None,
    ):
        self.where = where
        self.in_background = bool(in_background)
        self.on_failure = on_failure
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="loopax-checkpoint"
        )
        self._pending: list[concurrent.futures.Future] = []
        self._lock = threading.Lock()

    def _error(self, err: BaseException) -> Exception:
        message = f"saving a checkpoint to {self.where!r} failed: {type(err).__name__}: {err}"
        if isinstance(err, NonFiniteLossError):
            error: Exception = NonFiniteSaveError(message, err.step)
        else:
            error = BackgroundSaveError(message)
        error.__cause__ = err
        return error

    def _run(self, save: Callable[..., None], args: tuple) -> None:
        try:
            save(*args)
        except BaseException as err:
            error = self._error(err)
            if self.on_failure is not None:
                self.on_failure(error)
            raise error from err

    def submit(self, save: Callable[..., None], *args: Any) -> None:
        """Runs `save(*args)` in the background (or now, when not `in_background`)."""
        self.wait()
        if self.in_background:
            with self._lock:
                self._pending.append(self._pool.submit(self._run, save, args))
        else:
            try:
                save(*args)
            except Exception as err:
                raise self._error(err) from err

    def busy(self) -> bool:
        """Whether a save is still in flight."""
        with self._lock:
            return any(not future.done() for future in self._pending)

    def wait(self) -> None:
        """Blocks until the submitted saves are done.

        Raises:
          BackgroundSaveError: a save failed (the original error is chained).
          NonFiniteSaveError: a save was refused for NaN or infinite values.
        """
        with self._lock:
            pending = list(self._pending)
        for future in pending:
            try:
                future.result()
            finally:  # a save counts as in flight (`busy`) until it is done
                with self._lock:
                    if future in self._pending:
                        self._pending.remove(future)

    def settle(self) -> None:
        """Blocks until the submitted saves are done, raising nothing (`wait` raises)."""
        with self._lock:
            pending = list(self._pending)
        concurrent.futures.wait(pending)

    def close(self) -> None:
        """Waits for the saves and stops the worker thread."""
        try:
            self.wait()
        finally:
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
