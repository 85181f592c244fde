"""Checks of the integer arguments every floor takes, with messages that name them.

Each returns the value as a Python int, or raises `ValueError` (`TypeError` for a priority
of the wrong type) naming the argument, the value and what to pass instead. `where` is a
prefix for the message, e.g. the hook's name: `"early_stopping: "`.
"""

from __future__ import annotations

import json
import numbers
import os
from collections.abc import Callable
from typing import Any


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def positive_int(argument: str, value: Any, where: str = "") -> int:
    """`value` as an int >= 1.

    Example:
      >>> positive_int("n", 3)
      3
      >>> positive_int("n", 0)
      Traceback (most recent call last):
      ...
      ValueError: n must be a positive int, got n=0
    """
    if not _is_int(value):
        raise ValueError(
            f"{where}{argument} must be a positive int, got {value!r} of type "
            f"{type(value).__name__}; pass an int such as {argument}=10"
        )
    if value < 1:
        raise ValueError(f"{where}{argument} must be a positive int, got {argument}={value!r}")
    return int(value)


def optional_positive_int(argument: str, value: Any, where: str = "") -> int | None:
    """`value` as an int >= 1, or None where None means "no limit".

    Example:
      >>> optional_positive_int("keep", None) is None
      True
      >>> optional_positive_int("keep", 0)
      Traceback (most recent call last):
      ...
      ValueError: keep must be a positive int or None, got keep=0
    """
    if value is None:
        return None
    if not _is_int(value) or value < 1:
        raise ValueError(
            f"{where}{argument} must be a positive int or None, got {argument}={value!r}"
        )
    return int(value)


def non_negative_int(argument: str, value: Any, where: str = "") -> int:
    """`value` as an int >= 0.

    Example:
      >>> non_negative_int("steps", -1)
      Traceback (most recent call last):
      ...
      ValueError: steps must be an int >= 0, got steps=-1
    """
    if not _is_int(value) or value < 0:
        raise ValueError(f"{where}{argument} must be an int >= 0, got {argument}={value!r}")
    return int(value)


def priority(value: Any, where: str = "") -> int:
    """A hook priority as an int (any int; `loopax.Priority` names the bands).

    Raises:
      TypeError: `value` is not an int (a bool is not one).
    """
    if not _is_int(value):
        raise TypeError(
            f"{where}priority must be an int such as loopax.Priority.CHECKPOINT, got {value!r}"
        )
    return int(value)


def json_value(value: Any, message: Callable[[Exception], str]) -> None:
    """Checks that `value` is JSON (checkpoints keep states as JSON).

    Raises:
      TypeError: `message(error)`, with the serializer's error chained.
    """
    try:
        json.dumps(value)
    except (TypeError, ValueError) as err:
        raise TypeError(message(err)) from err


def path(argument: str, value: Any, where: str = "") -> str:
    """A file or directory argument as a str, with `~` expanded to the user's home.

    Example:
      >>> import os
      >>> path("logdir", "~/runs") == os.path.join(os.path.expanduser("~"), "runs")
      True
      >>> path("directory", "")
      Traceback (most recent call last):
      ...
      ValueError: directory is empty; pass a path such as directory='runs/directory'

    Raises:
      TypeError: `value` is not a str or an `os.PathLike`.
      ValueError: `value` is empty (it would write into the working directory).
    """
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"{where}{argument} must be a str or a pathlib.Path, got {type(value).__name__}"
        )
    text = os.fspath(value)
    if not isinstance(text, str) or not text:
        raise ValueError(
            f"{where}{argument} is empty; pass a path such as {argument}='runs/{argument}'"
        )
    return os.path.expanduser(text)
