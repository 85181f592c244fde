"""Periodic evaluation shared by every hook, and the GoMLX-style evaluation report.

Evaluations are stored in `loop.shared_data`, so that TensorBoard, plots, metrics logs and the
checkpoint's best-metric retention reuse them and each dataset is evaluated at most once per
step, whichever hook asks first:

- `loop.shared_data["eval"]`: `{dataset name: {eval metric name: float}}`, the results at
- `loop.shared_data["eval_step"]`: the trainer's `global_step` when they were computed. When a
  hook evaluates at a new global step, `"eval"` is replaced by a fresh dict.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from ..trainer._hooks import Priority
from ._metric_info import eval_metric_infos, is_writer_process
from ._triggers import every_n_steps as _every_n_steps
from ._triggers import n_times_during_loop as _n_times_during_loop

EVAL_KEY = "eval"
EVAL_STEP_KEY = "eval_step"


def _dataset_name(dataset: Any) -> str:
    name = getattr(dataset, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(
            f"dataset {dataset!r} needs a non-empty str `name` so its results can be stored and "
            "shown under it; e.g. ArrayDataset(..., name='test')"
        )
    return name


def check_datasets(datasets: Any, argument: str = "datasets") -> tuple[Any, ...]:
    """Returns `datasets` as a tuple of datasets with unique names.

    Accepts one dataset or a sequence of them.

    Raises:
      TypeError: an element has no `yield_batch`/`reset`.
      ValueError: a dataset has no name, or two share one.
    """
    if hasattr(datasets, "yield_batch"):
        datasets = (datasets,)
    datasets = tuple(datasets)
    names: list[str] = []
    for dataset in datasets:
        if not all(callable(getattr(dataset, method, None)) for method in ("yield_batch", "reset")):
            raise TypeError(
                f"{argument} must hold loopax datasets (with yield_batch() and reset()), got "
                f"{type(dataset).__name__}"
            )
        name = _dataset_name(dataset)
        if name in names:
            raise ValueError(
                f"two {argument} are named {name!r}; results are stored by dataset name, so give "
                "each dataset a unique name"
            )
        names.append(name)
    return datasets


def evaluate_once(loop: Any, dataset: Any) -> dict[str, float]:
    """Evaluates `dataset` at the current global step, or returns the stored results.

    Args:
      loop: the `loopax.Loop`.
      dataset: a dataset with a `name`.

    Returns:
      `{eval metric name: float}`, also stored in `loop.shared_data["eval"][dataset.name]`.
    """
    shared = loop.shared_data
    global_step = loop.trainer.global_step
    if shared.get(EVAL_STEP_KEY) != global_step or not isinstance(shared.get(EVAL_KEY), dict):
        shared[EVAL_KEY] = {}
        shared[EVAL_STEP_KEY] = global_step
    name = _dataset_name(dataset)
    results = shared[EVAL_KEY].get(name)
    if results is None:
        results = loop.trainer.evaluate(dataset)
        shared[EVAL_KEY][name] = results
    return results


class EvalWatcher:
    """Finds evaluations stored in `loop.shared_data` that a writer has not written yet.

    Costs a few dict lookups per call, no device access: writers call it every step.
    """

    def __init__(self) -> None:
        self._step: int | None = None
        self._seen: set[str] = set()

    def new_results(self, loop: Any) -> tuple[int, dict[str, dict[str, float]]]:
        """Returns `(eval_step, {dataset name: results})` of the results not seen before."""
        shared = loop.shared_data
        step = shared.get(EVAL_STEP_KEY)
        results = shared.get(EVAL_KEY)
        if step is None or not isinstance(results, dict):
            return -1, {}
        if step != self._step:
            self._step, self._seen = step, set()
        if len(results) == len(self._seen):
            return step, {}
        new = {name: values for name, values in results.items() if name not in self._seen}
        self._seen.update(new)
        return step, new


def format_results(trainer: Any, name: str, results: dict[str, float]) -> str:
    """`Results on <name>:` then one `\\t<Name> (<short>): <value>` line per eval metric."""
    lines = [f"Results on {name}:"]
    for info in eval_metric_infos(trainer):
        if info.key in results:
            lines.append(f"\t{info.name} ({info.short_name}): {info.pretty_print(results[info.key])}")
    return "\n".join(lines)


class Evaluator:
    """Evaluates datasets on a schedule; created by `evaluate`.

    Attributes:
      datasets: the datasets evaluated, in order.
      history: `[(global_step, {dataset name: {metric: float}}), ...]`, one entry per
        evaluation this object ran or reused.
    """

    checks_finite_lazily = True

    def __init__(self, datasets: tuple[Any, ...], print_results: bool, file: TextIO | None):
        self.datasets = datasets
        self.print_results = print_results
        self.file = file
        self.history: list[tuple[int, dict[str, dict[str, float]]]] = []

    def __call__(self, loop: Any, metrics: Any = None) -> dict[str, dict[str, float]]:
        """Evaluates every dataset now (reusing results already computed at this step)."""
        del metrics
        results = {_dataset_name(ds): evaluate_once(loop, ds) for ds in self.datasets}
        step = loop.trainer.global_step
        if not self.history or self.history[-1][0] != step:
            self.history.append((step, results))
            if self.print_results and is_writer_process():
                text = "\n".join(format_results(loop.trainer, n, r) for n, r in results.items())
                print(f"Step {step}:\n{text}", file=self.file or sys.stdout, flush=True)
        return results


def evaluate(
    loop: Any,
    datasets: Any,
    *,
    every_n_steps: int | None = None,
    n_times: int | None = None,
    call_on_end: bool = True,
    print_results: bool = False,
    file: TextIO | None = None,
    priority: int = Priority.EVALUATE,
) -> Evaluator:
    """Evaluates `datasets` periodically with `trainer.evaluate`, sharing the results.

    Results go to `loop.shared_data["eval"][dataset.name]` (`{metric name: float}`) with
    `loop.shared_data["eval_step"]` the global step they belong to; TensorBoard, plots, metrics
    logs and best-checkpoint retention read them there, and any hook that evaluates the same
    dataset at the same step reuses them instead of evaluating again. Runs in the `EVALUATE`
    priority band, before checkpoints and logs of the same step. Every process evaluates (it is
    a collective computation); only process 0 prints.

    Args:
      loop: the `loopax.Loop`.
      datasets: one dataset or a sequence of them, each with a unique `name`.
      every_n_steps: evaluate after step k iff `(k + 1) % every_n_steps == 0`.
      n_times: evaluate this many times per run, evenly, the last step included.
      call_on_end: also evaluate at the end of every run (reusing the last step's results
        when an evaluation already ran there).
      print_results: print each evaluation in the `report_eval` format.
      file: where to print (default `sys.stdout`).
      priority: the hooks' priority.

    Returns:
      The `Evaluator`; its `history` holds every evaluation.

    Raises:
      ValueError: no schedule (`every_n_steps`, `n_times` and `call_on_end` all unset), a bad
        `every_n_steps`/`n_times`, or datasets without unique names.
      TypeError: an element of `datasets` is not a dataset.

    Example:
      >>> import jax, numpy as np, optax, flax.linen as nn, loopax
      >>> trainer = loopax.Trainer(lambda ctx, spec, x: nn.Dense(1)(x[0]),
      ...     loopax.losses.mean_squared_error, optax.sgd(0.1), devices=jax.devices()[:1])
      >>> x, y = np.ones((8, 2), np.float32), np.ones((8, 1), np.float32)
      >>> train = loopax.ArrayDataset(x, y, batch_size=4, loop_forever=True)
      >>> test = loopax.ArrayDataset(x, y, batch_size=4, name="test", shuffle=False)
      >>> loop = loopax.Loop(trainer)
      >>> evaluator = loopax.hooks.evaluate(loop, test, every_n_steps=2)
      >>> _ = loop.run_steps(train, 4)
      >>> [step for step, _ in evaluator.history], sorted(loop.shared_data["eval"])
      ([2, 4], ['test'])
    """
    datasets = check_datasets(datasets)
    if not datasets:
        raise ValueError("evaluate needs at least one dataset to evaluate")
    if every_n_steps is None and n_times is None and not call_on_end:
        raise ValueError(
            "evaluate has no schedule: pass every_n_steps=..., n_times=... or call_on_end=True"
        )
    evaluator = Evaluator(datasets, print_results, file)
    names = ", ".join(_dataset_name(ds) for ds in datasets)
    hook_name = f"evaluate({names})"
    if every_n_steps is not None:
        _every_n_steps(loop, every_n_steps, hook_name, evaluator, priority=priority)
    if n_times is not None:
        _n_times_during_loop(loop, n_times, hook_name, evaluator, priority=priority)
    if call_on_end:
        loop.on_end(hook_name, evaluator, priority=priority)
    return evaluator


def report_eval(trainer: Any, *datasets: Any, file: TextIO | None = None) -> dict[str, dict[str, float]]:
    """Evaluates each dataset and prints the results in GoMLX's format.

    Per dataset: `Results on <name>:` then one `\\t<Name> (<short>): <value>` line per eval
    metric (e.g. `\\tMean Loss (#loss): 0.123`, `\\tAccuracy (acc): 93.41%`); then the dataset
    is reset. Every process evaluates; only process 0 prints.

    Args:
      trainer: the `loopax.Trainer`.
      *datasets: datasets with unique names.
      file: where to print (default `sys.stdout`).

    Returns:
      `{dataset name: {eval metric name: float}}`.

    Raises:
      ValueError: datasets without unique names, or a dataset with no batch.
    """
    datasets = check_datasets(datasets)
    all_results: dict[str, dict[str, float]] = {}
    for dataset in datasets:
        name = _dataset_name(dataset)
        results = trainer.evaluate(dataset)
        dataset.reset()
        all_results[name] = results
        if is_writer_process():
            print(format_results(trainer, name, results), file=file or sys.stdout, flush=True)
    return all_results
