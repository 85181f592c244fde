"""Running one function in several JAX processes on this machine, the way a cluster would.

Each process is a fresh Python interpreter with its own simulated CPU devices, joined to the
others by `jax.distributed.initialize` on a free loopback port, with gloo CPU collectives.
The function is found again in each child by its module file and name (nothing is pickled);
its arguments and return value travel as JSON. Every wait has a timeout: a process that
hangs is killed by pid, and the error shows each process's log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

# What a child runs: set the devices before JAX starts, join the others, call the function.
BOOTSTRAP = r"""
import importlib, importlib.util, json, os, sys
spec = json.loads(sys.argv[1])
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
if spec["num_processes"] > 1:
    jax.distributed.initialize(
        spec["address"], spec["num_processes"], spec["process_id"],
        initialization_timeout=int(spec["timeout"]) + 1,
        heartbeat_timeout_seconds=spec["heartbeat"],
    )
if spec["path"] not in sys.path:
    sys.path.insert(0, spec["path"])
try:
    module = importlib.import_module(spec["module"])
except ModuleNotFoundError:
    module_spec = importlib.util.spec_from_file_location(spec["module"], spec["file"])
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[spec["module"]] = module
    module_spec.loader.exec_module(module)
fn = module
for part in spec["qualname"].split("."):
    fn = getattr(fn, part)
value = fn(*spec["args"])
with open(spec["result"], "w") as f:
    json.dump(value, f)
"""


def _start_process(spec: str, log: Path, env: dict[str, str]) -> subprocess.Popen:
    """Starts one process of a group: a fresh interpreter running `BOOTSTRAP` with `spec`.

    The process runs in a session of its own (`Processes.kill` ends it and anything it
    started), its stdout and stderr into `log`.
    """
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-c", BOOTSTRAP, spec],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


# How `Processes` starts each process: `_start_process`, or the innermost
# `starting_processes_with` block's function.
_starters: list[Callable[[str, Path, dict[str, str]], Any]] = [_start_process]


@contextlib.contextmanager
def starting_processes_with(
    start: Callable[[str, Path, dict[str, str]], Any],
) -> Iterator[None]:
    """Within the block, `Processes` starts each process with `start(spec, log, env)`.

    `start` runs `BOOTSTRAP` with the argument `spec` as `_start_process` does (same
    environment, a session of its own, stdout and stderr into `log`) and returns an object
    with the part of `subprocess.Popen` that `Processes` uses (`pid`, `poll`, `wait`,
    `returncode`, `send_signal`). loopax's own test suite forks the processes from a
    pre-imported server this way (~1.4 s of imports saved each).
    """
    _starters.append(start)
    try:
        yield
    finally:
        _starters.remove(start)


class MultiprocessError(RuntimeError):
    """A process of a `multiprocess` run failed, hung or returned no value.

    Attributes:
      results: every process's `ProcessResult`, in process order.
    """

    def __init__(self, message: str, results: list[ProcessResult]):
        self.results = results
        logs = "\n".join(
            f"----- process {r.process_id} (exit {r.returncode}) -----\n{r.log}" for r in results
        )
        super().__init__(f"{message}\n{logs}")


@dataclasses.dataclass(frozen=True)
class ProcessResult:
    """How one process of a group ended.

    Attributes:
      process_id: its JAX process index.
      returncode: its exit status (negative: killed by that signal; None: still running
        when it was killed by the group's timeout, then reaped).
      value: what the function returned (JSON-decoded), or None if it did not return.
      log: its stdout and stderr together.
      timed_out: True if the group's timeout killed it.
    """

    process_id: int
    returncode: int | None
    value: Any
    log: str
    timed_out: bool = False


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no one listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _function_spec(fn: Callable[..., Any]) -> dict[str, str]:
    qualname = getattr(fn, "__qualname__", "")
    if "<locals>" in qualname or "<lambda>" in qualname or not qualname:
        raise ValueError(
            f"multiprocess needs a function defined at the top level of a module (each process "
            f"imports it again by name); got {fn!r}"
        )
    try:
        file = inspect.getsourcefile(fn) or inspect.getfile(fn)
    except TypeError:
        raise ValueError(f"multiprocess needs a Python function from a file, got {fn!r}") from None
    module = fn.__module__
    if module == "__main__":
        module = Path(file).stem
    return {"file": str(Path(file).resolve()), "module": module, "qualname": qualname}


class Processes:
    """A group of JAX processes started together, running one function each.

    Use it as a context manager: leaving the block kills every process still running
    (by pid) and removes the working files. `multiprocess` is the one-call form; this
    class is for tests that act on the processes while they run (e.g. signal one).

    Args:
      num_processes: how many processes (1 runs one plain process, without
        `jax.distributed`).
      devices_per_process: simulated CPU devices in each process.
      fn: a function defined at the top level of a module file; called in each process as
        `fn(*args)` after `jax.distributed.initialize`. Its return value must be JSON
        data.
      *args: JSON data passed to `fn` in every process (`jax.process_index()` tells the
        processes apart).
      env: extra environment variables for every process.
      heartbeat_timeout: seconds after which JAX's coordination service declares a silent
        process dead.

    Attributes:
      port: the coordinator's port.
      processes: the `subprocess.Popen` of each process, in process order.
    """

    def __init__(
        self,
        num_processes: int,
        devices_per_process: int,
        fn: Callable[..., Any],
        *args: Any,
        env: dict[str, str] | None = None,
        heartbeat_timeout: int = 10,
        timeout: float = 120.0,
    ):
        if num_processes < 1 or devices_per_process < 1:
            raise ValueError(
                f"num_processes and devices_per_process must be >= 1, got {num_processes} "
                f"and {devices_per_process}"
            )
        json.dumps(args)  # refuses what a child could not receive, here and now
        self.num_processes = num_processes
        self.port = free_port()
        self._dir = Path(tempfile.mkdtemp(prefix="loopax-multiprocess-"))
        base_env = dict(os.environ)
        base_env.update(env or {})
        flags = base_env.get("XLA_FLAGS", "")
        flags = " ".join(f for f in flags.split() if "force_host_platform_device_count" not in f)
        base_env["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={devices_per_process}".strip()
        )
        base_env["JAX_PLATFORMS"] = "cpu"
        target = _function_spec(fn)
        self.processes: list[subprocess.Popen] = []
        self._logs: list[Path] = []
        self._results: list[Path] = []
        for process_id in range(num_processes):
            spec = {
                **target,
                "path": str(Path(target["file"]).parent),
                "address": f"127.0.0.1:{self.port}",
                "num_processes": num_processes,
                "process_id": process_id,
                "timeout": timeout,
                "heartbeat": heartbeat_timeout,
                "args": list(args),
                "result": str(self._dir / f"result{process_id}.json"),
            }
            log = self._dir / f"log{process_id}.txt"
            self._logs.append(log)
            self._results.append(Path(spec["result"]))
            self.processes.append(_starters[-1](json.dumps(spec), log, base_env))

    @property
    def pids(self) -> list[int]:
        """Each process's pid, in process order."""
        return [p.pid for p in self.processes]

    def signal(self, process_id: int, sig: int = signal.SIGTERM) -> None:
        """Sends `sig` to one process (e.g. to test a preemption notice)."""
        self.processes[process_id].send_signal(sig)

    def log(self, process_id: int) -> str:
        """What the process has written to stdout and stderr so far."""
        return self._logs[process_id].read_text(errors="replace")

    def wait(self, timeout: float) -> list[ProcessResult]:
        """Waits up to `timeout` seconds for every process, then kills those still running.

        Returns:
          Every process's `ProcessResult`, in process order.
        """
        deadline = time.monotonic() + timeout
        timed_out = []
        for process in self.processes:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.01))
                timed_out.append(False)
            except subprocess.TimeoutExpired:
                timed_out.append(True)
        self.kill()
        results = []
        for process_id, process in enumerate(self.processes):
            path = self._results[process_id]
            value = json.loads(path.read_text()) if path.exists() else None
            results.append(
                ProcessResult(
                    process_id,
                    None if timed_out[process_id] else process.returncode,
                    value,
                    self.log(process_id),
                    timed_out[process_id],
                )
            )
        return results

    def kill(self) -> None:
        """Kills every process still running (SIGKILL by pid) and reaps it."""
        for process in self.processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.kill()
        for path in [*self._logs, *self._results]:
            path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self._dir.rmdir()


