"""The device axis and the device type, shared by the data, trainer and loop floors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax

#: The name of the mesh axis a batch is split over (`ctx.axis_name`).
AXIS = "devices"

if TYPE_CHECKING:
    from typing import TypeAlias

    # `jax.Device` is a runtime alias of a compiled class that type checkers cannot see.
    Device: TypeAlias = Any
else:
    Device = jax.Device
