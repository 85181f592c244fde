"""The forked workers of the kill matrices and multi-process tests (`zygote.py`, its server
`_zygote_server.py`) run a script as `python script args` does: as `__main__` with its
arguments, a JAX of their own (configured by the environment), and the interpreter's own exit:
non-daemon threads joined, then `atexit`, the exit status as subprocess reports it (a SIGKILL
is -9, an uncaught exception 1, Ctrl-C -2), and a run past its timeout killed. A server that
could not fork safely refuses to start.
"""

import os
import subprocess
import textwrap

import pytest
from zygote import Zygote

from loopax.testing import multiprocess

pytestmark = pytest.mark.cpu_devices  # children with simulated CPU device counts

SCRIPT = textwrap.dedent(
    """
    import atexit, os, signal, sys, threading, time
    import jax

    atexit.register(lambda: print("atexit", flush=True))
    print(__name__, sys.argv[1:], len(jax.devices()), os.getcwd() == sys.argv[2], flush=True)
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread", flush=True))).start()
    mode = sys.argv[1]
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "exit":
        sys.exit(3)
    elif mode == "raise":
        raise ValueError("the worker failed")
    elif mode == "interrupt":
        raise KeyboardInterrupt
    elif mode == "hang":
        time.sleep(600)
    """
)


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=3")
    with Zygote(env) as started:
        yield started


@pytest.mark.parametrize(
    ("mode", "returncode", "exits"),
    [
        ("ok", 0, True),
        ("exit", 3, True),
        ("raise", 1, True),
        ("interrupt", -2, True),
        ("kill", -9, False),
    ],  # fmt: skip
)
def test_a_child_runs_the_script_as_python_would_and_exits_as_python_does(
    zygote, tmp_path, mode, returncode, exits
):
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    done = zygote.run([script, mode, str(tmp_path)], cwd=str(tmp_path), timeout=60)
    assert done.returncode == returncode, done.stderr
    first = done.stdout.splitlines()[0]
    assert first == f"__main__ ['{mode}', '{tmp_path}'] 3 True"
    # The non-daemon thread ends before the atexit functions run, as at Python's exit.
    assert done.stdout.splitlines()[1:] == (["thread", "atexit"] if exits else [])
    if mode == "raise":  # the traceback from the script's frame on, as Python prints it
        assert done.stderr.startswith(f'Traceback (most recent call last):\n  File "{script}"')
        assert done.stderr.strip().endswith("ValueError: the worker failed")


def test_a_child_past_its_timeout_is_killed(zygote, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.run([script, "hang", str(tmp_path)], cwd=str(tmp_path), timeout=3)


ENVIRONMENT_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import jax

    print(os.environ.get("ZYGOTE_MARK"), len(jax.devices()), os.getsid(0) == os.getpid())
    print("to stderr", file=sys.stderr)
    """
)


def test_a_child_gets_the_environment_and_session_asked_for_and_one_log(zygote, tmp_path):
    script = tmp_path / "environment.py"
    script.write_text(ENVIRONMENT_SCRIPT)
    env = dict(os.environ, ZYGOTE_MARK="marked",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")  # fmt: skip
    log = tmp_path / "log.txt"
    child = zygote.start([script], out=log, err=log, env=env, new_session=True)
    assert log.exists()  # at once, as a Popen's parent opens its files
    assert child.wait(timeout=60) == 0, log.read_text()
    # XLA reads the device count when the child's backend starts: 2 here, 3 in the zygote.
    assert log.read_text().splitlines() == ["marked 2 True", "to stderr"]
    assert child.poll() == 0 and child.returncode == 0


def test_a_child_refuses_a_jax_variable_that_jax_read_in_the_zygote(zygote, tmp_path):
    script = tmp_path / "environment.py"
    script.write_text(ENVIRONMENT_SCRIPT)
    env = dict(os.environ, JAX_ENABLE_X64="1")
    done = zygote.run([script], timeout=60, env=env)
    assert done.returncode == 1
    assert "JAX read ['JAX_ENABLE_X64'] at import" in done.stderr
    assert done.stdout == ""
    # The zygote still serves (the refusing child exited; it did not go on as a zygote).
    env = dict(
        os.environ, ZYGOTE_MARK="again", XLA_FLAGS="--xla_force_host_platform_device_count=1"
    )
    again = zygote.run([script], timeout=60, env=env)
    assert again.stdout.splitlines() == ["again 1 False"], again.stderr


UNSAFE_PRELOADS = {
    "a thread": "import threading, time\n"
    "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n",
    "a JAX backend": "import jax\njax.devices()\n",
}


@pytest.mark.parametrize("started", sorted(UNSAFE_PRELOADS))
def test_a_server_whose_preload_started_a_thread_or_a_backend_refuses_to_fork(started, tmp_path):
    # A forked child would hold only the forking thread, or share the parent's devices.
    (tmp_path / "unsafe_preload.py").write_text(UNSAFE_PRELOADS[started])
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    with pytest.raises(RuntimeError, match="the zygote did not start") as refused:
        Zygote(env, preload=("jax", "unsafe_preload"))
    assert "zygote: cannot fork safely" in str(refused.value)


def parent_pid():
    return os.getppid()


@pytest.mark.usefixtures("forked_processes")
def test_forked_processes_makes_multiprocess_fork_from_the_server(zygote_server):
    assert multiprocess(2, 1, parent_pid, timeout=120) == [zygote_server.pid] * 2
