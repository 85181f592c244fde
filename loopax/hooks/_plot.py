"""`plot`: metric points in a JSON-lines file and PNG plots of them, curves continued on resume.

matplotlib is an optional dependency (`pip install loopax[plot]`): it is imported only when a
plot is rendered, and checked when the hook is attached.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
from collections.abc import Mapping
from typing import Any

from .. import _validate
from ..loop import Loop, Priority
from ..trainer import Trainer
from ._checkpointing._checkpointer import CHECKPOINTERS
from ._early_stopping import EARLY_STOPPERS
from ._evaluate import EVALUATED_DATASETS, check_datasets
from ._metric_info import is_writer_process, split_eval_key
from ._monitor import resolve_mode
from ._plot_figures import BestMetric, draw_figures, save_pngs, series_group
from ._points import Point, PointsFile, points_of
from ._schedules import Exponential
from ._triggers import on_schedule
from ._writers import MetricWriter, write_metrics

POINTS_FILE_NAME = "plot_points.jsonl"


def _require_matplotlib() -> None:
    # Found, not imported: importing matplotlib takes ~0.5 s, which a resumed process would
    # wait for before its first step; the render thread imports it when it first draws.
    if importlib.util.find_spec("matplotlib") is None:
        raise ImportError(
            "loopax.hooks.plot renders PNGs with matplotlib, which is not installed; install it "
            "with `pip install loopax[plot]` (or pass render=False to only write the points)"
        )


def _best_metric_of_hooks(loop: Loop) -> BestMetric | None:
    """The metric the loop's hooks call best: a checkpoint's `best_metric`, else a monitor.

    The monitor is early stopping's; None when neither hook is attached.
    """
    for checkpointer in loop.shared_data.get(CHECKPOINTERS, []):
        if checkpointer.best_metric is not None:
            return BestMetric(checkpointer.best_metric, checkpointer.best_mode)
    for stopper in loop.shared_data.get(EARLY_STOPPERS, []):
        return BestMetric(stopper.monitor, stopper.mode)
    return None


# loop.shared_data key: the loop's plot hooks (hooks.mlflow logs their PNGs).
PLOTTERS = "loopax.plotters"


class Plotter(MetricWriter):
    """Collects metric points and renders them; created by `plot`.

    Attributes:
      directory: where the points file and the PNGs are.
      points_path: the JSON-lines file of points.
      points: every point so far, those of earlier runs in the directory included.
      png_paths: the PNGs written by the last render.

    PNGs render in a background thread (matplotlib takes a fraction of a second per figure),
    the latest points superseding a render not yet started; `flush()` (at the end of each
    run) waits for it.
    """

    points_path: str

    def __init__(self, directory: str, trainer: Trainer, render: bool):
        self.directory = directory
        self.trainer = trainer
        self.render_pngs = render
        self.points_path = os.path.join(directory, POINTS_FILE_NAME)
        self._file = PointsFile(self.points_path, "jsonl")
        self.points: list[Point] = self._file.read()
        self.png_paths: list[str] = []
        self._groups: dict[str, str] = {}  # metric key -> colour group, in order of appearance
        self._group_points(self.points)
        self._hooks_best: BestMetric | None = None  # read from the loop at each run's start
        self._renderer: concurrent.futures.ThreadPoolExecutor | None = None
        self._renders: list[concurrent.futures.Future] = []
        self._render_generation = 0

    def _group_points(self, points: list[Point]) -> None:
        for point in points:
            key = str(point["metric"])
            if key not in self._groups:
                found = split_eval_key(self.trainer, key)
                self._groups[key] = series_group(key, None if found is None else found[0])

    def _best_metric(self) -> BestMetric | None:
        """The hooks' choice, else the first eval metric (`mean_loss`) of the first dataset."""
        if self._hooks_best is not None:
            return self._hooks_best
        first = next((g for g in self._groups.values() if g.startswith("eval/")), None)
        if first is None:
            return None
        key = f"{first}/{self.trainer.eval_metric_names[0]}"
        try:
            mode = resolve_mode(self.trainer, key, "auto", "plot")
        except ValueError:
            return None  # neither a loss nor an accuracy: no telling which value is best
        return BestMetric(key, mode)

    def on_start(self, loop: Loop, dataset: Any) -> None:
        """Reads from the loop's hooks which metric's best step to mark (see `plot`)."""
        del dataset
        self._hooks_best = _best_metric_of_hooks(loop)

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        points = points_of(self.trainer, step, scalars)
        if not points:
            return
        self._file.append(points)
        self.points += points
        self._group_points(points)
        if self.render_pngs:
            self._request_render()

    def truncate_after(self, step: int) -> None:
        self.points = self._file.truncate_after(step)
        self._groups = {}
        self._group_points(self.points)

    def flush_async(self) -> Any:
        """The points are in their file as soon as they are written: nothing to wait for."""
        self._check_renders(wait=False)
        return lambda: None

    def flush(self) -> None:
        """Waits until the PNGs of the points so far are written."""
        self._check_renders(wait=True)

    def _request_render(self) -> None:
        self._check_renders(wait=False)
        if self._renderer is None:
            self._renderer = concurrent.futures.ThreadPoolExecutor(1, "loopax-plot")
        self._render_generation += 1
        drawing = (list(self.points), dict(self._groups), self._best_metric())
        self._renders.append(
            self._renderer.submit(self._render_task, self._render_generation, drawing)
        )

    def _render_task(self, generation: int, drawing: tuple) -> None:
        if generation != self._render_generation:
            return  # superseded by a newer request: render only the latest points
        self.png_paths = save_pngs(draw_figures(*drawing), self.directory)

    def _check_renders(self, wait: bool) -> None:
        """Raises the first render error; with `wait`, waits for every pending render."""
        pending = []
        for future in self._renders:
            if wait or future.done():
                future.result()
            else:
                pending.append(future)
        self._renders = pending

    wait = flush

    def figures(self) -> dict[str, Any]:
        """The figures of all points so far, as the PNGs show them (e.g. for a notebook).

        One `matplotlib.figure.Figure` per metric type; `plot` documents what they draw.

        Returns:
          `{metric type: Figure}` (`"loss"`, `"accuracy"`, ...).

        Raises:
          ImportError: matplotlib is not installed (`pip install loopax[plot]`).
        """
        _require_matplotlib()
        return draw_figures(list(self.points), dict(self._groups), self._best_metric())

    def render(self) -> list[str]:
        """Renders the PNGs of all points now, in this thread; returns their paths."""
        self.flush()
        self.png_paths = save_pngs(self.figures(), self.directory)
        return self.png_paths


