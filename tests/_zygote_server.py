"""The fork server that `zygote.Zygote` starts: `python -m _zygote_server MODULE...`.

It imports the modules named, checks that it can fork safely (one thread, no JAX backend),
then serves requests, one JSON line each on stdin, and answers on the protocol pipe (its
stdout as started; what it prints itself goes to stderr, its log): `{"ready": true}`, then per
request `{"id", "pid"}` and, when that child ends, `{"id", "returncode"}` (as subprocess
reports it).

A child sets up its streams, session, environment and directory as the request asks, runs
the script as `__main__`, and ends by the interpreter's own exit: the script's `SystemExit`
or exception leaves `main()` for the top level, where `Py_FinalizeEx` joins the non-daemon
threads, runs the `atexit` functions and flushes the streams, and an uncaught Ctrl-C ends the
process by SIGINT, as after `python script.py` (whose traceback starts at the script's frame,
as the child's does).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import runpy
import select
import sys
import threading
from typing import Any, NoReturn


def main(preload: list[str]) -> None:
    """Imports `preload`, then serves requests until stdin closes; a child never returns."""
    protocol = os.dup(1)
    os.dup2(2, 1)  # what the server prints goes to its log, never into the protocol
    for name in preload:
        importlib.import_module(name)
    _refuse_unsafe_fork()
    _send(protocol, {"ready": True})
    children: dict[int, int] = {}  # pid -> request id
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
                sys.stdout.flush()  # nothing buffered here is written twice by a child
                sys.stderr.flush()
                # The child's collections then skip the preloaded objects, which never die:
                # they would write to each one and copy its page, ~0.4 s of CPU at exit.
                gc.freeze()
                pid = os.fork()
                if pid == 0:
                    os.close(protocol)
                    _run_child(request)
                children[pid] = request["id"]
                _send(protocol, {"id": request["id"], "pid": pid})
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            returncode = os.waitstatus_to_exitcode(status)
            _send(protocol, {"id": children.pop(pid), "returncode": returncode})
    for pid in children:
        os.kill(pid, 9)


def _refuse_unsafe_fork() -> None:
    """Exits if a module imported a thread into being or started a JAX backend.

    A forked child holds only the forking thread (a lock another thread held stays held) and
    would share the backend's device state. JAX names no public way to ask whether a backend
    started without starting one, so this asks `jax._src.xla_bridge`; native thread pools
    (OpenBLAS starts one when numpy loads) are fork-safe by their own `pthread_atfork`.
    """
    from jax._src import xla_bridge  # noqa: PLC0415  (after the preloads, which import jax)

    if threading.active_count() != 1 or xla_bridge.backends_are_initialized():
        sys.exit(
            f"zygote: cannot fork safely: threads {threading.enumerate()}, backends "
            f"initialized: {xla_bridge.backends_are_initialized()}"
        )


def _send(protocol: int, message: dict[str, Any]) -> None:
    os.write(protocol, (json.dumps(message) + "\n").encode())


def _run_child(request: dict[str, Any]) -> NoReturn:
    """In the forked child: runs `request["argv"]` as `python argv...` would, then exits.

    Exits by `SystemExit` (the script's, or 0 after it returns) or by the script's exception,
    raised up through `main` to the interpreter, which ends the process as after any script.
    """
    if request.get("new_session"):
        os.setsid()  # as Popen(start_new_session=True): killpg(pid) reaches its children
    _redirect(request["out"], request["err"])
    if request.get("env") is not None:
        _set_environment(request["env"])  # may refuse: SystemExit, as the script's would
    if request.get("cwd") is not None:
        os.chdir(request["cwd"])
    argv = request["argv"]
    script = os.path.abspath(argv[0])
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(script)  # where `python script` looks first
    sys.excepthook = _from_the_script_on(script)
    runpy.run_path(script, run_name="__main__")
    sys.exit(0)


def _from_the_script_on(script: str) -> Any:
    """An excepthook that prints a traceback from the script's first frame on, as
    `python script.py` does, rather than from this module's."""

    def excepthook(kind: type[BaseException], error: BaseException, traceback: Any) -> None:
        start = traceback
        while start is not None and start.tb_frame.f_code.co_filename != script:
            start = start.tb_next
        if start is not None:  # the default hook prints the exception's own traceback
            error.with_traceback(start)
        sys.__excepthook__(kind, error, error.__traceback__)

    return excepthook


def _redirect(out: str, err: str) -> None:
    """Stdin from /dev/null; stdout to `out`, stderr to `err` (one file when they are equal,
    as `stderr=subprocess.STDOUT` does)."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, out), (2, err)):
        if fd == 2 and path == out:
            os.dup2(1, 2)
            continue
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, fd)
        os.close(opened)


def _set_environment(env: dict[str, str]) -> None:
    """The child's environment becomes `env`, as if its interpreter had started with it.

    XLA reads `XLA_FLAGS` when the backend starts, after this; JAX read its `JAX_*` variables
    when the server imported it, so those must be the server's (`JAX_PLATFORMS` excepted,
    which is applied here).
    """
    import jax  # noqa: PLC0415  (preloaded: no import cost)

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


if __name__ == "__main__":
    main(sys.argv[1:])
