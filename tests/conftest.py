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
