"""The stop agreement's rules, against an in-memory key-value store shaped as JAX's client:
the first proposal wins, a run's end closes it, and each run has its own key."""

import threading
import time
import types

import pytest

from loopax.loop import _stop_agreement
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
    first, second, third = (StopAgreement(client, p, 19, "run/0", 3) for p in range(3))
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
        # The proposal, and each watcher's word that it saw it (the proposer waited for them).
        assert sorted(client.values) == ["run/0", "run/0/seen/0", "run/0/seen/1", "run/0/seen/2"]
    finally:
        for agreement in (first, second, third):
            agreement.close()


def test_a_run_that_ended_closes_the_agreement_and_a_late_wish_is_dropped(client):
    ended, late = (StopAgreement(client, process, 19, "run/0", 2) for process in range(2))
    ended.close()
    late.want("interrupted by SIGINT", 2)  # False once its watcher saw the end: nothing to ask
    assert late.poll(40) is None  # the other process ended its run: all end at its end
    assert late.agreed is None
    late.close()
    assert sorted(client.values) == ["run/0"]  # no stop was agreed: nothing to see


def test_one_process_has_no_agreement():
    one = types.SimpleNamespace(devices=[types.SimpleNamespace(process_index=0)] * 2)
    assert StopAgreement.for_run(one, 19) is None  # the single-process path: nothing at all


class GoneClient(FakeClient):
    """A client whose service is gone: every wait fails at once, as JAX's does."""

    def blocking_key_value_get(self, key, timeout_ms):
        raise RuntimeError("UNAVAILABLE: failed to connect to the coordination service")


def test_a_watcher_that_lost_the_service_is_reported_at_the_next_poll():
    agreement = StopAgreement(GoneClient(), 1, 19, "run/0", 2)
    agreement._thread.join(5)
    assert not agreement._thread.is_alive()
    with pytest.raises(RuntimeError, match="process 1 lost JAX's coordination service") as info:
        agreement.poll(3)
    assert "UNAVAILABLE" in str(info.value.__cause__)


class LateWatcher:
    """One process's view of `FakeClient` whose watcher hears of the run's key only once
    `wake` is set: its thread left unscheduled on a loaded machine."""

    def __init__(self, client, key):
        self._client = client
        self._key = key
        self.wake = threading.Event()

    def key_value_set(self, key, value):
        self._client.key_value_set(key, value)

    def blocking_key_value_get(self, key, timeout_ms):
        value = self._client.blocking_key_value_get(key, timeout_ms)
        if key == self._key:
            assert self.wake.wait(30), "the test never woke the late watcher"
        return value


def test_the_proposer_goes_on_only_once_every_watcher_has_seen_its_stop(client):
    # The margin counts steps: a watcher that hears of the stop late (its process ran on
    # meanwhile) would find it behind its steps. The proposer waits for it instead.
    late = LateWatcher(client, "run/0")
    waiting, proposer = (
        StopAgreement(late, 0, 19, "run/0", 2),
        StopAgreement(client, 1, 19, "run/0", 2),
    )
    try:
        assert proposer.want("enough", None)
        proposed = []
        thread = threading.Thread(target=lambda: proposed.append(proposer.poll(7)))
        thread.start()
        thread.join(0.5)
        assert thread.is_alive() and not proposed  # proposed, and waiting for process 0
        assert waiting.poll(8) is None  # process 0 has not heard of it yet
        late.wake.set()
        thread.join(30)
        assert proposed == [AgreedStop(26, "enough", None, 1)]
        assert waiting.poll(9) == proposed[0]  # seen before the proposer went on
    finally:
        late.wake.set()
        waiting.close()
        proposer.close()


def test_a_proposer_warns_each_minute_it_waits_for_a_watcher(client, monkeypatch, caplog):
    monkeypatch.setattr(_stop_agreement, "_SEEN_WAIT_MS", 50)
    late = LateWatcher(client, "run/0")
    waiting, proposer = (
        StopAgreement(late, 0, 19, "run/0", 2),
        StopAgreement(client, 1, 19, "run/0", 2),
    )
    try:
        proposer.want("enough", None)
        thread = threading.Thread(target=proposer.poll, args=(7,))
        thread.start()
        deadline = time.monotonic() + 30
        while len(caplog.records) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        late.wake.set()
        thread.join(30)
        assert not thread.is_alive()
    finally:
        late.wake.set()
        waiting.close()
        proposer.close()
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) >= 2, messages
    assert messages[0].startswith("process 1 waits for process 0 to see its stop after step 26")


class BrokenWaitClient(FakeClient):
    """A client whose service fails while the proposer waits for the others' watchers."""

    def blocking_key_value_get(self, key, timeout_ms):
        if "/seen/" in key:
            raise RuntimeError("UNAVAILABLE: failed to connect to the coordination service")
        return super().blocking_key_value_get(key, timeout_ms)


def test_a_service_lost_while_the_proposer_waits_is_an_error_naming_the_process():
    client = BrokenWaitClient()
    waiting, proposer = (StopAgreement(client, p, 19, "run/0", 2) for p in range(2))
    try:
        proposer.want("enough", None)
        with pytest.raises(RuntimeError, match="waiting for process 0 to see it failed") as info:
            proposer.poll(7)
        assert "UNAVAILABLE" in str(info.value.__cause__)
    finally:
        waiting.close()
        proposer.close()
