"""Helpers for testing code built on loopax and JAX.

`count_compilations()` counts the XLA compilations a block of code causes, e.g. to check
that a second training step compiles nothing.
"""

from ._compilations import Compilations as Compilations
from ._compilations import count_compilations as count_compilations

__all__ = ["Compilations", "count_compilations"]
