"""loopax.testing.multiprocess: real processes joined by jax.distributed, logs on failure."""

import os
import signal
import time

import pytest

from loopax.testing import MultiprocessError, Processes, multiprocess


def describe(tag):
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    total = multihost_utils.process_allgather(jnp.asarray(jax.process_index() + 1))
    return {
        "tag": tag,
        "process": jax.process_index(),
        "count": jax.process_count(),
        "local": jax.local_device_count(),
        "global": jax.device_count(),
        "sum": int(total.sum()),
    }


def fail_on_one():
    import jax

    print("before the failure")
    if jax.process_index() == 1:
        raise ValueError("process one fails on purpose")
    return "ok"


def sleep_forever():
    print("sleeping", flush=True)
    time.sleep(600)


def test_two_processes_join_and_return_values():
    values = multiprocess(2, 2, describe, "x", timeout=60)
    assert values == [
        {"tag": "x", "process": i, "count": 2, "local": 2, "global": 4, "sum": 3} for i in (0, 1)
    ]


def test_a_failing_process_raises_with_every_log():
    with pytest.raises(MultiprocessError, match=r"process\(es\) \[1\] of 2 exited") as caught:
        multiprocess(2, 1, fail_on_one, timeout=60)
    message = str(caught.value)
    assert "process one fails on purpose" in message
    assert "----- process 0" in message and "----- process 1" in message


def test_a_hang_is_killed_by_pid_and_reported():
    start = time.monotonic()
    with pytest.raises(MultiprocessError, match=r"still ran after 3 s and were killed") as caught:
        multiprocess(1, 1, sleep_forever, timeout=3)
    assert time.monotonic() - start < 30
    assert "sleeping" in str(caught.value)
    assert caught.value.results[0].timed_out


def test_a_process_can_be_signalled_and_none_is_left_behind():
    with Processes(1, 1, sleep_forever, timeout=30) as group:
        deadline = time.monotonic() + 30
        while "sleeping" not in group.log(0) and time.monotonic() < deadline:
            time.sleep(0.1)
        group.signal(0, signal.SIGTERM)
        (result,) = group.wait(20)
        pid = group.pids[0]
    assert result.returncode == -signal.SIGTERM
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_function_that_cannot_be_found_again_is_refused():
    with pytest.raises(ValueError, match="top level of a module"):
        multiprocess(1, 1, lambda: None)
    with pytest.raises(TypeError):
        multiprocess(1, 1, describe, object())
