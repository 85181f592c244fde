"""The device axis, the device type, and reading device values to the host together.

Shared by the data, trainer, loop and hooks floors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
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


#: Whether `start_host_copies` starts copies of arrays on CPU devices too (see there); the
#: suite's read-counting tests turn it on to count reads as an accelerator pays them
#: (`loopax.testing._internal.host_copies_started_on_cpu`).
_COPIES_ON_CPU = [False]


def start_host_copies(values: Iterable[Any]) -> None:
    """Starts copying each of `values` to the host, without waiting for any.

    On an accelerator every read of a device array is a copy and a wait for it: read one by
    one, n values are n waits; with their copies started together first (as `jax.device_get`
    does with every leaf), the reads that follow wait once, for all. Values with no
    `copy_to_host_async` (numbers, numpy arrays) are skipped; starting a copy twice is harmless.
    Nothing is started when the first array lives on CPU devices: their memory is the
    host's, a read needs no transfer, and a started copy costs more than the read it would
    save (2-3 µs a scalar against under 1 µs, measured on 2 cores: the README's hooks on a
    fused run lost 1-2% of their steps/s to it).
    """
    arrays = [value for value in values if hasattr(value, "copy_to_host_async")]
    if not arrays or (_on_cpu(arrays[0]) and not _COPIES_ON_CPU[0]):
        return
    for array in arrays:
        array.copy_to_host_async()


def _on_cpu(array: Any) -> bool:
    """Whether `array` lives on CPU devices (host memory)."""
    return next(iter(array.sharding.device_set)).platform == "cpu"


@contextlib.contextmanager
def host_copies_started_on_cpu() -> Iterator[None]:
    """Within it, `start_host_copies` starts copies of CPU arrays too, as on an accelerator."""
    _COPIES_ON_CPU[0] = True
    try:
        yield
    finally:
        _COPIES_ON_CPU[0] = False


def host_floats(values: Iterable[Any]) -> list[float]:
    """`values` (device scalars, host metric values, numbers) as Python floats, read together.

    One wait for all of them on an accelerator (`start_host_copies`); a single value is
    read as it is.
    """
    values = list(values)
    if len(values) > 1:
        start_host_copies(values)
    return [float(np.asarray(value)) for value in values]
