"""A lost process: when a process of a multi-process run stops answering, the others end.

Without this, a process whose peer died waits inside a collective (gloo, NCCL) where Python
cannot raise, until JAX's coordination service notices the missing heartbeats
(`heartbeat_timeout_seconds`, 100 s by default) and aborts it from C++ with a stack trace;
a dead coordinator aborts the others at once, the same way. Neither says which checkpoint a
rerun resumes from, and neither exit status tells a launcher to try again.

Here every process of a run beats through the coordination service's key-value store (one
small write a second, on a thread of its own), and during a run watches the others' beats:
a process whose beat has not moved for `LOOPAX_LOST_PROCESS_TIMEOUT` seconds (10 by default)
is lost. The first process to see it writes that down for the others, prints one line (the
lost process, the newest checkpoint every process committed, the command that resumes) and
leaves with `os._exit(LOST_PROCESS_EXIT)`, which works while the main thread is blocked in a
collective. When JAX's own detection comes first (its heartbeat timeout is shorter, or the
coordinator is gone), its abort is caught on the way out and ends the same way.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import json
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._distributed import coordination_client, coordinator_address
from ._lost_report import (
    LOST_PROCESS_EXIT,
    Lost,
    checkpoint_directory,
    lost_line,
)

TIMEOUT_VARIABLE = "LOOPAX_LOST_PROCESS_TIMEOUT"
DEFAULT_TIMEOUT = 10.0
_ALIVE = "loopax/alive/"
_LOST = "loopax/lost"
_ENDED = "ended"


def lost_process_timeout(environ: dict[str, str] | None = None) -> float:
    """Seconds without a beat after which a process is lost (`LOOPAX_LOST_PROCESS_TIMEOUT`).

    Raises:
      ValueError: the variable is not a positive number of seconds.
    """
    value = (os.environ if environ is None else environ).get(TIMEOUT_VARIABLE)
    if value is None or not value.strip():
        return DEFAULT_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(
            f"{TIMEOUT_VARIABLE}={value!r} is not a positive number of seconds; set it to "
            f"the seconds of silence after which a process counts as lost (e.g. "
            f"{TIMEOUT_VARIABLE}={DEFAULT_TIMEOUT:g}), or unset it for {DEFAULT_TIMEOUT:g}"
        )
    return seconds


class Heartbeat:
    """This process's beat, and what it sees of the others' (one per process; see the module).

    The thread writes `loopax/alive/<process>` every `interval` seconds and reads every
    process's. While `watching`, a process whose beat stands still for `timeout` seconds,
    or one another process reported lost, ends this process through `on_lost`. A process
    never seen beating is left to JAX's own heartbeats; one that wrote `ended` (its
    interpreter exits) is not waited for.

    Args:
      client: JAX's distributed client (`loopax._distributed.coordination_client()`).
      process: this process's index.
      count: how many processes.
      timeout: seconds of silence after which a process is lost.
      on_lost: called once with the `Lost` process while watching; it does not return.
      clock: monotonic seconds.
      connected: whether `client` is still JAX's (False once `jax.distributed.shutdown()`
        ran: the beats stop).
    """

    def __init__(
        self,
        client: Any,
        process: int,
        count: int,
        timeout: float,
        on_lost: Callable[[Lost], None],
        clock: Callable[[], float] = time.monotonic,
        connected: Callable[[], bool] = lambda: True,
    ):
        self._client = client
        self._connected = connected
        self.process = process
        self.count = count
        self.timeout = timeout
        self.interval = min(1.0, timeout / 4)
        self._on_lost = on_lost
        self._clock = clock
        self._beats = 0
        self._seen: dict[int, tuple[str, float]] = {}  # process -> (its beat, when it moved)
        self._moves: dict[int, int] = {}  # process -> how many times its beat moved
        self._unreachable_since: float | None = None  # when the service stopped answering
        self.reported: Lost | None = None  # what another process wrote down
        self.watching = 0  # runs in progress that want to hear of a loss
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add_watcher(self) -> int:
        """A run starts watching for a loss; how many watch now."""
        self.watching += 1
        return self.watching

    def remove_watcher(self) -> int:
        """A run stops watching for a loss; how many still watch."""
        self.watching -= 1
        return self.watching

    def beats_into(self, client: Any) -> bool:
        """Whether this heartbeat beats, into `client`'s store."""
        return client is self._client and not self._stopped.is_set()

    def start(self) -> None:
        """Starts the beating thread (a daemon)."""
        self.tick()
        self._thread = threading.Thread(target=self._run, name="loopax-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self.interval):
            if not self._connected():
                self._stopped.set()
                return
            self.tick()

    def tick(self) -> None:
        """One beat: writes this process's, reads the others', acts on a loss when watching."""
        with self._lock:
            if self._stopped.is_set():
                return
            lost = self._look()
        if lost is not None and self.watching:
            self._on_lost(lost)

    def _look(self) -> Lost | None:
        now = self._clock()
        self._beats += 1
        try:
            self._client.key_value_set(
                f"{_ALIVE}{self.process}", str(self._beats), allow_overwrite=True
            )
            beats = self._client.key_value_dir_get(_ALIVE)
        except Exception:  # noqa: BLE001 - any failure: the service is out of reach
            if self._unreachable_since is None:
                self._unreachable_since = now
            silent = now - self._unreachable_since
            if self.process == 0 or silent <= self.timeout:
                return None  # in this process, the service's failure is not a peer's
            return Lost(0, f"its coordination service did not answer for {silent:.1f} s")
        self._unreachable_since = None
        if self.watching and self.reported is None:
            self.reported = self._read_reported()
        if self.reported is not None:
            return self.reported
        for key, beat in beats:
            process = int(key.rsplit("/", 1)[-1])
            if process == self.process:
                continue
            last = self._seen.get(process)
            if last is None or last[0] != beat:
                self._seen[process] = (beat, now)
                self._moves[process] = self._moves.get(process, 0) + 1
        return self.stalest(now, self.timeout)

    def _read_reported(self) -> Lost | None:
        try:
            value = self._client.key_value_try_get(_LOST)
        except Exception:  # noqa: BLE001 - NOT_FOUND: no process was reported lost
            return None
        record = json.loads(value)
        return Lost(int(record["process"]), f"{record['how']}; process {record['by']} found it")

    def now(self) -> float:
        """The heartbeat's clock."""
        return self._clock()

    def stalest(self, now: float, older_than: float) -> Lost | None:
        """The process whose beat stood still longest, if longer than `older_than` seconds."""
        silent = [
            (now - moved, process)
            for process, (beat, moved) in self._seen.items()
            if beat != _ENDED and now - moved > older_than
        ]
        if not silent:
            return None
        seconds, process = max(silent)
        return Lost(process, f"no heartbeat for {seconds:.1f} s")

    def wait_for_beats(self, sleep: Callable[[float], None] = time.sleep) -> None:
        """Returns once every process seen beating has beaten twice more (or ended).

        Twice: a process that died just now may have written its last beat before it died,
        and this process read it after. One that does not within `timeout` is lost: while
        watching, the thread ends this process first; otherwise this returns then.
        """
        since = self._clock()
        moves = dict(self._moves)
        deadline = since + self.timeout + 3 * self.interval
        while self._clock() < deadline and not self._stopped.is_set():
            waiting = [
                process
                for process, (beat, _) in dict(self._seen).items()
                if beat != _ENDED and self._moves[process] < moves.get(process, 0) + 2
            ]
            if not waiting:
                return
            sleep(self.interval / 4)

    def write_lost(self, lost: Lost) -> None:
        """Writes down `lost` for the other processes (the first report stays)."""
        record = {"process": lost.process, "how": lost.how, "by": self.process}
        with contextlib.suppress(Exception):
            self._client.key_value_set(_LOST, json.dumps(record))

    def stop(self, ended: bool = True) -> None:
        """Stops beating; with `ended`, marks this process ended, so that no one waits for it."""
        with self._lock:
            if self._stopped.is_set():
                return
            self._stopped.set()
            if ended:
                with contextlib.suppress(Exception):
                    key = f"{_ALIVE}{self.process}"
                    self._client.key_value_set(key, _ENDED, allow_overwrite=True)


class _AbortGuard:
    """Turns JAX's abort on a lost process into the lost-process exit (SIGABRT, C level).

    JAX's distributed client aborts the process from one of its own threads when the
    coordination service reports a dead process or cannot be reached. A Python signal
    handler would never run (the abort re-raises at once); this one is a C function pointer
    into Python, run on the aborting thread. If no process looks lost it returns, and the
    abort goes on as before.
    """

    _HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_int)

    def __init__(self, find_lost: Callable[[], Lost | None], end: Callable[[Lost], None]):
        self._find_lost = find_lost
        self._end = end
        self._handler = self._HANDLER(self._on_abort)
        self._libc: Any = None
        self._previous: int | None = None

    def install(self) -> None:
        libc = _libc()
        if libc is None:  # no C library to ask: JAX's abort stays as it is
            return
        self._libc = libc
        self._previous = libc.signal(signal.SIGABRT, ctypes.cast(self._handler, ctypes.c_void_p))

    def uninstall(self) -> None:
        if self._libc is not None:
            self._libc.signal(signal.SIGABRT, self._previous)
            self._libc = None

    def _on_abort(self, signum: int) -> None:
        del signum
        lost = self._find_lost()
        if lost is not None:
            self._end(lost)


