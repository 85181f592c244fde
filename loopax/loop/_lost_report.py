"""What a process that lost another says as it ends: one line, and `LOST_PROCESS_EXIT`.

The line names the lost process, the newest checkpoint every process committed (read from
the loop's checkpoint directory at that moment) and the command that resumes this process.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
import weakref
from pathlib import Path
from typing import Any

LOST_PROCESS_EXIT = 75
"""The exit status of a process whose run lost another process: 75, EX_TEMPFAIL.

"Try again": during a run on several processes, every process exits with it when one of
them stops answering, after one line on stderr naming that process, the newest checkpoint
every process committed and the command that resumes, so that a launcher (SLURM's requeue, a
Kubernetes restart policy, an elastic agent) restarts the job, which resumes from that
checkpoint. A process is lost once its heartbeat (one a second, through JAX's coordination
service) has stood still for `LOOPAX_LOST_PROCESS_TIMEOUT` seconds (an environment
variable; 10 by default), or when JAX's own detection aborts the process first (a lost
coordinator at once; a silent process after `heartbeat_timeout_seconds` of
`jax.distributed.initialize`). See the Scale guide, "A process that dies".
"""

# Each loop's checkpoint directory, as its checkpoint hook gave it.
_DIRECTORIES: weakref.WeakKeyDictionary[Any, Path] = weakref.WeakKeyDictionary()


def note_checkpoint_directory(loop: Any, directory: Path) -> None:
    """Remembers `loop`'s checkpoint directory, which a run that loses a process names."""
    _DIRECTORIES[loop] = directory


def checkpoint_directory(loop: Any) -> Path | None:
    """`loop`'s checkpoint directory (`note_checkpoint_directory`), or None."""
    return _DIRECTORIES.get(loop)


def committed_step(directory: Path | None) -> int | None:
    """The newest checkpoint step committed in `directory`: a finished step directory.

    A save is written under a temporary name and renamed to its step once every process has
    written its part (Orbax's commit), so a step directory is a checkpoint every process
    committed; one cut off is still under its temporary name, and never counts.
    """
    if directory is None:
        return None
    try:
        names = os.listdir(directory)
    except OSError:
        return None
    steps = [int(name) for name in names if name.isdigit() and (directory / name).is_dir()]
    return max(steps, default=None)


def _quoted(argument: str) -> str:
    """`argument` for a POSIX shell, on one line (ANSI-C quoting where it holds a newline)."""
    if argument.isprintable():
        return shlex.quote(argument)
    escaped = argument.encode("unicode_escape").decode("ascii").replace("'", "\\'")
    return f"$'{escaped}'"


def resume_command(argv: list[str] | None = None) -> str:
    r"""The command line this process was started with (`argv`), as a shell takes it back.

    One line, whatever the arguments hold.

    Example:
      >>> resume_command(["python", "train.py", "--dir", "runs/a b"])
      "python train.py --dir 'runs/a b'"
      >>> resume_command(["python", "-c", "import sys\nprint(1)"])
      "python -c $'import sys\\nprint(1)'"
    """
    if argv is None:
        argv = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    return " ".join(_quoted(argument) for argument in argv)


@dataclasses.dataclass(frozen=True)
class Lost:
    """A lost process, and how it was found.

    Attributes:
      process: its index.
      how: why it counts as lost, in words (e.g. "no heartbeat for 10.3 s").
    """

    process: int
    how: str


def lost_line(lost: Lost, process: int, count: int, directory: Path | None) -> str:
    """The one line a surviving process ends with."""
    step = committed_step(directory)
    if directory is None:
        checkpoint = "no checkpoint hook is attached, so a rerun starts over"
    elif step is None:
        checkpoint = f"no checkpoint was committed in {str(directory)!r}, so a rerun starts over"
    else:
        checkpoint = (
            f"the last checkpoint every process committed is step {step} "
            f"({str(directory / str(step))!r}), where a rerun resumes"
        )
    return (
        f"loopax: lost process {lost.process} of {count} ({lost.how}); {checkpoint}; process "
        f"{process} exits with status {LOST_PROCESS_EXIT} (LOST_PROCESS_EXIT): run every "
        f"process again, this one with: {resume_command()}"
    )
