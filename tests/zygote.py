"""Worker processes forked from one interpreter that imported JAX and loopax once.

The kill matrices and the multi-process tests start ~100 short JAX processes; each spent
~1.4 s of CPU importing JAX, Flax, loopax, Orbax and matplotlib before its first line of
work. A `Zygote` starts a fork server (`_zygote_server.py`) that imports those once and forks
a child per run: each child is a real, separate process (its own pid, killed by a real
SIGKILL, its state on disk read back by the next child), running the worker script as
`__main__` from a fresh JAX (the server never initializes a backend or starts a thread, and
checks both before it forks anything), and ending by the interpreter's own exit, as after
`python script.py`.

What a child does not share with a fresh interpreter: the modules are imported already (JAX
read its `JAX_*` variables then: a child that asks for others is refused), and `tests/` is on
its path, as it is in the test session (a test module a child imports finds its helpers).
The signals and quiet tests, the README's digits job, the checkpoint hook's exit test and
`loopax.testing`'s own tests start fresh interpreters.

`forked_processes` (in conftest.py) makes `loopax.testing.multiprocess` and `Processes`
start their processes here; a child gets the environment the test asked for (XLA reads
`XLA_FLAGS`, the simulated device count, when the child's backend starts).

Why not `multiprocessing`'s forkserver with `set_forkserver_preload`: it keeps one server
per interpreter, started with the environment of its first use (a `Zygote` takes its own);
it ignores a preload that fails to import and checks no threads or backends before forking;
its children leave by `os._exit` without the `atexit` functions (the workers rely on
loopax's: the event writers' close, and JAX's); and it pickles what it sends. What it would
save is the transport (fork on request, pid, exit status): ~40 lines here.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path

PRELOAD = ("jax", "numpy", "flax.linen", "optax", "loopax", "loopax.hooks", "loopax.testing",
           "orbax.checkpoint", "matplotlib", "tensorboard", "pytest")  # fmt: skip


class Child:
    """A forked child, with the part of `subprocess.Popen` that tests use."""

    def __init__(self, args: list[str], pid: int, returncode: Future):
        self.args = args
        self.pid = pid
        self._returncode = returncode

    @property
    def returncode(self) -> int | None:
        return self._returncode.result() if self._returncode.done() else None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        try:
            return self._returncode.result(timeout=timeout)
        except TimeoutError:
            raise subprocess.TimeoutExpired(self.args, timeout or 0) from None

    def finish(self, timeout: float) -> int:
        """Waits up to `timeout` seconds; past it, kills the child and raises TimeoutExpired."""
        try:
            return self.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait(timeout=60)
            raise

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """Starts the zygote with `env`; `run(argv)` is `subprocess.run([python, *argv])`'s stand-in.

    Thread-safe: several runs may be in flight at once. Use as a context manager (the zygote
    and any child left are killed at the end).
    """

    def __init__(self, env: dict[str, str], preload: tuple[str, ...] = PRELOAD):
        self._files = tempfile.TemporaryDirectory(prefix="loopax-zygote-")
        self._log = Path(self._files.name) / "zygote.log"
        # The server's module, and tests/ on its children's path (see the module docstring).
        child_path = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
        with open(self._log, "w") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "_zygote_server", *preload],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env={**env, "PYTHONPATH": child_path},
            )
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._waiting: dict[int, dict[str, Future]] = {}
        self._ready: Future = Future()
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()
        try:
            started = self._ready.result(timeout=120)
        except TimeoutError:
            started = False
        if not started:
            log = self._log.read_text()
            self.close()
            raise RuntimeError(f"the zygote did not start:\n{log}")

    @property
    def pid(self) -> int:
        """The server's pid: every child's parent."""
        return self._process.pid

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            message = json.loads(line)
            if "ready" in message:
                self._ready.set_result(True)
                continue
            futures = self._waiting.get(message["id"])
            if futures is None:  # a run that gave up waiting (its pid never came in time)
                continue
            key = "pid" if "pid" in message else "returncode"
            futures[key].set_result(message[key])
        # The zygote ended: nothing more will come.
        if not self._ready.done():
            self._ready.set_result(False)
        for futures in list(self._waiting.values()):
            for future in futures.values():
                if not future.done():
                    future.set_exception(RuntimeError(f"zygote died:\n{self._log.read_text()}"))

    def start(
        self,
        argv: list[str],
        *,
        out: str | os.PathLike[str],
        err: str | os.PathLike[str],
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        new_session: bool = False,
    ) -> Child:
        """Starts `python argv...` in a forked child writing to `out` and `err`.

        `out` and `err` may be one path (one file, as `stderr=subprocess.STDOUT`); `env`
        replaces the child's environment.
        """
        for path in (out, err):  # there at once, as Popen's parent opens them
            open(path, "w").close()
        with self._lock:
            if self._process.poll() is not None:
                raise RuntimeError(f"the zygote has ended:\n{self._log.read_text()}")
            index = next(self._ids)
            futures = {"pid": Future(), "returncode": Future()}
            self._waiting[index] = futures
            request = {"id": index, "argv": [str(a) for a in argv], "cwd": cwd,
                       "out": os.fspath(out), "err": os.fspath(err), "env": env,
                       "new_session": new_session}  # fmt: skip
            assert self._process.stdin is not None
            self._process.stdin.write((json.dumps(request) + "\n").encode())
            self._process.stdin.flush()
        # Its answers then come (or never will): the reader thread finds it no more.
        futures["returncode"].add_done_callback(lambda _: self._waiting.pop(index, None))
        try:
            pid = futures["pid"].result(timeout=60)
        except BaseException:
            self._waiting.pop(index, None)
            raise
        return Child([str(a) for a in argv], pid, futures["returncode"])

    def run(
        self,
        argv: list[str],
        *,
        timeout: float,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ):
        """Runs `python argv...` in a forked child; a `subprocess.CompletedProcess` (text)."""
        name = next(self._ids)  # any unused number names the files
        out = Path(self._files.name) / f"run{name}.out"
        err = Path(self._files.name) / f"run{name}.err"
        child = self.start(argv, out=out, err=err, cwd=cwd, env=env)
        try:
            returncode = child.finish(timeout)
        except subprocess.TimeoutExpired as late:
            output, errors = out.read_text(), err.read_text()
            raise subprocess.TimeoutExpired(argv, timeout, output, errors) from late
        return subprocess.CompletedProcess(argv, returncode, out.read_text(), err.read_text())

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Ends the zygote (killing any child still running) and removes the runs' files."""
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._reader.join(timeout=30)
        if self._process.stdout is not None:
            self._process.stdout.close()
        self._files.cleanup()
