"""JAX's coordination-service client: the one read of JAX's private state in loopax.

`jax.distributed.initialize` keeps the client in `jax._src.distributed.global_state`, and JAX
(0.10) has no public accessor for it. The rooms that use it (the stop agreement, the
lost-process watch, the batch shares of uneven data, the checkpoints' coordination) ask here,
so that a change in JAX breaks one function (`tests/test_architecture.py` checks that no
other module imports `jax._src`).
"""

from __future__ import annotations

from typing import Any


def coordination_client() -> Any | None:
    """JAX's distributed client, or None when `jax.distributed.initialize` was not called."""
    from jax._src.distributed import global_state  # noqa: PLC0415  (only with several processes)

    return global_state.client


def coordinator_address() -> str | None:
    """The coordinator's `host:port` given to `jax.distributed.initialize`, or None."""
    from jax._src.distributed import global_state  # noqa: PLC0415  (only with several processes)

    return global_state.coordinator_address
