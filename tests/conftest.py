"""Test-session setup shared by every test package.

Simulated CPU devices must be configured before jax is first imported, so this runs
at the top of the test tree: multi-device tests get 4 devices, and single-device tests
pass `devices=jax.devices()[:1]`.

`--accelerator` (or `LOOPAX_TESTS_ACCELERATOR=1`) runs the suite on JAX's default backend as
it is, one GPU say: no simulated CPU devices are set up, and the tests that need them are
deselected (marked `cpu_devices`, see `pytest_collection_modifyitems`). On a machine without
an accelerator it runs the same selection on one CPU device.
"""

import atexit
import os
import shutil
import sys
import tempfile

ACCELERATOR_VARIABLE = "LOOPAX_TESTS_ACCELERATOR"
# Read before jax loads: the option itself is parsed too late to keep the devices off. The
# variable carries the choice to xdist workers and to the processes the tests start.
ACCELERATOR = "--accelerator" in sys.argv[1:] or os.environ.get(ACCELERATOR_VARIABLE) == "1"
if ACCELERATOR:
    os.environ[ACCELERATOR_VARIABLE] = "1"
    # Simulated devices asked for elsewhere (an inherited XLA_FLAGS) are dropped too.
    os.environ["XLA_FLAGS"] = " ".join(
        flag
        for flag in os.environ.get("XLA_FLAGS", "").split()
        if not flag.startswith("--xla_force_host_platform_device_count")
    )
    # Several test processes share one GPU: none takes most of its memory up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
else:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    # XLA's CPU backend hands its code to LLVM at -O0 unless told otherwise: over half the
    # suite's CPU is compiling, and the tests check what a step computes (compared within
    # one run, never against this machine's figures), not how fast LLVM made it. Inherited by
    # the workers and every process a test starts, so they compute alike.
    # LOOPAX_TESTS_XLA_OPT=default keeps XLA's own level (CI leaves it unset).
    if os.environ.get("LOOPAX_TESTS_XLA_OPT") != "default" and (
        "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]
    ):
        os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

# One JAX compilation cache for the whole run: the controller makes it before the xdist
# workers start, and they and every subprocess a test starts inherit it, so a program
# compiled once (the same model in many tests and processes) loads from disk after (what it
# saves: docs/benchmarks.md, "Why the code is the way it is"). Fresh per run: nothing
# carries over between runs. Tests that need their own cache set the variable themselves.
if "PYTEST_XDIST_WORKER" not in os.environ and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="loopax-tests-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# A subprocess that reads an entry another process is writing warns and compiles the
# program itself (pyproject's filterwarnings says why): tests that compare a subprocess's
# stderr line by line must not see that warning.
os.environ.setdefault(
    "PYTHONWARNINGS", "ignore:Error reading persistent compilation cache entry:UserWarning"
)

import pytest  # noqa: E402  (after the environment above: pytest's plugins may import JAX)


@pytest.fixture(scope="session")
def zygote_server():
    """One fork server for this pytest process (`zygote.py`), started on first use."""
    from zygote import Zygote  # noqa: PLC0415

    with Zygote(dict(os.environ)) as server:
        yield server


@pytest.fixture(scope="module")
def forked_processes(zygote_server, tmp_path_factory):
    """`loopax.testing.multiprocess` and `Processes` start their processes as children forked
    from `zygote_server` instead of fresh interpreters (~1.4 s of imports each): the same
    bootstrap, environment (the simulated device count included), session and log file.
    `tests/testing/` keeps testing the fresh-interpreter launch itself."""
    from loopax.testing._internal import BOOTSTRAP, starting_processes_with  # noqa: PLC0415

    bootstrap = tmp_path_factory.mktemp("forked-processes") / "bootstrap.py"
    bootstrap.write_text(BOOTSTRAP)

    def start(spec, log, env):
        return zygote_server.start(
            [str(bootstrap), spec], out=log, err=log, env=env, new_session=True
        )

    with starting_processes_with(start):
        yield


# -- --accelerator: the tests that need no simulated CPU devices ----------------------------

# Fixtures whose tests start CPU worker processes (multi-process runs on simulated devices).
CPU_WORKER_FIXTURES = ("forked_processes", "zygote_server")
# Parameters that name how many devices a test trains on.
DEVICE_COUNT_PARAMETERS = ("devices", "num_devices")


def pytest_addoption(parser):
    parser.addoption(
        "--accelerator",
        action="store_true",
        help="run on JAX's default backend without simulated CPU devices (e.g. on one GPU), "
        "deselecting the tests marked cpu_devices (several devices, CPU worker processes)",
    )


def pytest_configure(config):
    if config.getoption("accelerator") and not ACCELERATOR:
        raise pytest.UsageError(
            "--accelerator must be on the command line that starts pytest (it is read before "
            f"JAX loads), or set {ACCELERATOR_VARIABLE}=1; pytest.main(['--accelerator']) "
            "comes too late"
        )


def needs_cpu_devices(item) -> bool:
    """Whether a test needs simulated CPU devices: marked so, multi-process, or over >1 device."""
    if item.get_closest_marker("cpu_devices") is not None:
        return True
    if any(name in CPU_WORKER_FIXTURES for name in getattr(item, "fixturenames", ())):
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    return any(
        isinstance(params.get(name), int) and params[name] > 1 for name in DEVICE_COUNT_PARAMETERS
    )


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by the markers added here
def pytest_collection_modifyitems(config, items):
    for item in items:
        if needs_cpu_devices(item) and item.get_closest_marker("cpu_devices") is None:
            item.add_marker(pytest.mark.cpu_devices)
    if not ACCELERATOR:
        return
    kept = [item for item in items if item.get_closest_marker("cpu_devices") is None]
    if len(kept) < len(items):
        kept_ids = {id(item) for item in kept}
        config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept_ids])
        items[:] = kept
