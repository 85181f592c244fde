"""The bound on dispatched steps: how many may be pending, and when the host waits."""

from __future__ import annotations

import jax
import pytest

from loopax.trainer._inflight import (
    DEFAULT_LIMIT,
    MULTI_CPU_DEVICE_LIMIT,
    SINGLE_DEVICE_LIMIT,
    InFlight,
    limit_for,
)


class FakeOutput:
    """A step's output that records when the host waited for it."""

    def __init__(self, index: int, waits: list[int]):
        self.index = index
        self.waits = waits

    def block_until_ready(self) -> FakeOutput:
        self.waits.append(self.index)
        return self


def push_all(in_flight: InFlight, count: int) -> tuple[list[int], list[int]]:
    """Pushes `count` outputs; returns the waited indices and the pending count after each."""
    waits: list[int] = []
    pending_after: list[int] = []
    for index in range(count):
        in_flight.push(FakeOutput(index, waits))
        pending_after.append(len(in_flight))
    return waits, pending_after


def test_pending_steps_never_exceed_the_limit():
    _, pending_after = push_all(InFlight(8), 100)
    assert max(pending_after) == 8


def test_waits_in_batches_for_the_step_half_a_limit_back():
    waits, pending_after = push_all(InFlight(8), 100)
    # The 9th push goes past the limit: the host waits for step 4 (steps finish in order, so
    # that covers 0..4) and keeps the newest 4; the next wait comes 5 pushes later.
    assert waits[:3] == [4, 9, 14]
    assert waits == list(range(4, 96, 5))
    assert pending_after[8] == 4


def test_wait_all_waits_only_for_the_newest_step():
    in_flight = InFlight(8)
    waits, _ = push_all(in_flight, 6)
    assert waits == []
    in_flight.wait_all()
    assert waits == [5]
    in_flight.wait_all()  # nothing pending: no second wait
    assert waits == [5]


def test_limit_below_two_is_rejected():
    with pytest.raises(ValueError, match="in-flight limit must be >= 2, got 1"):
        InFlight(1)


class FakeDevice:
    """A device of another platform (an accelerator), as `limit_for` reads it."""

    def __init__(self, platform: str, process_index: int = 0):
        self.platform = platform
        self.process_index = process_index


def test_one_device_queues_more_steps_than_several():
    gpus = [FakeDevice("gpu") for _ in range(4)]
    assert limit_for(gpus[:1]) == SINGLE_DEVICE_LIMIT > limit_for(gpus) == DEFAULT_LIMIT
    assert limit_for(jax.devices()[:1]) == SINGLE_DEVICE_LIMIT
    waits, pending_after = push_all(InFlight(limit_for(gpus[:1])), 100)
    assert max(pending_after) == SINGLE_DEVICE_LIMIT
    assert len(waits) == (100 - SINGLE_DEVICE_LIMIT - 1) // (SINGLE_DEVICE_LIMIT // 2 + 1) + 1


@pytest.mark.cpu_devices
def test_several_cpu_devices_of_a_process_queue_fewer_steps():
    # XLA's CPU client deadlocks a collective once a device holds 32 unfinished
    # computations and its thread pool has no more threads than devices (see `limit_for`):
    # the queue's steps, the one waited on included, times 6 programs a step stay below.
    cpus = jax.devices()[:4]
    assert limit_for(cpus) == limit_for(cpus[:2]) == MULTI_CPU_DEVICE_LIMIT < DEFAULT_LIMIT
    assert (MULTI_CPU_DEVICE_LIMIT + 1) * 6 < 32
    # Other processes' CPU devices share no thread pool with these: one local device each.
    spread = [FakeDevice("cpu", process) for process in range(4)]
    assert limit_for(spread) == DEFAULT_LIMIT


class ReadyOutput(FakeOutput):
    """An output the device finished already (as `jax.Array.is_ready` tells)."""

    def is_ready(self) -> bool:
        return True


def test_finished_names_the_newest_step_already_done_after_a_wait():
    in_flight, waits = InFlight(8), []
    assert in_flight.finished is None
    for index in range(9):  # the 9th goes past the limit: the host waits for step 4
        output = (ReadyOutput if index < 6 else FakeOutput)(index, waits)
        in_flight.push(output, token=index)
    assert waits == [4]
    assert in_flight.finished == 5  # 5 was done too (6..8 not yet), found without a wait
    in_flight.wait_all()
    assert in_flight.finished == 8
