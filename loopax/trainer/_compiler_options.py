"""`Trainer(compiler_options=...)`: the XLA options every program of a trainer compiles with.

The options are XLA's `DebugOptions` fields, as `jax.stages.Lowered.compile(compiler_options=)`
and `jax.jit(compiler_options=)` take them: the flags `XLA_FLAGS` sets process-wide, here for
one trainer's programs. XLA parses them when it compiles, so a name or value it does not
accept fails at the first compile; `refused_options` turns that error into one naming the
Trainer argument.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

import jax
import numpy as np

OptionValue = bool | int | float | str
CompilerOptions = Mapping[str, OptionValue]

_ACCEPTED = "a bool, int, float or str"
_ARGUMENT = "Trainer(compiler_options=...)"
# XLA's wording (jax 0.10): "No such compile option: 'name'" and "While setting option name,
# 'value' is not a valid <type> value."
_REFUSED = (
    re.compile(r"No such compile option: '([^']+)'"),
    re.compile(r"While setting option (\S+?),"),
)
_FIELDS = (
    "each key must be a field of XLA's DebugOptions (the flags XLA_FLAGS takes, without "
    "the leading '--', e.g. 'xla_dump_to' or 'xla_gpu_autotune_level'; see "
    "jax.stages.Lowered.compile) with a value of that field's type"
)


def check_compiler_options(options: Any) -> Mapping[str, OptionValue]:
    """`options` as a read-only copy; None gives an empty one.

    Raises:
      TypeError: `options` is not a mapping, or a key is not a str, or a value is not a
        bool, int, float or str (NumPy scalars become their Python values).
      ValueError: a key is empty or starts with `-` (an `XLA_FLAGS` spelling).
    """
    if options is None:
        return MappingProxyType({})
    if not isinstance(options, Mapping):
        raise TypeError(
            f"{_ARGUMENT} must be a mapping of XLA option names to values, such as "
            f"{{'xla_gpu_autotune_level': 1}}, or None; got {type(options).__name__}"
        )
    checked: dict[str, OptionValue] = {}
    for key, value in options.items():
        if not isinstance(key, str):
            raise TypeError(
                f"{_ARGUMENT} has the key {key!r} ({type(key).__name__}); keys must be XLA "
                "option names (str), such as 'xla_gpu_autotune_level'"
            )
        if not key.lstrip("-"):
            raise ValueError(f"{_ARGUMENT} has the key {key!r}; keys are XLA option names")
        if key.startswith("-"):
            raise ValueError(
                f"{_ARGUMENT} has the key {key!r}; an option's name is written without the "
                f"leading '--' of XLA_FLAGS: {key.lstrip('-')!r}"
            )
        if isinstance(value, np.generic):
            value = value.item()
        if not isinstance(value, (bool, int, float, str)):
            raise TypeError(
                f"{_ARGUMENT} has {key!r}: {value!r} ({type(value).__name__}); a value must "
                f"be {_ACCEPTED}, as jax.stages.Lowered.compile takes them"
            )
        checked[key] = value
    return MappingProxyType(checked)


@contextlib.contextmanager
def refused_options(options: CompilerOptions) -> Iterator[None]:
    """Turns XLA's refusal of one of `options` into a ValueError naming the argument.

    Raises:
      ValueError: XLA refused an option's name or value (chained to XLA's error).
    """
    try:
        yield
    except jax.errors.JaxRuntimeError as error:
        key = _refused_key(str(error), options)
        if key is None:
            raise
        raise ValueError(
            f"XLA refused {_ARGUMENT}'s {key!r}: {options[key]!r} ({error}); {_FIELDS}"
        ) from error


def compile_lowered(lowered: Any, options: CompilerOptions) -> Any:
    """`lowered.compile()` with `options` (none: exactly as without); the `Compiled`.

    Raises:
      ValueError: XLA refused one of `options` (see `refused_options`).
    """
    if not options:
        return lowered.compile()
    with refused_options(options):
        return lowered.compile(dict(options))


def jit(fn: Callable[..., Any], options: CompilerOptions) -> Callable[..., Any]:
    """`jax.jit(fn)` compiled with `options`, XLA's refusal of one named (`refused_options`)."""
    if not options:
        return jax.jit(fn)
    jitted = jax.jit(fn, compiler_options=dict(options))

    def call(*args: Any) -> Any:
        with refused_options(options):
            return jitted(*args)

    return call


def _refused_key(message: str, options: CompilerOptions) -> str | None:
    """The key of `options` XLA's `message` says it refused, or None."""
    for pattern in _REFUSED:
        match = pattern.search(message)
        if match is not None and match.group(1) in options:
            return match.group(1)
    return None
