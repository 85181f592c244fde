"""Test-session setup shared by every test package.

Simulated CPU devices must be configured before jax is first imported, so this runs
at the top of the test tree: multi-device tests get 4 devices, and single-device tests
pass `devices=jax.devices()[:1]`.
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

# One JAX compilation cache for the whole run: the controller makes it before the xdist
# workers start, and they and every subprocess a test starts inherit it, so a program
# compiled once (the same model in many tests and processes) loads from disk after. It
# cut the hooks and loop tests from 2m44s to 1m45s on 2 cores. Fresh per run: nothing
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
    from loopax.testing import _multiprocess  # noqa: PLC0415

    bootstrap = tmp_path_factory.mktemp("forked-processes") / "bootstrap.py"
    bootstrap.write_text(_multiprocess._BOOTSTRAP)

    def start(spec, log, env):
        return zygote_server.start(
            [str(bootstrap), spec], out=log, err=log, env=env, new_session=True
        )

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_multiprocess, "_start_process", start)
        yield
