"""What the loop hands the Trainer to run: one typed record per kind of dispatch.

A reader of a dataset turns its batches into dispatches; `Trainer.run(dispatch)` runs one
as one compiled call and says how many optimizer steps it took.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ._device_data import DeviceChunk


@dataclasses.dataclass(frozen=True, slots=True)
class OneStep:
    """One optimizer step's batch, as the dataset yielded it (host or device arrays).

    With `Trainer(accumulate_steps=K)`, each array carries a leading axis of micro-batches.
    """

    spec: Any
    inputs: list[Any]
    labels: list[Any]

    @property
    def count(self) -> int:
        """Optimizer steps this dispatch runs: one."""
        return 1


@dataclasses.dataclass(frozen=True, slots=True)
class Stacked:
    """`count` (> 1) steps' batches stacked on a leading steps axis, run in one program."""

    count: int
    spec: Any
    inputs: list[Any]
    labels: list[Any]


@dataclasses.dataclass(frozen=True, slots=True)
class OnDevice:
    """`chunk.count` steps whose batches the compiled program takes from the devices' arrays.

    The arrays of an on-device `ArrayDataset` (`on_device=True`) on the Trainer's devices;
    nothing is gathered or stacked on the host.
    """

    spec: Any
    chunk: DeviceChunk

    @property
    def count(self) -> int:
        """Optimizer steps this dispatch runs."""
        return self.chunk.count


Dispatch = OneStep | Stacked | OnDevice
