"""The Trainer's evaluation: eval steps over batches of any size, and whole-dataset means."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import jax

from .. import _warnings
from ..data import Dataset
from ..data._internal import as_list, evaluation_dataset, read_batches, shown_name
from ._batches import check_same_batch_size_everywhere, dropped_examples_warning
from ._inflight import DEFAULT_LIMIT, InFlight, limit_for
from ._named import named_metrics
from ._program import EVAL, EVAL_UNEVEN, EVAL_WHOLE
from ._shares import masked_pieces, rounds, spans_processes

if TYPE_CHECKING:
    from ._host_metrics import HostMetrics
    from ._parallel import Strategy
    from ._programs import Programs


class Evaluator:
    """Runs eval steps on the Trainer's state, keeping the running eval metric states.

    Args:
      programs: compiles and runs the eval programs.
      strategy: places the metric states.
      names: the eval metrics' names, in order.
      host: the host eval metrics.
    """

    def __init__(
        self, programs: Programs, strategy: Strategy, names: tuple[str, ...], host: HostMetrics
    ):
        self._programs = programs
        self._strategy = strategy
        self._names = names
        self._host = host
        self._host_or_none = host or None  # as `named_metrics` takes it
        self._states: Any = None

    def reset(self) -> None:
        """Resets the running eval metrics; see `Trainer.reset_eval_metrics`."""
        self._states = None
        self._host.reset()  # host metrics' states

    def eval_step(self, spec: Any, inputs: Any, labels: Any) -> dict[str, jax.Array]:
        """Updates the running eval metrics with one batch; see `Trainer.eval_step`."""
        inputs = as_list(inputs)
        labels = as_list(labels)
        program = EVAL
        local_devices = self._strategy.local_devices
        if local_devices > 1 and inputs:
            shape = getattr(inputs[0], "shape", ())
            if shape and shape[0] % local_devices:  # run as pieces the devices divide
                if self._strategy.multi_process:
                    check_same_batch_size_everywhere(spec, shape[0])
                # per-device bodies pad the remainder; a global-batch body takes it whole
                program = EVAL_UNEVEN if self._strategy.body_devices > 1 else EVAL_WHOLE
        if self._states is None:
            self._states = self._strategy.place_state(self._programs.steps.fresh_eval_metrics())
        self._states, values = self._programs.run(program, spec, inputs, labels, self._states)
        return named_metrics(self._names, values, self._host_or_none)

    def evaluate(self, dataset: Dataset | Iterable[Any]) -> dict[str, float]:
        """Example-weighted means over every batch of `dataset`; see `Trainer.evaluate`."""
        dataset = evaluation_dataset(dataset)
        if getattr(dataset, "loop_forever", False):
            raise ValueError(
                f"dataset {shown_name(dataset)!r} loops forever, so evaluating it "
                "would never end; evaluate a dataset built with loop_forever=False"
            )
        dropped = dropped_examples_warning(dataset)
        if dropped is not None:
            _warnings.warn(dropped)  # at the user's line
        dataset.reset()
        self.reset()
        # Never more than the Loop's bound for these devices (see `limit_for`).
        in_flight = InFlight(min(DEFAULT_LIMIT, limit_for(self._strategy.devices)))
        values = None
        batches = read_batches(dataset, "evaluation")
        if spans_processes(self._strategy.devices):
            batches = self._shares(batches)
        for batch in batches:
            values = self.eval_step(*batch) if isinstance(batch, tuple) else batch
            in_flight.push(values["mean_loss"])
        if values is None:
            raise ValueError(
                f"dataset {shown_name(dataset)!r} yielded no batch to evaluate; "
                "check its size and batch_size (drop_remainder drops a short last batch)"
            )
        host_values = jax.device_get(values)
        return {name: float(host_values[name]) for name in self._names}

    def _shares(self, batches: Iterable[Any]) -> Iterator[tuple | dict[str, jax.Array]]:
        """Several processes: each batch, or the metrics of an uneven round, run on every process.

        Processes with equal batches evaluate them as one process does; a round where the
        processes' batch sizes differ (uneven shares, or a share used up) runs as pieces of one
        shard per device, each all real or all padding (`_shares.masked_pieces`), so that every
        example counts once and every process makes the same calls.
        """
        for round_ in rounds(iter(batches)):
            batch = round_.batch
            if round_.even:
                yield (batch.spec, batch.inputs, batch.labels)
                continue
            values: dict[str, jax.Array] = {}
            for inputs, labels, valid in masked_pieces(round_, self._strategy.local_devices):
                if self._states is None:
                    self._states = self._strategy.place_state(
                        self._programs.steps.fresh_eval_metrics()
                    )
                self._states, outputs = self._programs.run_masked(
                    batch.spec, inputs, labels, valid, self._states
                )
                values = named_metrics(self._names, outputs, self._host_or_none)
            yield values
