"""The Trainer's predictions: the model's outputs as numpy, every example once."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from .._validate import positive_int
from ..data._internal import as_list, is_dataset, read_batches
from ._program import PREDICT
from ._shares import gather, rounds, spans_processes

if TYPE_CHECKING:
    from ._parallel import Strategy
    from ._placed_state import PlacedState
    from ._programs import Programs

DEFAULT_BATCH_SIZE = 256


def _pad_to(arrays: list[np.ndarray], size: int) -> list[np.ndarray]:
    """`arrays` (one batch) padded to `size` examples with copies of their last example."""
    missing = size - arrays[0].shape[0]
    if not missing:
        return arrays
    return [np.concatenate([a, np.repeat(a[-1:], missing, axis=0)]) for a in arrays]


class Predictor:
    """Predicts with the Trainer's state, every example once; see `Trainer.predict`.

    Args:
      programs: compiles and runs the predict program.
      placed: the train state (predicting needs one).
      strategy: the devices a batch is split over.
    """

    def __init__(self, programs: Programs, placed: PlacedState, strategy: Strategy):
        self._programs = programs
        self._placed = placed
        self._strategy = strategy

    def _predict_batch(self, spec: Any, inputs: list[np.ndarray], size: int) -> list[np.ndarray]:
        """Predictions for one (local) batch, padded to `size` and trimmed back.

        `size` is a multiple of the devices.
        """
        count = int(inputs[0].shape[0])
        padded = _pad_to([np.asarray(a) for a in inputs], size)
        multi_process = self._strategy.multi_process
        outputs = self._programs.run(PREDICT, spec, padded, [])
        results = []
        for output in outputs:
            if multi_process:  # this process's examples: its devices' shards, in order
                # once each: on a mesh, devices along other axes hold copies of a shard
                shards = {s.index[0].start or 0: s for s in output.addressable_shards}
                output = np.concatenate([np.asarray(shards[k].data) for k in sorted(shards)])
            results.append(np.asarray(output)[:count])
        return results

    def predict(self, x: Any, *, batch_size: int | None = None, spec: Any = None) -> Any:
        """The model's predictions as numpy, every example once; see `Trainer.predict`."""
        if self._placed.device_state is None and not self._programs.has_start:
            # (With init_params the first program compiled creates the state from them.)
            raise RuntimeError(
                "predict needs the model's variables: train a step first, or restore a "
                "checkpoint (hooks.checkpoint), or give init_params= to the Trainer"
            )
        devices = self._strategy.local_devices
        shares = spans_processes(self._strategy.devices)
        if is_dataset(x):
            parts = self._predict_dataset(x, devices, shares)
        else:
            inputs = [np.asarray(a) for a in as_list(x)]
            sizes = {int(a.shape[0]) for a in inputs}
            if len(sizes) != 1:
                raise ValueError(
                    f"predict got inputs with different first dimensions {sorted(sizes)}; every "
                    "input needs one row per example"
                )
            total = sizes.pop()
            if batch_size is None:  # on several processes, the same on all: their largest
                largest = int(gather([total]).max()) if shares else total
                batch_size = min(DEFAULT_BATCH_SIZE, max(largest, 1))
            size = math.ceil(positive_int("batch_size", batch_size) / devices) * devices
            batches = [
                (spec, [a[start : start + size] for a in inputs], [])
                for start in range(0, total, size)
            ]
            if shares:
                parts = self._predict_shares(iter(batches), devices, size)
            else:
                parts = [self._predict_batch(spec, batch, size) for spec, batch, _ in batches]
        if not parts:
            raise ValueError("predict got no examples")
        counts = sorted({len(part) for part in parts})
        if len(counts) != 1:
            raise ValueError(
                f"the model returned {counts[0]} predictions for some batches and {counts[-1]} "
                "for others (a Dataset whose batches carry different specs?); predict needs the "
                "same outputs for every batch: predict each spec's examples separately"
            )
        outputs = [np.concatenate(column) for column in zip(*parts, strict=True)]
        return outputs[0] if len(outputs) == 1 else outputs

    def _predict_dataset(self, dataset: Any, devices: int, shares: bool) -> list[list[np.ndarray]]:
        dataset.reset()
        if shares:
            return self._predict_shares(iter(read_batches(dataset, "prediction")), devices, None)
        parts = []
        for batch_spec, inputs, _ in read_batches(dataset, "prediction"):
            inputs = [np.asarray(a) for a in as_list(inputs)]
            size = math.ceil(int(inputs[0].shape[0]) / devices) * devices
            parts.append(self._predict_batch(batch_spec, inputs, size))
        return parts

    def _predict_shares(
        self, batches: Iterator[tuple[Any, Any, Any]], devices: int, size: int | None
    ) -> list[list[np.ndarray]]:
        """Several processes: each process's batches in rounds all make the same calls in.

        A round pads every process's batch to the same size (`size`, or its largest batch
        rounded up to the devices); a process whose share is used up predicts padding and
        keeps none of it.
        """
        parts = []
        for round_ in rounds(batches):
            count = int(round_.sizes[round_.process])
            largest = int(round_.sizes.max())
            padded = size or math.ceil(largest / devices) * devices
            inputs = [np.asarray(a)[: max(count, 1)] for a in round_.batch.inputs]
            part = self._predict_batch(round_.batch.spec, inputs, padded)
            parts.append([output[:count] for output in part])
        return parts
