"""One stop for every process: a stop asked on one process, agreed by all on one step.

The agreement goes through JAX's coordination service, so that every process ends its run
after the same step.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import threading
from typing import Any

from .._distributed import coordination_client
from ..trainer import Trainer

# The coordinated runs of this process, counted in the order they start: every process of a
# job runs the same runs in the same order (their steps are collectives), so the n-th run has
# the same key everywhere. A resumed job starts a new coordination service, and a new count.
_RUNS = itertools.count()
_KEY = "loopax/stop/{run}"
# Where each process's watcher writes that it has seen the stop: the proposer waits for them.
_SEEN = "{key}/seen/{process}"
# The proposer waits for the others' watchers in slices of this, warning after each one.
_SEEN_WAIT_MS = 60_000
# The watcher waits for the key until the run ends (the run's end writes it); far past any run.
_WATCH_MS = 2**31 - 1
_JOIN_SECONDS = 10.0

_logger = logging.getLogger("loopax")


@dataclasses.dataclass(frozen=True)
class AgreedStop:
    """The stop every process of a run agreed on.

    Attributes:
      step: the last loop step every process runs.
      reason: the stop reason, as the proposing process gave it.
      signum: the signal that asked for it, or None (a `request_stop`).
      process: the index of the process that proposed it.
    """

    step: int
    reason: str
    signum: int | None
    process: int

    @property
    def shown_reason(self) -> str:
        """The reason as every process reports it: a signal's names the process it came to."""
        if self.signum is None:
            return self.reason
        return f"{self.reason} (on process {self.process})"


@dataclasses.dataclass(frozen=True)
class RunEnded:
    """A process ended its run (at its end, or with an error) before any stop was agreed."""

    process: int


def _decode(value: str) -> AgreedStop | RunEnded:
    record = json.loads(value)
    if "ended" in record:
        return RunEnded(int(record["ended"]))
    return AgreedStop(
        int(record["step"]), str(record["reason"]), record["signal"], record["process"]
    )


def _already_exists(error: Exception) -> bool:
    return "ALREADY_EXISTS" in str(error)


