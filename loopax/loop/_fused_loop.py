"""The Loop's fused execution: groups of steps run as compiled calls, hooks step-exact."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax

from ..data._datasets import Dataset
from ..data._groups import group_reader, power_of_two_at_most
from ..data._reader import OnDevice
from ..trainer._inflight import InFlight
from ._finite import FiniteChecker, GroupMetrics

if TYPE_CHECKING:
    from ..trainer._trainer import Trainer


class FusedRuns:
    """The part of `Loop` that runs fused groups of steps; see `Loop`."""

    # Provided by `Loop`.
    trainer: Trainer
    steps_per_execution: int
    loop_step: int
    metrics: Any
    train_step_durations: collections.deque[float]
    _group: GroupMetrics | None
    _metrics_step: int
    _epoch_batches: int
    _stop_requested: bool
    _rewound: bool
    _exact_wake_step: int
    _finite: FiniteChecker
    _in_flight: InFlight
    _pending_logs: list
    _after_hooks: list
    _dataset_error: Callable[[Dataset, Exception], RuntimeError]
    _resolve_logs: Callable[[int], None]
    _step_hooks: Callable[[Any, int], None]
    _run_after_hooks: Callable[[], None]
    _settle: Callable[[], None]

    @property
    def group_metrics(self) -> dict[str, Any]:
        """Every step's metrics of the latest group of fused steps.

        `{name: values with a leading axis of the group's steps}` on the device, the last
        step's values last (with `steps_per_execution=1`: the latest step's, axis of 1).
        A host metric's entry is its value after the group. The group's first loop step is
        `loop_step - len(values) + 1` while OnStep hooks run.
        """
        import jax.numpy as jnp  # noqa: PLC0415

        if self._group is None:
            return {key: jnp.asarray(value)[None] for key, value in self.metrics.items()}
        result = {}
        for key, value in self._group.items():
            if isinstance(value, jax.Array):
                parts = [values for _, values in self._group.stacked(key)]
                result[key] = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
            else:
                result[key] = value
        return result

    def _train_groups_until(self, dataset: Dataset, stop_step: int) -> bool:
        """`_train_until` with fused execution: groups of up to `steps_per_execution` steps.

        A group ends at the next step a step-scheduled OnStep hook fires at
        (`_exact_wake_step`: a clock's fires at group ends), at `stop_step`, or where the
        dataset ends; OnStep hooks run once, at its last step.
        """
        trainer = self.trainer
        read = group_reader(dataset, trainer)
        push = self._in_flight.push
        clock = time.perf_counter
        most = self.steps_per_execution
        while True:
            indicator = self._finite.indicator
            while self.loop_step < stop_step and not self._stop_requested:
                started = clock()
                first = self.loop_step
                wanted = min(most, stop_step - first, self._exact_wake_step - first + 1)
                try:
                    chunks, ended = read(power_of_two_at_most(max(wanted, 1)))
                except StopIteration:
                    return True
                except Exception as err:
                    raise self._dataset_error(dataset, err) from err
                parts = []
                step = first
                for count, spec, inputs, labels in chunks:
                    if labels is None:  # a DeviceChunk: gathered in the program
                        result = trainer.run(OnDevice(spec, inputs))
                        parts.append((step, count, result.stacked, result.last))
                    elif count == 1:
                        metrics = trainer.train_step(spec, inputs, labels)
                        parts.append((step, 1, None, metrics))
                    else:
                        stacked, metrics = trainer.train_steps(spec, inputs, labels)
                        parts.append((step, count, stacked, metrics))
                    step += count
                last = step - 1
                group = GroupMetrics(parts[-1][3], parts)
                self.metrics = self._group = group
                self._metrics_step = last
                self._epoch_batches += step - first
                window = push(group[indicator], (last, group))
                if window is not None:
                    self._finite.verify(self, window)
                    if self._pending_logs:
                        self._resolve_logs(window[-1][0])
                if not self._rewound:
                    self.loop_step = last
                    self._step_hooks(group, last)
                    if self._after_hooks:
                        self._run_after_hooks()
                self.train_step_durations.append((clock() - started) / (step - first))
                if self._rewound:
                    self._rewound = False
                    continue
                self.loop_step = last + 1
                if ended:
                    return True
            self._settle()
            if not self._rewound:
                return False
            self._rewound = False
