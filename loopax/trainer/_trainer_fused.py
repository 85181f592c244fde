"""The Trainer's fused steps: n optimizer steps in one compiled program."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ._batches import spec_key
from ._steps import LOSS

if TYPE_CHECKING:
    from ..data._device_data import DeviceChunk
    from ._executors import ExecutorCache
    from ._parallel import Device, Strategy
    from ._steps import StepBuilder


class FusedSteps:
    """The part of `Trainer` that runs fused steps; see `Trainer`."""

    # Provided by `Trainer`.
    _cache: ExecutorCache
    _strategy: Strategy
    _steps: StepBuilder
    _global_step: int
    _state: Any
    _run_train: Callable[..., Any]
    _compile: Callable[..., Any]

    def train_steps(
        self, spec: Any, inputs: Any, labels: Any
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Runs n optimizer steps in one compiled program (`lax.scan`); n is the inputs' first axis.

        Each input and label is n batches stacked, shape `(n, batch, ...)` (with
        `accumulate_steps` > 1, `(n, micro-batches, batch, ...)`); the result equals n calls
        of `train_step`. `Loop(trainer, steps_per_execution=K)` calls it on batches it
        stacks (on-device `ArrayDataset` batches go to a program of their own that slices
        them from the devices' arrays, also reported as `"train_steps"`). Compiled once per
        n, spec and shape.

        Returns:
          `(stacked, last)`: every train metric with a leading axis of the n steps, and the
          last step's metrics as `train_step` returns them. A host metric's entry is the
          same in both: its value after the n steps.

        Raises:
          As `train_step`, and ValueError for arrays without a common leading steps axis.
        """
        return self._fused_results(self._run_train("train_steps", spec, inputs, labels))

    def _train_gathered(
        self, spec: Any, chunk: DeviceChunk
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """`train_steps` on `chunk`'s batches, which the compiled program takes itself.

        Each step slices (shuffled: gathers) its batch from the arrays on the devices,
        inside the scan. Only for a single-process trainer on the devices holding
        `chunk`'s arrays (see `gathers_on`).
        """
        program = (chunk.count, chunk.size, chunk.order is None, chunk.source.key)
        cache = self._cache
        try:
            fast_key = ("train_steps_gathered", spec, *program)
            executor = cache.get_fast(fast_key)
        except TypeError:  # an unhashable spec
            fast_key = ("train_steps_gathered", spec_key(spec), *program)
            executor = cache.get_fast(fast_key)
        if executor is None:
            inputs, labels = chunk.shapes()
            executor = cache.executor(
                "train_steps_gathered",
                spec,
                inputs,
                labels,
                functools.partial(self._compile, chunk=chunk),
                extra_key=program,
            )
            cache.remember(fast_key, executor)
        self._state, values = executor.run(self._state, *chunk.arguments())
        return self._fused_results(values)

    def gathers_on(self, devices: list[Device]) -> bool:
        """Whether the fused steps can gather batches from arrays replicated on `devices`.

        True when they are this single-process trainer's devices, in its order.
        """
        strategy = self._strategy
        return not strategy.multi_process and list(devices) == list(strategy.devices)

    def _fused_results(self, values: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """`train_steps`'s `(stacked, last)` dicts, in the documented order, from its program's.

        A host metric is only in the program's `last`: its entry in both is its value there.
        """
        stacked, last = values
        self._global_step += int(np.shape(stacked[LOSS])[0])
        names = self._steps.train_keys
        last_metrics = self._steps.config.host_train.results(names, last)
        stacked_metrics = {
            name: stacked[name] if name in stacked else last_metrics[name] for name in names
        }
        return stacked_metrics, last_metrics
