"""Warnings that point at the user's line, never into loopax.

A hook's warning is raised many calls deep inside `loop.run_steps`; a fixed `stacklevel`
would show a line of loopax's own source. `warn` shows the innermost frame outside the
loopax package (and the standard library it calls through) instead: the user's
`run_epochs(...)` call, or their hook.
"""

from __future__ import annotations

import sys
import sysconfig
import warnings
from pathlib import Path

# Frames skipped on the way out: loopax's own, and the standard library's that loopax
# calls through (a `with` block's contextlib frames).
_LOOPAX = str(Path(__file__).resolve().parent)
_STDLIB = (str(Path(sysconfig.get_paths()["stdlib"]).resolve()), "<frozen ")


def _skipped(filename: str) -> bool:
    if filename.startswith(_LOOPAX):
        return True
    installed = "site-packages" in filename or "dist-packages" in filename
    return filename.startswith(_STDLIB) and not installed


def _outside_loopax() -> int:
    """The `stacklevel` of the innermost caller outside loopax, as `warnings.warn` counts."""
    frame = sys._getframe(2)  # the caller of `warn`'s caller
    level = 2
    while frame is not None:
        filename = frame.f_code.co_filename
        if not _skipped(filename):
            return level
        frame = frame.f_back
        level += 1
    return 1


def warn(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """`warnings.warn(message, category)` shown at the user's line that led here."""
    warnings.warn(message, category, stacklevel=_outside_loopax())
