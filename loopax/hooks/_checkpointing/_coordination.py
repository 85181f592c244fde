"""Agreement between the processes of a run, through JAX's coordination service.

Barriers and small JSON exchanges go through the coordination service that
`jax.distributed.initialize` started (its key-value store and its barriers), never through
a device collective: they may run on any thread, beside the training thread's steps, and
every wait has a timeout. A process that stops answering makes the others raise a
`CoordinationError` naming it, the step of the exchange and the timeout, instead of hanging.

With one process every exchange is local and immediate.
"""

from __future__ import annotations

import json
from typing import Any

import jax

from ..._distributed import coordination_client

DEFAULT_TIMEOUT_SECONDS = 300.0


class CoordinationError(RuntimeError):
    """Another process did not reach a barrier or send its part of an exchange in time."""


def _client() -> Any:
    client = coordination_client()
    if client is None:
        raise RuntimeError(
            f"this is process {jax.process_index()} of {jax.process_count()}, but "
            "jax.distributed.initialize() was not called, so the processes cannot agree; "
            "call it first in every process"
        )
    return client


class Coordination:
    """Barriers and exchanges of JSON values between every process, each with a timeout.

    Every process must make the same calls in the same order with the same `key`s (keys
    name one exchange for good: each is used once per `Coordination` namespace).

    Args:
      namespace: prefixes every key (e.g. the checkpoint directory), so that two users of
        the service never meet.
      timeout_seconds: how long a process waits for the others at each exchange.

    Attributes:
      process_index: this process's index; `process_count`: how many processes.
    """

    def __init__(self, namespace: str, timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS):
        if not timeout_seconds > 0:
            raise ValueError(f"barrier_timeout must be > 0 seconds, got {timeout_seconds!r}")
        self.namespace = namespace
        self.timeout_seconds = float(timeout_seconds)
        self.process_index = jax.process_index()
        self.process_count = jax.process_count()

    @property
    def single(self) -> bool:
        """Whether this run has one process (every exchange is local)."""
        return self.process_count == 1

    def _key(self, key: str, *parts: object) -> str:
        return "/".join([f"loopax/{self.namespace}", key, *map(str, parts)])

    def _timeout_ms(self) -> int:
        return max(1, int(self.timeout_seconds * 1000))

    def _missing(self, key: str) -> list[int]:
        """The processes that have not set their `arrived` mark of exchange `key`."""
        client = _client()
        missing = []
        for process in range(self.process_count):
            try:
                value = client.key_value_try_get(self._key(key, "arrived", process))
            except Exception:  # noqa: BLE001 - not found: it never arrived
                value = None
            if value is None:
                missing.append(process)
        return missing

    def _error(self, key: str, what: str, err: BaseException) -> CoordinationError:
        try:
            missing = self._missing(key)
        except Exception:  # noqa: BLE001 - the service itself is gone
            missing = []
        who = (
            f"process(es) {missing} of {self.process_count} did not arrive"
            if missing
            else f"not every process of {self.process_count} answered"
        )
        return CoordinationError(
            f"{what}: {who} within {self.timeout_seconds:g} s (process {self.process_index} "
            f"waited at {key!r}); a process stopped, crashed or hangs. Look at that process's "
            f"log; the timeout is barrier_timeout ({type(err).__name__}: {err})"
        )

    def _arrive(self, key: str) -> None:
        _client().key_value_set(self._key(key, "arrived", self.process_index), "1")

    def barrier(self, key: str, what: str) -> None:
        """Waits until every process reached barrier `key`.

        Raises:
          CoordinationError: a process did not arrive within the timeout (named).
        """
        if self.single:
            return
        self._arrive(key)
        try:
            _client().wait_at_barrier(self._key(key, "barrier"), self._timeout_ms())
        except Exception as err:
            raise self._error(key, what, err) from err

    def _get(self, key: str, process: int, what: str) -> Any:
        try:
            text = _client().blocking_key_value_get(self._key(key, process), self._timeout_ms())
        except Exception as err:
            raise self._error(key, what, err) from err
        return json.loads(text)

    def all_gather(self, key: str, value: Any, what: str) -> list[Any]:
        """Every process's `value` (JSON), in process order, on every process.

        Raises:
          CoordinationError: a process did not send its value within the timeout (named).
        """
        if self.single:
            return [value]
        client = _client()
        self._arrive(key)
        client.key_value_set(self._key(key, self.process_index), json.dumps(value))
        return [
            value if process == self.process_index else self._get(key, process, what)
            for process in range(self.process_count)
        ]

    def gather(self, key: str, value: Any, what: str) -> list[Any] | None:
        """Every process's `value` (JSON) in process order on process 0; None elsewhere.

        Raises:
          CoordinationError: on process 0, a process did not send its value in time.
        """
        if self.single:
            return [value]
        client = _client()
        self._arrive(key)
        client.key_value_set(self._key(key, self.process_index), json.dumps(value))
        if self.process_index != 0:
            return None
        return [
            value if process == 0 else self._get(key, process, what)
            for process in range(self.process_count)
        ]

    def forget(self, key: str) -> None:
        """Deletes this process's value and mark of exchange `key` from the service.

        Call it once every process has read them (e.g. after a later barrier), so that a
        long run does not pile up old exchanges in the coordination service's memory.
        """
        if self.single:
            return
        client = _client()
        for name in (
            self._key(key, self.process_index),
            self._key(key, "arrived", self.process_index),
        ):
            client.key_value_delete(name)

    def broadcast(self, key: str, value: Any, what: str) -> Any:
        """Process 0's `value` (JSON) on every process (the others' `value` is ignored).

        Raises:
          CoordinationError: process 0 did not send it within the timeout.
        """
        if self.single:
            return value
        self._arrive(key)
        if self.process_index == 0:
            _client().key_value_set(self._key(key, 0), json.dumps(value))
            return value
        return self._get(key, 0, what)
