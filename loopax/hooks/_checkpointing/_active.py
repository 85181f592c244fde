"""The newest Checkpointer of each checkpoint directory in this process.

A run returns before its end-of-run save is committed: whatever reads or writes the
directory next in this process (a new hook on it, `loopax.load_params`) first waits for
the saves that Checkpointer has in flight (Orbax's start-up clean-up would delete them, a
reader would not see them).
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

_ACTIVE: dict[Path, weakref.ref] = {}


def wait_for_saves(directory: Path) -> bool:
    """Waits for the saves in flight to `directory` (absolute) in this process, if any.

    A failed save is logged (the run it belongs to raises it).

    Returns:
      Whether a Checkpointer of `directory` was found.
    """
    active = _ACTIVE.get(directory)
    checkpointer = active() if active is not None else None
    if checkpointer is None:
        return False
    checkpointer.wait_quietly()
    return True


def take_over(directory: Path, checkpointer: Any) -> bool:
    """Makes `checkpointer` the one of `directory`, once the previous one's saves are done.

    Returns:
      Whether there was a previous one.
    """
    waited = wait_for_saves(directory)
    _ACTIVE[directory] = weakref.ref(checkpointer)
    return waited
