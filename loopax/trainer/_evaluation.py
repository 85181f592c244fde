"""The Trainer's evaluation: eval steps over batches of any size, and whole-dataset means."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import jax

from ..data._datasets import Dataset, as_list, read_batches, shown_name
from ..data._iterables import evaluation_dataset
from ._batches import check_same_batch_size_everywhere, dropped_examples_warning, split_uneven_batch
from ._inflight import InFlight

if TYPE_CHECKING:
    from ._executors import Executor
    from ._parallel import Strategy
    from ._steps import StepBuilder


class EvalSteps:
    """The part of `Trainer` that evaluates; see `Trainer`."""

    # Provided by `Trainer`.
    eval_metric_names: tuple[str, ...]
    _steps: StepBuilder
    _state: Any
    _eval_states: Any
    _strategy: Strategy
    _executor: Callable[..., Executor]

    def reset_eval_metrics(self) -> None:
        """Resets the running eval metrics (evaluate() does this at its start)."""
        self._eval_states = None
        self._steps.config.host_eval.reset()  # host metrics' states

    def _fresh_eval_states(self) -> Any:
        fresh = self._steps.fresh_eval_metrics()
        return self._strategy.place_state(fresh)

    def eval_step(self, spec: Any, inputs: Any, labels: Any) -> dict[str, jax.Array]:
        """Updates the running eval metrics with one batch; parameters do not change.

        A batch of any size counts every example once, on any number of devices: on N
        devices, a batch that N does not divide runs as its largest part that N divides
        plus its remainder padded to one example per device, in one compiled step (once
        per shape, like any batch) that leaves the padding out of the loss and of every
        metric and updates the metrics once, as with one batch.

        Returns:
          The running values `{"mean_loss": ..., <eval metric name>: ...}` over every
          batch since the last `reset_eval_metrics()` (or `evaluate`).

        Raises:
          TypeError: an input or label is not an array.
          ValueError: no inputs, mismatched batch sizes, the spec used before with another
            number of inputs/labels, or (multi-process) a batch that the local devices do
            not divide and whose size differs between processes.
        """
        inputs = as_list(inputs)
        labels = as_list(labels)
        local_devices = self._strategy.local_devices
        if local_devices > 1 and inputs:
            shape = getattr(inputs[0], "shape", ())
            if shape and shape[0] % local_devices:
                return self._eval_uneven_batch(spec, inputs, labels, shape[0])
        executor = self._executor("eval", spec, inputs, labels)
        if self._eval_states is None:
            self._eval_states = self._fresh_eval_states()
        strategy = self._strategy
        inputs, labels = strategy.global_batch(inputs), strategy.global_batch(labels)
        self._eval_states, values = executor.run(self._state, self._eval_states, inputs, labels)
        # In the documented order; host metrics' step values wait, unread.
        return self._steps.config.host_eval.results(self.eval_metric_names, values)

    def _eval_uneven_batch(
        self, spec: Any, inputs: list, labels: list, batch: int
    ) -> dict[str, jax.Array]:
        """`eval_step` for a batch of `batch` examples that the (local) devices do not divide.

        One compiled step per shape, as for any batch (see `_split_uneven_batch`).
        """
        if self._strategy.multi_process:
            check_same_batch_size_everywhere(spec, batch)
        executor = self._executor("eval", spec, inputs, labels)
        if self._eval_states is None:
            self._eval_states = self._fresh_eval_states()
        pieces = self._globalize(split_uneven_batch(inputs, labels, self._strategy.local_devices))
        self._eval_states, values = executor.run(self._state, self._eval_states, *pieces)
        # In the documented order; host metrics' step values wait, unread.
        return self._steps.config.host_eval.results(self.eval_metric_names, values)

    def _globalize(self, pieces: tuple[list, ...]) -> tuple[list, ...]:
        """Multi-process: each piece's global arrays from this process's share."""
        return tuple(self._strategy.global_batch(piece) for piece in pieces)

    def evaluate(self, dataset: Dataset | Iterable[Any]) -> dict[str, float]:
        """Evaluates on every batch of `dataset`; returns example-weighted means.

        Resets the dataset and the eval metrics first (not after). Every example the
        dataset yields counts once, on any number of devices (see `eval_step`). A dataset
        that says it skips examples (`ArrayDataset` with `drop_remainder=True` and a
        size its batch size does not divide) draws a `RuntimeWarning` with the counts.
        An iterable of batches (a list, a grain `MapDataset`, `IterDataset` or
        `DataLoader`) or an `IterableDataset` is read from its start with an iterator of
        its own, so evaluating the data a run trains on leaves the run's position as it is.

        Returns:
          `{"mean_loss": ..., <eval metric name>: ...}` as Python floats.

        Raises:
          TypeError: `dataset` is neither a `Dataset` nor an iterable, or is an iterator
            (a generator), which cannot be read again.
          ValueError: the dataset yields no batch, has `loop_forever=True` or repeats
            forever (grain's `.repeat()`).
          RuntimeError: the dataset raised (the message names it).
        """
        dataset = evaluation_dataset(dataset)
        if getattr(dataset, "loop_forever", False):
            raise ValueError(
                f"dataset {shown_name(dataset)!r} loops forever, so evaluating it "
                "would never end; evaluate a dataset built with loop_forever=False"
            )
        dropped = dropped_examples_warning(dataset)
        if dropped is not None:
            warnings.warn(dropped, RuntimeWarning, stacklevel=2)
        dataset.reset()
        self.reset_eval_metrics()
        in_flight = InFlight()
        values = None
        for batch in read_batches(dataset, "evaluation"):
            values = self.eval_step(*batch)
            in_flight.push(values["mean_loss"])
        if values is None:
            raise ValueError(
                f"dataset {shown_name(dataset)!r} yielded no batch to evaluate; "
                "check its size and batch_size (drop_remainder drops a short last batch)"
            )
        host_values = jax.device_get(values)
        return {name: float(host_values[name]) for name in self.eval_metric_names}