def _stop_at_exit(heartbeat: Heartbeat) -> None:
    """At the interpreter's exit: the beats end; `ended` unless an uncaught error ends it.

    Python keeps the error it printed in `sys.last_value`. A process that failed so is not
    ended for the others: one still in a run with it counts it lost after the bound, rather
    than waiting for it inside a collective.
    """
    heartbeat.stop(ended=getattr(sys, "last_value", None) is None)


@functools.cache
def _libc() -> Any:
    """The C library's `signal`, or None where there is none to load."""
    try:
        libc = ctypes.CDLL(None)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    return libc


def _coordinator_gone(address: str | None) -> bool:
    """Whether nothing accepts connections at the coordinator's `host:port` any more."""
    if not address:
        return False
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
            return False
    except (OSError, ValueError):
        return True


class LostProcessWatch:
    """The lost-process watch of this process; `for_run` enters it for one run.

    Args:
      heartbeat: this process's `Heartbeat` (started by `for_run`).
      coordinator: the coordination service's `host:port`.
    """

    _current: LostProcessWatch | None = None

    def __init__(self, heartbeat: Heartbeat, coordinator: str | None):
        self.heartbeat = heartbeat
        self._coordinator = coordinator
        self._directory: Callable[[], Path | None] = lambda: None
        self._ending = threading.Lock()
        self._guard = _AbortGuard(self._lost_at_abort, self.end)

    @classmethod
    def for_run(
        cls, devices: Any, loop: Any
    ) -> contextlib.AbstractContextManager[LostProcessWatch | None]:
        """Watches for a lost process during a run whose devices span processes.

        Args:
          devices: the run's devices.
          loop: the running loop, whose checkpoint directory (`note_checkpoint_directory`) a
            lost process's line names.
        """
        if len({device.process_index for device in devices}) < 2:
            return contextlib.nullcontext()
        client = coordination_client()
        if client is None:
            return contextlib.nullcontext()
        if cls._current is None or not cls._current.heartbeat.beats_into(client):
            import jax  # noqa: PLC0415

            watch = cls(
                Heartbeat(
                    client,
                    jax.process_index(),
                    jax.process_count(),
                    lost_process_timeout(),
                    lambda lost: watch.end(lost, report=True),
                    connected=lambda: coordination_client() is client,
                ),
                coordinator_address(),
            )
            watch.heartbeat.start()
            atexit.register(_stop_at_exit, watch.heartbeat)  # before JAX's shutdown (LIFO)
            cls._current = watch
        return cls._current.watching(lambda: checkpoint_directory(loop))

    @contextlib.contextmanager
    def watching(self, directory: Callable[[], Path | None]) -> Any:
        """Acts on a lost process while the block runs."""
        self._directory = directory
        if self.heartbeat.add_watcher() == 1:
            self._guard.install()
        try:
            yield self
        except BaseException:
            # A collective that lost its peer raises (gloo: "Connection closed by peer")
            # before the peer's silence is long enough to tell: wait for that, so that the
            # error of a lost process ends as one, and any other error goes on its way as soon
            # as every process has beaten once more.
            self.heartbeat.wait_for_beats()
            raise
        finally:
            if not self.heartbeat.remove_watcher():
                self._guard.uninstall()

    def _lost_at_abort(self) -> Lost | None:
        """Who is lost, as far as this process can tell while JAX aborts it."""
        heartbeat = self.heartbeat
        if heartbeat.reported is not None:
            return heartbeat.reported
        if heartbeat.process != 0 and _coordinator_gone(self._coordinator):
            return Lost(0, "the coordinator, which holds the coordination service, is gone")
        # JAX aborts for a process silent for its `heartbeat_timeout_seconds`; this process
        # read that one's last beat up to a beat late, so one beat missed is enough to tell.
        return heartbeat.stalest(heartbeat.now(), heartbeat.interval)

    def end(self, lost: Lost, report: bool = False) -> None:
        """Prints the one line and ends this process with `LOST_PROCESS_EXIT`; never returns."""
        with self._ending:  # one line, however many threads find the loss at once
            heartbeat = self.heartbeat
            if report and heartbeat.reported is None:
                heartbeat.write_lost(lost)
                if heartbeat.process == 0 and heartbeat.count > 2:
                    # The service dies with this process: give the others a beat to read it.
                    time.sleep(2 * heartbeat.interval)
            line = lost_line(lost, heartbeat.process, heartbeat.count, self._directory())
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            with contextlib.suppress(OSError):
                os.write(2, f"{line}\n".encode())
            os._exit(LOST_PROCESS_EXIT)