def multiprocess(
    num_processes: int,
    devices_per_process: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Runs `fn(*args)` in `num_processes` JAX processes on this machine; returns each value.

    Each process gets `devices_per_process` simulated CPU devices, joins the others with
    `jax.distributed.initialize` on a free loopback port (gloo CPU collectives), imports
    `fn`'s module file again and calls `fn(*args)`. Nothing is pickled: `fn` must be
    defined at the top level of a module, and `args` and its return value must be JSON
    data.

    Args:
      num_processes: how many processes.
      devices_per_process: simulated CPU devices in each.
      fn: the function each process runs.
      *args: its JSON arguments, the same in every process.
      timeout: seconds for the whole group; past it every process is killed by pid.
      env: extra environment variables for every process.

    Returns:
      Each process's return value, in process order.

    Raises:
      MultiprocessError: a process exited with an error, was killed, or hung past
        `timeout`; the message holds each process's log.
    """
    with Processes(
        num_processes, devices_per_process, fn, *args, env=env, timeout=timeout
    ) as group:
        results = group.wait(timeout)
    hung = [r.process_id for r in results if r.timed_out]
    if hung:
        raise MultiprocessError(
            f"process(es) {hung} of {num_processes} still ran after {timeout:g} s and were killed",
            results,
        )
    failed = [r.process_id for r in results if r.returncode != 0]
    if failed:
        raise MultiprocessError(
            f"process(es) {failed} of {num_processes} exited with an error", results
        )
    return [r.value for r in results]


__all__: Sequence[str] = [
    "MultiprocessError",
    "ProcessResult",
    "Processes",
    "free_port",
    "multiprocess",
]
