"""Hook priorities, the hook record, and the error raised when a hook fails."""

from __future__ import annotations

import enum
from typing import Any, Callable, NamedTuple


class Priority(enum.IntEnum):
    """Named bands for hook priorities: lower runs first; ties run in registration order.

    Ready hooks use these bands so that, at any step, evaluations run before the
    checkpoint that may keep the best model, which runs before the logs and the UI that
    show the results. Any int works as a priority; `Priority.DEFAULT + 1` is fine too.

    Example:
      >>> Priority.VALIDATE < Priority.DEFAULT < Priority.CHECKPOINT < Priority.UI
      True
    """

    VALIDATE = -200
    EVALUATE = -100
    DEFAULT = 0
    CHECKPOINT = 100
    LOG = 200
    UI = 300


class HookError(RuntimeError):
    """A hook raised: the message names the phase, the hook and the step.

    The original exception is chained as `__cause__`.
    """

    def __init__(self, phase: str, hook_name: str, step: int, error: BaseException):
        self.phase = phase
        self.hook_name = hook_name
        self.step = step
        super().__init__(
            f"{phase} hook {hook_name!r} failed at step {step}: "
            f"{type(error).__name__}: {error}"
        )


class Hook(NamedTuple):
    """One registered hook; `order` breaks priority ties by registration order."""

    priority: int
    order: int
    name: str
    fn: Callable[..., Any]
    # True when the loop must check the loss is finite before calling it (a host sync);
    # trigger helpers do the check themselves only on the steps they fire.
    checks_finite_eagerly: bool
