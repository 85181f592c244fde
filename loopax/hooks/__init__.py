"""Trigger helpers and ready hooks for `loopax.Loop`."""

from ._triggers import every_n_steps as every_n_steps
from ._triggers import exponential_callback as exponential_callback
from ._triggers import n_times_during_loop as n_times_during_loop
from ._triggers import periodic_callback as periodic_callback

__all__ = [
    "every_n_steps",
    "exponential_callback",
    "n_times_during_loop",
    "periodic_callback",
]
