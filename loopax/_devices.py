"""The device axis, the device type, and reading device values to the host together.

Shared by the data, trainer, loop and hooks floors.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

#: The name of the mesh axis a batch is split over (`ctx.axis_name`).
AXIS = "devices"

if TYPE_CHECKING:
    from typing import TypeAlias

    # `jax.Device` is a runtime alias of a compiled class that type checkers cannot see.
    Device: TypeAlias = Any
else:
    Device = jax.Device


def start_host_copies(values: Iterable[Any]) -> None:
    """Starts copying each of `values` to the host, without waiting for any.

    On an accelerator every read of a device array is a copy and a wait for it: read one by
    one, n values are n waits; with their copies started together first (as `jax.device_get`
    does with every leaf), the reads that follow wait once, for all. Values with no
    `copy_to_host_async` (numbers, numpy arrays) are skipped; starting a copy twice is harmless.
    """
    for value in values:
        start = getattr(value, "copy_to_host_async", None)
        if start is not None:
            start()


def host_floats(values: Iterable[Any]) -> list[float]:
    """`values` (device scalars, host metric values, numbers) as Python floats, read together.

    One wait for all of them on an accelerator (`start_host_copies`); a single value is
    read as it is.
    """
    values = list(values)
    if len(values) > 1:
        start_host_copies(values)
    return [float(np.asarray(value)) for value in values]
