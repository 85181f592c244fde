"""Worker processes forked from one interpreter that imported JAX and loopax once.

The kill matrices and the multi-process tests start ~100 short JAX processes; each spent
~1.4 s of CPU importing JAX, Flax, loopax, Orbax and matplotlib before its first line of
work. A `Zygote` is a Python process that imports those once and forks a child per run:
each child is a real, separate process (its own pid, killed by a real SIGKILL, its state on
disk read back by the next child), running the worker script as `__main__` from a fresh
JAX: the zygote never initializes a backend or starts a thread, and checks both before it
forks anything.

What a child does not share with a fresh interpreter: its interpreter exit is Python's,
replayed: the non-daemon threads joined (`threading._shutdown`), then the `atexit`
functions, then the streams flushed, as `Py_Finalize` orders them. A real interpreter exit is
still what the signals and quiet tests run, the README's digits job, the checkpoint hook's
exit test and `loopax.testing`'s own tests.

`forked_processes` (in conftest.py) makes `loopax.testing.multiprocess` and `Processes`
start their processes here; a child gets the environment the test asked for (XLA reads
`XLA_FLAGS`, the simulated device count, when the child's backend starts).
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

# The zygote's program: imports, checks it can fork safely, then serves requests (one JSON
# line each on stdin) and answers on the protocol fd: {"ready"}, then per request its
# {"id", "pid"} and, when the child ends, {"id", "returncode"} (as subprocess reports it).
_MAIN = r"""
import importlib, json, os, select, sys, threading
protocol = os.dup(1)
os.dup2(2, 1)  # anything the zygote itself prints goes to its log, never into the protocol
for name in sys.argv[1:]:
    importlib.import_module(name)
import jax._src.xla_bridge as xla_bridge
if threading.active_count() != 1 or xla_bridge._backends:
    sys.exit(f"zygote: cannot fork safely: threads {threading.enumerate()}, "
             f"backends {list(xla_bridge._backends)}")


def send(message):
    os.write(protocol, (json.dumps(message) + "\n").encode())


def child(request):
    os.close(protocol)
    if request.get("new_session"):
        os.setsid()  # as Popen(start_new_session=True): killpg(pid) reaches its children
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, request["out"]), (2, request["err"])):
        if fd == 2 and path == request["out"]:
            os.dup2(1, 2)  # stderr into the same file, as stderr=subprocess.STDOUT does
            continue
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    from zygote import run_child
    run_child(request["argv"], request.get("cwd"), request.get("env"))


send({"ready": True})
children = {}
pending = b""
while True:
    readable, _, _ = select.select([0], [], [], 0.02)
    if readable:
        data = os.read(0, 65536)
        if not data:
            break
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                child(request)
            children[pid] = request["id"]
            send({"id": request["id"], "pid": pid})
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            break
        send({"id": children.pop(pid), "returncode": os.waitstatus_to_exitcode(status)})
for pid in children:
    os.kill(pid, 9)
"""


def run_child(argv: list[str], cwd: str | None, env: dict[str, str] | None = None) -> None:
    """In the forked child: runs script `argv[0]` as `python argv...` would, then exits."""
    import atexit  # noqa: PLC0415
    import runpy  # noqa: PLC0415
    import traceback  # noqa: PLC0415

    code, interrupted = 0, False
    try:
        if env is not None:
            _set_environment(env)  # may refuse: SystemExit, caught below like the script's
        if cwd is not None:
            os.chdir(cwd)
        script = os.path.abspath(argv[0])
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(script)  # where `python script` looks first
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit:
        if exit.code is None or isinstance(exit.code, int):
            code = exit.code or 0
        else:
            print(exit.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        interrupted = True
    except BaseException as error:
        sys.last_type, sys.last_value = type(error), error  # as Python's own print keeps it
        sys.last_traceback = error.__traceback__
        traceback.print_exc()
        code = 1
    # Python's own exit, in Py_Finalize's order.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if interrupted:  # an uncaught Ctrl-C ends a Python process by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


def _set_environment(env: dict[str, str]) -> None:
    """The child's environment becomes `env`, as if its interpreter had started with it.

    XLA reads `XLA_FLAGS` when the backend starts, after this; JAX read its `JAX_*` variables
    when the zygote imported it, so those must be the zygote's (`JAX_PLATFORMS` excepted,
    which is applied here).
    """
    import jax  # noqa: PLC0415

    differ = sorted(
        name
        for name in {*env, *os.environ}
        if name.startswith("JAX_") and name != "JAX_PLATFORMS"
        if env.get(name) != os.environ.get(name)
    )
    if differ:
        sys.exit(f"zygote: JAX read {differ} at import; a forked child cannot change them")
    os.environ.clear()
    os.environ.update(env)
    if "JAX_PLATFORMS" in env:
        jax.config.update("jax_platforms", env["JAX_PLATFORMS"])


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
        child_path = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
        with open(self._log, "w") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-c", _MAIN, *preload],
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
        if not self._ready.result(timeout=120):
            raise RuntimeError(f"the zygote did not start:\n{self._log.read_text()}")

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
