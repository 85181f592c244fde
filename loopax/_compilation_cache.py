"""JAX's persistent compilation cache, on by default: a restarted job skips compiling again.

A resumed process recompiles every program the first process compiled (a second or more
each for a real model). JAX can keep compiled programs on disk, keyed by the program itself
(the lowered code of the model and its shapes, the compile options, the JAX and backend
versions), so a stale or wrong program is never loaded; it is off unless configured. loopax
turns it on when a Trainer is built, in a per-user cache directory, unless the user
configured JAX's cache already or turned loopax's off.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

ENV = "LOOPAX_COMPILATION_CACHE"  # "off", or a directory
_OFF = {"off", "0", "false", "no", "none"}
# Programs that compile faster than this are not worth a file (JAX's default is 1 s, which
# leaves out most of a small model's programs).
_MIN_COMPILE_SECONDS = 0.1

_explicit: list[str | None] = []  # what set_compilation_cache chose, if it was called


def default_directory() -> Path:
    """`$XDG_CACHE_HOME/loopax/jax`, by default `~/.cache/loopax/jax`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "loopax" / "jax"


def set_compilation_cache(directory: str | os.PathLike[str] | None) -> None:
    """Chooses where loopax keeps compiled programs across processes, or turns it off.

    By default a Trainer turns on JAX's persistent compilation cache in
    `~/.cache/loopax/jax` (`$XDG_CACHE_HOME/loopax/jax`), so a resumed or repeated job
    loads the programs it compiled before instead of compiling them again. Call this before
    building a Trainer to move it (`directory`) or turn it off (`None`); the environment
    variable `LOOPAX_COMPILATION_CACHE` (`off`, or a directory) does the same without code.
    A JAX cache configured by the user (`jax.config.update("jax_compilation_cache_dir",
    ...)`, `JAX_COMPILATION_CACHE_DIR`) is always left as it is.

    Args:
      directory: where to keep the programs, or None for no cache.
    """
    _explicit[:] = [None if directory is None else os.fspath(directory)]


def enable_default_cache() -> str | None:
    """Turns on the cache as `set_compilation_cache` describes; returns its directory or None."""
    configured = jax.config.jax_compilation_cache_dir  # pyright: ignore[reportAttributeAccessIssue]
    if configured:
        return configured  # the user's, or ours from an earlier Trainer
    if _explicit:
        directory = _explicit[0]
    else:
        setting = os.environ.get(ENV, "").strip()
        if setting.lower() in _OFF:
            return None
        directory = os.path.expanduser(setting) if setting else str(default_directory())
    if directory is None:
        return None
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # a read-only home: run without a cache rather than fail
    jax.config.update("jax_compilation_cache_dir", directory)
    minimum = jax.config.jax_persistent_cache_min_compile_time_secs  # pyright: ignore[reportAttributeAccessIssue]
    if minimum == 1.0:  # JAX's default
        jax.config.update("jax_persistent_cache_min_compile_time_secs", _MIN_COMPILE_SECONDS)
    return directory