class StopAgreement:
    """Agrees on one stop step for all the processes of a run; see `Loop` (several processes).

    A process asked to stop (`want`) proposes, at its next settle point, the step
    `loop_step + margin`; the first proposal written to the coordination service's key-value
    store wins, and every process reads it. A watcher thread on each process waits for the
    key, so that a settle point reads an attribute rather than asking the service (~200 µs a
    round trip), and writes that it has seen it (`_SEEN`). The process whose proposal won
    waits, before its next step, until every other process's watcher has seen it: however
    late a watcher hears of the key (a loaded machine can leave its thread unscheduled for
    many steps), its process has not run past the proposer's step then. Processes run in
    lockstep within the bound on steps in flight (every step holds collectives), so none has
    dispatched more than `limit + 1` dispatches past the proposer's when it goes on, and
    each looks at its settle points, at most `limit + 1` dispatches apart; `margin` puts the
    stop past the furthest any process can have run when it first looks.

    Args:
      client: JAX's distributed client (`loopax._distributed.coordination_client()`).
      process: this process's index.
      margin: steps from a proposer's step to the stop step.
      key: the run's key in the store, the same on every process and new for every run.
      processes: how many processes run (the proposer waits for the others to see its stop).
    """

    def __init__(self, client: Any, process: int, margin: int, key: str, processes: int):
        self._client = client
        self._process = process
        self._processes = processes
        self.margin = margin
        self._key = key
        self._wish: tuple[str, int | None] | None = None
        self._seen: AgreedStop | RunEnded | None = None
        self._watch_error: BaseException | None = None
        self._thread = threading.Thread(target=self._watch, name="loopax-stop", daemon=True)
        self._thread.start()

    @classmethod
    def for_run(cls, trainer: Trainer, margin: int) -> StopAgreement | None:
        """An agreement for a run of `trainer` whose devices span processes; else None."""
        if len({device.process_index for device in trainer.devices}) < 2:
            return None
        client = coordination_client()
        if client is None:
            return None
        import jax  # noqa: PLC0415

        key = _KEY.format(run=next(_RUNS))
        return cls(client, jax.process_index(), margin, key, jax.process_count())

    def _watch(self) -> None:
        try:
            seen = _decode(self._client.blocking_key_value_get(self._key, _WATCH_MS))
            if self._seen is None:
                self._seen = seen
            if isinstance(seen, AgreedStop):  # the proposer waits for this, after `_seen`
                self._client.key_value_set(_SEEN.format(key=self._key, process=self._process), "1")
        except Exception as error:  # the service is gone: the steps' collectives fail too
            self._watch_error = error

    def want(self, reason: str, signum: int | None) -> bool:
        """Asks for a stop; the next `poll` proposes it. False if one is agreed already."""
        if self._seen is not None:
            return False
        if self._wish is None or signum is not None:
            self._wish = (reason, signum)  # a signal's wish outranks a plain request's
        return True

    @property
    def agreed(self) -> AgreedStop | None:
        """The stop agreed on so far, without proposing any."""
        seen = self._seen
        return seen if isinstance(seen, AgreedStop) else None

    def poll(self, loop_step: int) -> AgreedStop | None:
        """The agreed stop, if any, after proposing this process's wish at `loop_step`.

        Costs two attribute reads unless a wish waits to be proposed.

        Raises:
          RuntimeError: the watcher lost the coordination service, so a stop another process
            asks for could no longer be seen (its error is chained).
        """
        seen = self._seen
        if seen is None and self._watch_error is not None:
            raise RuntimeError(
                f"process {self._process} lost JAX's coordination service while it watched "
                f"for a stop ({self._watch_error}): a stop another process asks for can no "
                "longer be agreed; the processes' last committed checkpoint resumes the run"
            ) from self._watch_error
        if seen is None and self._wish is not None:
            seen = self._propose(loop_step)
        if isinstance(seen, RunEnded):
            self._wish = None  # a process ended its run: every process ends at the same end
            return None
        return seen

    def _propose(self, loop_step: int) -> AgreedStop | RunEnded:
        assert self._wish is not None
        reason, signum = self._wish
        proposal = {
            "step": loop_step + self.margin,
            "reason": reason,
            "signal": signum,
            "process": self._process,
        }
        value = json.dumps(proposal)
        try:
            self._client.key_value_set(self._key, value)
        except Exception as error:
            if not _already_exists(error):
                raise
            value = self._client.blocking_key_value_get(self._key, 60_000)
        else:
            self._wait_until_seen(proposal["step"], reason)
        self._seen = seen = _decode(value)
        self._wish = None
        return seen

    def _wait_until_seen(self, step: int, reason: str) -> None:
        """Waits until every other process's watcher has seen this process's proposal.

        Until then no other process can have run more than its steps in flight past this
        one's (every step holds collectives, and this one runs none while it waits), so each
        reads the stop at a settle point before the step it names. Once per stop: one round
        trip through the service when the others' watchers are awake. A process that is
        slow to start its run's watcher (still in the previous run's end) is waited for, a
        warning every minute; one that died ends the run through the lost-process watch.

        Raises:
          RuntimeError: the coordination service failed (not a timeout) while waiting.
        """
        for process in range(self._processes):
            if process == self._process:
                continue
            seen_key = _SEEN.format(key=self._key, process=process)
            waited_ms = 0
            while True:
                try:
                    self._client.blocking_key_value_get(seen_key, _SEEN_WAIT_MS)
                    break
                except Exception as error:
                    if "DEADLINE_EXCEEDED" not in str(error):
                        raise RuntimeError(
                            f"process {self._process} proposed to stop every process after "
                            f"step {step} ({reason}), but waiting for process {process} to "
                            f"see it failed: {error}"
                        ) from error
                waited_ms += _SEEN_WAIT_MS
                _logger.warning(
                    "process %d waits for process %d to see its stop after step %d (%s): "
                    "%d s so far; the process is still in an earlier run's end, or hangs",
                    self._process,
                    process,
                    step,
                    reason,
                    waited_ms // 1000,
                )

    def close(self) -> None:
        """Ends the watcher: marks the run ended for the processes still in it, unless a stop is."""
        try:
            self._client.key_value_set(self._key, json.dumps({"ended": self._process}))
        except Exception as error:
            if not _already_exists(error):
                return  # the service is gone; the watcher has ended with an error
        self._thread.join(_JOIN_SECONDS)
