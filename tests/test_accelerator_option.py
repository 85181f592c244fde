"""`pytest --accelerator` (tests/conftest.py): the suite's tests that need no simulated CPU devices.

Each check runs pytest in a fresh process (the option is read before JAX loads), on a few of
the suite's own files: `--accelerator` sets up no simulated devices and deselects the tests
over several devices or with CPU worker processes, `-m "not cpu_devices"` selects the same
tests with the 4 devices kept, and an option given too late is refused.
"""

import functools
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[1]
# The checks start pytest on the CPU from the suite's own setup (4 simulated devices).
CHECKS = pytest.mark.cpu_devices
# Parametrized over 1 and 4 devices; a module of zygote children; this file.
FILES = ["tests/trainer/test_creation.py", "tests/test_zygote.py", __file__]


def pytest_in_a_fresh_process(*arguments: str) -> subprocess.CompletedProcess:
    env = {
        name: value
        for name, value in os.environ.items()
        if name != "LOOPAX_TESTS_ACCELERATOR" and not name.startswith("PYTEST_XDIST")
    }
    env["JAX_PLATFORMS"] = "cpu"
    command = [sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", *arguments]
    return subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
    )


@functools.cache  # one fresh collection per set of arguments for the whole module
def collected(*arguments: str) -> tuple[list[str], str]:
    done = pytest_in_a_fresh_process("--collect-only", *arguments, *FILES)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    return ids, done.stdout


def test_this_process_has_the_devices_its_mode_asks_for():
    # Run by the suite (4 simulated CPU devices) and by the check below with --accelerator.
    if jax.default_backend() != "cpu":
        pytest.skip("simulated devices are CPU devices")
    accelerator = os.environ.get("LOOPAX_TESTS_ACCELERATOR") == "1"
    assert jax.device_count() == (1 if accelerator else 4), jax.devices()


@CHECKS
def test_accelerator_sets_up_no_cpu_devices_even_if_inherited():
    # The environment of this run asks for 4 simulated devices (tests/conftest.py).
    assert "--xla_force_host_platform_device_count=4" in os.environ.get("XLA_FLAGS", "")
    test = f"{__file__}::test_this_process_has_the_devices_its_mode_asks_for"
    done = pytest_in_a_fresh_process("--accelerator", test)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "1 passed" in done.stdout


@CHECKS
def test_accelerator_deselects_the_tests_that_need_cpu_devices():
    everything, _ = collected()
    kept, report = collected("--accelerator")
    assert "deselected" in report
    dropped = set(everything) - set(kept)
    assert set(kept) < set(everything)
    # Over 4 devices (a `devices` parameter), and every zygote test, are dropped ...
    assert any(test.endswith("[4]") for test in dropped)
    assert not any(test.endswith("[4]") or "test_zygote.py" in test for test in kept)
    assert any("test_zygote.py" in test for test in dropped)
    # ... the same tests on one device are kept.
    assert any(test.endswith("[1]") and "test_creation.py" in test for test in kept)
    assert any(
        test.endswith("test_this_process_has_the_devices_its_mode_asks_for") for test in kept
    )


@CHECKS
def test_the_marker_selects_the_same_tests_with_the_devices_kept():
    kept, _ = collected("--accelerator")
    marked, _ = collected("-m", "not cpu_devices")
    assert marked == kept


@CHECKS
def test_the_option_is_refused_where_it_comes_too_late():
    code = (
        "import sys, pytest; "
        "sys.exit(pytest.main(['--accelerator', '--collect-only', '-n', '0', "
        f"'-p', 'no:cacheprovider', {str(FILES[0])!r}]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "LOOPAX_TESTS_ACCELERATOR"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode != 0
    assert "--accelerator must be on the command line" in done.stdout + done.stderr
