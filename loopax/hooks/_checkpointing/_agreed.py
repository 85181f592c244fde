"""A clock schedule that process 0 decides for every process.

Each process's clock reads differently, so a schedule by time would fire at different steps
on different processes, and a save that one process makes and another does not waits
forever. `AgreedSchedule` asks the clock on process 0 only: at every step it is asked,
process 0 publishes whether it fires and the next step at which to ask again, through the
coordination service; the other processes read that (with a timeout) and follow. So every
process asks at the same steps and fires at the same ones.
"""

from __future__ import annotations

from typing import Any

from ...loop import RunInfo, Schedule
from ._coordination import Coordination


class AgreedSchedule(Schedule):
    """`schedule` as decided on process 0, for every process.

    Args:
      schedule: the schedule to follow (e.g. a `Periodic`), asked on process 0 only.
      coordination: the exchange between processes.
      name: names its exchanges (unique per coordination namespace).

    Raises (when asked):
      CoordinationError: process 0 did not publish its decision within the timeout.
    """

    def __init__(self, schedule: Schedule, coordination: Coordination, name: str):
        self.schedule = schedule
        self.coordination = coordination
        self.name = name
        self.checks_every_step = schedule.checks_every_step
        self.time_based = schedule.time_based
        self.at_epoch_end = schedule.at_epoch_end
        self._decisions = 0  # how many decisions so far: names the next exchange
        self._next: int | None = None  # the step process 0 named, until asked there

    def start_run(self, run: RunInfo) -> None:
        self._next = None
        self.schedule.start_run(run)

    def restart(self, run: RunInfo) -> None:
        self._next = None
        self.schedule.restart(run)

    def next_step(self, run: RunInfo, step: int) -> int:
        return step if self._next is None else max(step, self._next)

    def should_fire(self, run: RunInfo) -> bool:
        step = run.loop_step
        key = f"{self.name}/{self._decisions}"
        self._decisions += 1
        decision: dict[str, Any] | None = None
        if self.coordination.process_index == 0:
            fire = self.schedule.should_fire(run)
            decision = {
                "step": step,
                "fire": bool(fire),
                "next": int(self.schedule.next_step(run, step + 1)),
            }
        agreed: dict[str, Any] = self.coordination.broadcast(
            key, decision, f"{self.schedule!r}'s decision at step {step} (from process 0)"
        )
        if agreed["step"] != step:
            raise RuntimeError(
                f"{self.schedule!r}: process 0 decided for step {agreed['step']} while this "
                f"process {self.coordination.process_index} is at step {step}; the processes "
                "run different steps (every process must run the same steps and hooks)"
            )
        self._next = int(agreed["next"])
        return bool(agreed["fire"])

    def fired(self, run: RunInfo) -> None:
        self.schedule.fired(run)

    def get_state(self) -> dict[str, Any]:
        return self.schedule.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        self.schedule.set_state(state)

    def __repr__(self) -> str:
        return repr(self.schedule)
