"""The Trainer's predictions: the model's outputs as numpy, every example once."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..data._datasets import as_list, read_batches
from ..data._iterables import is_dataset

if TYPE_CHECKING:
    from ._executors import Executor
    from ._parallel import Strategy

DEFAULT_BATCH_SIZE = 256


def _pad_to(arrays: list[np.ndarray], size: int) -> list[np.ndarray]:
    """`arrays` (one batch) padded to `size` examples with copies of their last example."""
    missing = size - arrays[0].shape[0]
    if not missing:
        return arrays
    return [np.concatenate([a, np.repeat(a[-1:], missing, axis=0)]) for a in arrays]


class Predict:
    """The part of `Trainer` that predicts; see `Trainer.predict`."""

    # Provided by `Trainer`.
    _state: Any
    _strategy: Strategy
    _executor: Callable[..., Executor]

    def _predict_batch(self, spec: Any, inputs: list[np.ndarray], size: int) -> list[np.ndarray]:
        """Predictions for one (local) batch, padded to `size` and trimmed back.

        `size` is a multiple of the devices.
        """
        count = int(inputs[0].shape[0])
        padded = _pad_to([np.asarray(a) for a in inputs], size)
        executor = self._executor("predict", spec, padded, [])
        multi_process = self._strategy.multi_process
        outputs = executor.run(self._state, self._strategy.global_batch(padded))
        results = []
        for output in outputs:
            if multi_process:  # this process's examples: its devices' shards, in order
                shards = sorted(output.addressable_shards, key=lambda s: s.index[0].start or 0)
                output = np.concatenate([np.asarray(s.data) for s in shards])
            results.append(np.asarray(output)[:count])
        return results

    def predict(self, x: Any, *, batch_size: int | None = None, spec: Any = None) -> Any:
        """The model's predictions (eval mode) as numpy, for every example exactly once.

        Args:
          x: the model's inputs: an array, a list of arrays (one per model input, the same
            first dimension), or a `Dataset` (its batches' inputs; labels are ignored; it is
            reset first).
          batch_size: examples per compiled call (default 256, or the whole input when
            smaller), rounded up to a multiple of the device count; the last batch is padded
            and the padding's predictions dropped, so each batch size compiles once. Ignored
            for a `Dataset`, whose batches are predicted as they come (each padded to the
            device count).
          spec: the spec passed to the model (ignored for a `Dataset`, whose batches carry
            theirs).

        Returns:
          A numpy array of predictions, or a list of arrays when the model returns several.

        Raises:
          RuntimeError: the trainer has no state yet (no step, restore or init_params).
          ValueError: inputs with different first dimensions, or a bad batch_size.
        """
        if self._state is None:
            raise RuntimeError(
                "predict needs the model's variables: train a step first, or restore a "
                "checkpoint (hooks.checkpoint), or give init_params= to the Trainer"
            )
        devices = self._strategy.local_devices
        if is_dataset(x):
            parts = self._predict_dataset(x, devices)
        else:
            inputs = [np.asarray(a) for a in as_list(x)]
            sizes = {int(a.shape[0]) for a in inputs}
            if len(sizes) != 1:
                raise ValueError(
                    f"predict got inputs with different first dimensions {sorted(sizes)}; every "
                    "input needs one row per example"
                )
            total = sizes.pop()
            if batch_size is None:
                batch_size = min(DEFAULT_BATCH_SIZE, max(total, 1))
            if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
                raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
            size = math.ceil(batch_size / devices) * devices
            parts = [
                self._predict_batch(spec, [a[start : start + size] for a in inputs], size)
                for start in range(0, total, size)
            ]
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

    def _predict_dataset(self, dataset: Any, devices: int) -> list[list[np.ndarray]]:
        dataset.reset()
        parts = []
        for batch_spec, inputs, _ in read_batches(dataset, "prediction"):
            inputs = [np.asarray(a) for a in as_list(inputs)]
            size = math.ceil(int(inputs[0].shape[0]) / devices) * devices
            parts.append(self._predict_batch(batch_spec, inputs, size))
        return parts