class _OwnEvaluations:
    """Evaluates the plot's datasets that no `hooks.evaluate` covers, on the plot's steps."""

    def __init__(self, datasets: tuple[Any, ...]):
        self.datasets = datasets
        self.own: tuple[Any, ...] = datasets

    def on_start(self, loop: Loop, dataset: Any) -> None:
        del dataset
        covered = loop.shared_data.get(EVALUATED_DATASETS, set())
        self.own = tuple(ds for ds in self.datasets if ds.name not in covered)

    def __call__(self, loop: Loop, metrics: Any) -> None:
        del metrics
        for dataset in self.own:
            loop.evaluate(dataset)


def plot(
    loop: Loop,
    directory: str | os.PathLike[str],
    *,
    eval_datasets: Any = (),
    start_step: int = 10,
    factor: float = 1.2,
    render: bool = True,
    priority: int = Priority.LOG,
) -> Plotter:
    """Plots train and eval metrics on an exponential schedule: dense early, sparse later.

    At the steps of `Exponential(start_step, factor)` and at the end of every run it writes
    the train metrics; every evaluation published on the loop is plotted too. The datasets
    of `eval_datasets` are evaluated on the plot's steps only when no `hooks.evaluate`
    covers them (otherwise its scheduled evaluations are the ones plotted). Points are
    appended to `<directory>/plot_points.jsonl` as JSON lines `{"metric", "short", "type",
    "step", "value"}`, `metric` being the key every writer and `loop.history` use
    (`train/loss`, `eval/test/Accuracy`); one PNG per metric type (`loss.png`,
    `accuracy.png`, ...) shows train and eval series on a log-scaled step axis. Resuming
    into the same directory continues the curves (points of the steps that run again are
    dropped first). Only process 0 writes; every process evaluates.

    What the figures show (`Plotter.figures()` returns them):

    - One colour per dataset in every figure: the train series blue, each evaluated dataset
      its own colour (orange, green, red, ... in the order its first points came), the same
      in the loss, the accuracy and every other figure. A dataset's several series in one
      figure (the batch loss and its moving average) differ by line style and marker.
    - Train series solid, eval series dashed with markers. A loss spanning more than two
      orders of magnitude gets a log-scaled value axis.
    - Accuracies in percent, their value axis focused: from the lowest value of the eval
      curves to the highest of all curves, with a 5% margin, so the train curve's low first
      values run off below instead of squashing the eval curves. The same holds for the
      figure of the metric marked best (below) when higher is better for it.
    - The best step: a dotted black vertical line in every figure, and a star on that point
      in its own figure. There it is labelled with the metric, its best value and step
      (`best eval/val/mean_loss 0.0323 (step 1300)`); in the other figures with the step
      and the metric that chose it (`best step 1300 (lowest eval/val/mean_loss)`). The metric is
      the `best_metric` of a `hooks.checkpoint` (with its `best_mode`), else the `monitor`
      of a `hooks.early_stopping` (with its `mode`), as attached when a run starts, else
      the first eval metric (`mean_loss`, lower is better) of the first dataset evaluated.
      The step is that of its best plotted value (the earliest on ties): as the plot holds
      every evaluation, early stopping's `best_step` when its `min_delta` is 0, while the
      checkpoint hook's best checkpoint is the best of the steps it saved.

    Args:
      loop: the `loopax.Loop`.
      directory: where to write the points and PNGs (created).
      eval_datasets: one dataset or a sequence of them, each with a unique `name`.
      start_step: the first step plotted and the first gap of the schedule.
      factor: how much the gap between plotted steps grows each time (> 1).
      render: render PNGs (needs matplotlib); False only writes the points.
      priority: the hooks' priority (default `Priority.LOG`: after evaluations).

    Returns:
      The `Plotter`.

    Raises:
      ImportError: `render` is True and matplotlib is not installed (`pip install loopax[plot]`).
      ValueError: bad `start_step`/`factor`, or eval datasets without unique names.
    """
    eval_datasets = check_datasets(eval_datasets, "eval_datasets")
    schedule = Exponential(start_step, factor)
    if render:
        _require_matplotlib()
    directory = _validate.path("directory", directory, "plot: ")
    plotter = Plotter(directory, loop.trainer, render)
    loop.shared_data.setdefault(PLOTTERS, []).append(plotter)  # e.g. for hooks.mlflow
    name = f"plot({directory})"
    # At each start: a checkpoint or early stopping hook attached after this one counts too.
    loop.on_start(f"{name}: best metric", plotter.on_start, priority)
    if eval_datasets:
        own = _OwnEvaluations(eval_datasets)
        loop.on_start(f"{name}: evaluations", own.on_start, Priority.EVALUATE)
        on_schedule(
            loop,
            Exponential(start_step, factor),
            f"{name}: evaluate",
            own,
            call_on_end=True,
            priority=Priority.EVALUATE,
        )
    if is_writer_process():
        os.makedirs(directory, exist_ok=True)
    write_metrics(loop, plotter, when=schedule, name=name, priority=priority)
    return plotter
