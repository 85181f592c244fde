"""Scheduled evaluation, and the GoMLX-style evaluation report.

`evaluate` runs `loop.evaluate(dataset)` on a schedule: each dataset is evaluated at most
once per global step whoever asks, and each evaluation is published once, as an
`Evaluation` record, to every OnEvaluation hook (TensorBoard, metrics_log, plot, early
stopping, plateau) and into `loop.history` (`"eval/<dataset>/<metric>"`).
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from ..loop import Evaluation, Loop, Priority
from ..loop._internal import dataset_name, reads_a_copy
from ..trainer import Trainer
from ._metric_info import eval_metric_infos, is_writer_process
from ._schedules import EveryNEpochs, EveryNSteps, NTimes
from ._triggers import at_run_end, on_schedule

# `loop.shared_data` key: the names of the datasets an `evaluate` hook evaluates on a schedule
# (a plot then uses those evaluations instead of running its own).
EVALUATED_DATASETS = "evaluated_datasets"


def check_datasets(
    datasets: Any, argument: str = "datasets", *, unique: bool = True
) -> tuple[Any, ...]:
    """Returns `datasets` as a tuple of datasets with unique names.

    Accepts one dataset, or a list or tuple of them. With `unique=False` two may share a
    name.

    Raises:
      TypeError: an element has no `yield_batch`/`reset`.
      ValueError: a dataset has no name, or (with `unique`) two share one.
    """
    # Only a list or a tuple holds several: anything else (a grain dataset too) is one.
    if not isinstance(datasets, (list, tuple)):
        datasets = (datasets,)
    datasets = tuple(datasets)
    names: list[str] = []
    for dataset in datasets:
        if not all(callable(getattr(dataset, method, None)) for method in ("yield_batch", "reset")):
            raise TypeError(
                f"{argument} must hold loopax datasets (with yield_batch() and reset()), got "
                f"{type(dataset).__name__}; give an iterable of batches (a grain dataset, a "
                "list of batches) its name with loopax.IterableDataset(batches, name='test')"
            )
        name = dataset_name(dataset)
        if unique and name in names:
            raise ValueError(
                f"two {argument} are named {name!r}; results are stored by dataset name, so give "
                "each dataset a unique name"
            )
        names.append(name)
    return datasets


def format_results(trainer: Trainer, name: str, results: dict[str, float]) -> str:
    r"""`Results on <name>:` then one `\t<Name> (<short>): <value>` line per eval metric."""
    lines = [f"Results on {name}:"]
    for info in eval_metric_infos(trainer):
        if info.key in results:
            lines.append(
                f"\t{info.name} ({info.short_name}): {info.pretty_print(results[info.key])}"
            )
    return "\n".join(lines)


class Evaluator:
    """Evaluates datasets on a schedule; created by `evaluate`.

    Attributes:
      datasets: the datasets evaluated, in order.
      history: `[(global_step, {dataset name: {metric: float}}), ...]`, one entry per step
        this object evaluated at.
    """

    def __init__(self, datasets: tuple[Any, ...], print_results: bool, file: TextIO | None):
        self.datasets = datasets
        self.print_results = print_results
        self.file = file
        self.history: list[tuple[int, dict[str, dict[str, float]]]] = []

    def __call__(self, loop: Loop, metrics: Any = None) -> dict[str, Evaluation]:
        """Evaluates every dataset now (each at most once per global step)."""
        del metrics
        evaluations = {dataset_name(ds): loop.evaluate(ds) for ds in self.datasets}
        step = loop.trainer.global_step
        if not self.history or self.history[-1][0] != step:
            self.history.append((step, {n: dict(e.values) for n, e in evaluations.items()}))
            if self.print_results and is_writer_process():
                text = "\n".join(
                    format_results(loop.trainer, n, dict(e.values)) for n, e in evaluations.items()
                )
                print(f"Step {step}:\n{text}", file=self.file or sys.stdout, flush=True)
        return evaluations


def evaluate(
    loop: Loop,
    datasets: Any,
    *,
    every_n_steps: int | None = None,
    n_times: int | None = None,
    every_n_epochs: int | None = None,
    call_on_end: bool = True,
    print_results: bool = False,
    file: TextIO | None = None,
    priority: int = Priority.EVALUATE,
) -> Evaluator:
    """Evaluates `datasets` on a schedule with `loop.evaluate`, publishing each result once.

    Each evaluation is an `Evaluation` record (global step, dataset name, metric values)
    handed to every OnEvaluation hook (TensorBoard, metrics_log, plot, early stopping,
    plateau, ...) and recorded in `loop.history` as `"eval/<dataset>/<metric>"`; the
    checkpoint's best-metric retention reads it there. A dataset is evaluated at most once
    per global step whichever schedule or hook asks. Runs in the `EVALUATE` priority band,
    before checkpoints and logs of the same step. Every process evaluates (it is a
    collective computation); only process 0 prints.

    Args:
      loop: the `loopax.Loop`.
      datasets: one dataset or a sequence of them, each with a unique `name`.
      every_n_steps: evaluate after step k iff `(k + 1) % every_n_steps == 0`.
      n_times: evaluate this many times per run, evenly, the last step included.
      every_n_epochs: evaluate at the end of every n-th epoch of `run_epochs`.
      call_on_end: also evaluate at the end of every run (reusing the last step's results
        when an evaluation already ran there); not at the end of a run SIGINT or SIGTERM
        interrupted (`loop.interrupted`): its resumed run evaluates at its end, so the
        logs, `loop.history` and the monitors (early stopping, plateau) see the
        evaluations an uninterrupted run makes.
      print_results: print each evaluation in the `report_eval` format.
      file: where to print (default `sys.stdout`).
      priority: the hooks' priority.

    Returns:
      The `Evaluator`; its `history` holds every evaluation.

    Raises:
      ValueError: no schedule (all of `every_n_steps`, `n_times`, `every_n_epochs` unset and
        `call_on_end` False), a bad count, or datasets without unique names.
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
      >>> [step for step, _ in evaluator.history]
      [2, 4]
      >>> [step for step, _ in loop.history["eval/test/mean_loss"]]
      [2, 4]
    """
    datasets = check_datasets(datasets)
    if not datasets:
        raise ValueError("evaluate needs at least one dataset to evaluate")
    if every_n_steps is None and n_times is None and every_n_epochs is None and not call_on_end:
        raise ValueError(
            "evaluate has no schedule: pass every_n_steps=..., n_times=..., every_n_epochs=... "
            "or call_on_end=True"
        )
    schedules = [
        schedule(count)
        for schedule, count in (
            (EveryNSteps, every_n_steps),
            (NTimes, n_times),
            (EveryNEpochs, every_n_epochs),
        )
        if count is not None
    ]
    evaluator = Evaluator(datasets, print_results, file)
    hook_name = f"evaluate({', '.join(dataset_name(ds) for ds in datasets)})"
    for schedule in schedules:
        on_schedule(loop, schedule, hook_name, evaluator, priority=priority)
    if call_on_end:
        loop.on_end(hook_name, at_run_end(evaluator), priority=priority, check_finite=False)
    if schedules or call_on_end:
        covered = loop.shared_data.setdefault(EVALUATED_DATASETS, set())
        covered.update(dataset_name(ds) for ds in datasets)
    return evaluator


def report_eval(
    trainer: Trainer, *datasets: Any, file: TextIO | None = None
) -> dict[str, dict[str, float]]:
    r"""Evaluates each dataset and prints the results in GoMLX's format.

    Per dataset: `Results on <name>:` then one `\t<Name> (<short>): <value>` line per eval
    metric (e.g. `\tMean Loss (#loss): 0.123`, `\tAccuracy (acc): 93.41%`). A looping
    `ArrayDataset` (a training set) is evaluated over one pass, every example once, and an
    iterable from its start, neither moving its training position; any other `Dataset` is
    read to its end, then reset. Every process evaluates; only process 0 prints.

    Args:
      trainer: the `loopax.Trainer`.
      *datasets: the datasets; two that share a name are shown and returned as
        `<name>#<position>` (1-based, e.g. `array#1`, `array#2`).
      file: where to print (default `sys.stdout`).

    Returns:
      `{dataset name: {eval metric name: float}}`.

    Raises:
      ValueError: a dataset with no batch.
    """
    datasets = check_datasets(datasets, unique=False)
    names = [dataset_name(dataset) for dataset in datasets]
    all_results: dict[str, dict[str, float]] = {}
    for position, dataset in enumerate(datasets, start=1):
        name = names[position - 1]
        if names.count(name) > 1:  # e.g. two ArrayDatasets left with the default name
            name = f"{name}#{position}"
        results = trainer.evaluate(dataset)
        if not reads_a_copy(dataset):
            dataset.reset()
        all_results[name] = results
        if is_writer_process():
            print(format_results(trainer, name, results), file=file or sys.stdout, flush=True)
    return all_results
