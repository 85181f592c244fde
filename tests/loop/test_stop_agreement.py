"""The stop agreement's rules, against an in-memory key-value store shaped as JAX's client:
the first proposal wins, a run's end closes it, and each run has its own key."""

import threading
import types

import pytest

from loopax.loop._stop_agreement import AgreedStop, StopAgreement


class FakeClient:
    """JAX's coordination-service client, as far as the agreement uses it, in memory."""

    def __init__(self):
        self.values = {}
        self._changed = threading.Condition()

    def key_value_set(self, key, value):
        with self._changed:
            if key in self.values:
                raise RuntimeError(f"ALREADY_EXISTS: key {key} already exists.")
            self.values[key] = value
            self._changed.notify_all()

    def blocking_key_value_get(self, key, timeout_ms):
        with self._changed:
            if not self._changed.wait_for(lambda: key in self.values, timeout_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
            return self.values[key]


@pytest.fixture
def client():
    return FakeClient()


def test_the_first_proposal_wins_and_every_process_reads_it(client):
    first, second, third = (StopAgreement(client, process, 19, "run/0") for process in range(3))
    try:
        assert first.poll(5) is None  # nothing asked: nothing agreed, no key written
        assert not client.values
        assert second.want("interrupted by SIGTERM", 15)
        assert third.want("enough", None)
        agreed = second.poll(7)
        assert agreed == AgreedStop(26, "interrupted by SIGTERM", 15, 1)
        assert third.poll(9) == agreed  # its own wish lost: the written proposal is the stop
        assert not third.want("again", None)  # already agreed: nothing more to propose
        for agreement in (first, second, third):
            agreement.close()
        assert first.agreed == agreed  # the watcher saw it
        assert list(client.values) == ["run/0"]
    finally:
        for agreement in (first, second, third):
            agreement.close()


def test_a_run_that_ended_closes_the_agreement_and_a_late_wish_is_dropped(client):
    ended, late = (StopAgreement(client, process, 19, "run/0") for process in range(2))
    ended.close()
    late.want("interrupted by SIGINT", 2)  # False once its watcher saw the end: nothing to ask
    assert late.poll(40) is None  # the other process ended its run: all end at its end
    assert late.agreed is None
    late.close()


def test_one_process_has_no_agreement():
    one = types.SimpleNamespace(devices=[types.SimpleNamespace(process_index=0)] * 2)
    assert StopAgreement.for_run(one, 19) is None  # the single-process path: nothing at all


class GoneClient(FakeClient):
    """A client whose service is gone: every wait fails at once, as JAX's does."""

    def blocking_key_value_get(self, key, timeout_ms):
        raise RuntimeError("UNAVAILABLE: failed to connect to the coordination service")


def test_a_watcher_that_lost_the_service_is_reported_at_the_next_poll():
    agreement = StopAgreement(GoneClient(), 1, 19, "run/0")
    agreement._thread.join(5)
    assert not agreement._thread.is_alive()
    with pytest.raises(RuntimeError, match="process 1 lost JAX's coordination service") as info:
        agreement.poll(3)
    assert "UNAVAILABLE" in str(info.value.__cause__)
