"""Counting the XLA compilations a block of code causes, from JAX's public monitoring events."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

# JAX records this duration event (`jax.monitoring`) once per program it hands to the
# backend compiler, with the program's name; calls served from a jitted function's
# cache record nothing.
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class Compilations:
    """The XLA compilations seen so far inside a `count_compilations` block.

    It keeps counting until the block exits, then holds the final numbers.

    Attributes:
      names: the names of the programs compiled, in order (e.g. `"jit(step)"` for a
        `jax.jit`-ted function `step`).
    """

    def __init__(self) -> None:
        self.names: list[str] = []

    @property
    def count(self) -> int:
        """How many XLA compilations happened in the block (so far, while inside it)."""
        return len(self.names)

    def __int__(self) -> int:
        return self.count

    def __repr__(self) -> str:
        return f"Compilations(count={self.count}, names={self.names!r})"


@contextlib.contextmanager
def count_compilations() -> Iterator[Compilations]:
    """Counts the XLA compilations that happen inside the `with` block.

    A call that a jitted function serves from its cache of executables compiles nothing;
    a new shape, dtype, sharding or static argument compiles once more. Eager operations
    on new shapes compile too (each is a small program), so wrap only the calls whose
    compilations you mean to count. Compilations on every thread of the process are
    counted, and a program loaded from JAX's persistent compilation cache counts as one.
    Blocks may nest; each counts what happens inside it.

    Yields:
      A `Compilations`, whose `count` is live inside the block and final after it.

    Example:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> from loopax.testing import count_compilations
      >>> @jax.jit
      ... def double(x):
      ...     return 2 * x
      >>> three, other_three, four = jnp.ones(3), jnp.zeros(3), jnp.ones(4)
      >>> with count_compilations() as first:
      ...     _ = double(three)
      >>> first.count, first.names
      (1, ['jit(double)'])
      >>> with count_compilations() as cached:
      ...     _ = double(other_three)  # same shape and dtype: the cached executable
      >>> cached.count
      0
      >>> with count_compilations() as new_shape:
      ...     _ = double(four)
      >>> new_shape.count
      1
    """
    compilations = Compilations()

    def on_duration(event: str, duration_secs: float, **kwargs: str | int) -> None:
        del duration_secs
        if event == BACKEND_COMPILE_EVENT:
            compilations.names.append(str(kwargs.get("fun_name", "")))

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    try:
        yield compilations
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)
