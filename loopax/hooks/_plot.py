"""`plot`: metric points in a JSON-lines file and PNG plots of them, curves continued on resume.

matplotlib is an optional dependency (`pip install loopax[plot]`): it is imported only when a
plot is rendered, and checked when the hook is attached.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import math
import os
import re
from collections.abc import Mapping
from typing import Any

from .. import _validate
from ..loop import Loop, Priority
from ..trainer import Trainer
from ._evaluate import EVALUATED_DATASETS, check_datasets
from ._metric_info import is_writer_process
from ._points import Point, PointsFile, points_of
from ._schedules import Exponential
from ._triggers import on_schedule
from ._writers import MetricWriter, write_metrics

POINTS_FILE_NAME = "plot_points.jsonl"
_ACCURACY_TYPE = "accuracy"
_TRAIN_PREFIX = "train/"


def _require_matplotlib() -> None:
    # Found, not imported: importing matplotlib takes ~0.5 s, which a resumed process would
    # wait for before its first step; the render thread imports it when it first draws.
    if importlib.util.find_spec("matplotlib") is None:
        raise ImportError(
            "loopax.hooks.plot renders PNGs with matplotlib, which is not installed; install it "
            "with `pip install loopax[plot]` (or pass render=False to only write the points)"
        )


def _file_stem(metric_type: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", metric_type).strip("._") or "metric"


def render_plots(points: list[Point], directory: str) -> list[str]:
    """Renders one PNG per metric type (`<directory>/<type>.png`); returns their paths.

    Train series are solid lines, eval series dashed with markers; the step axis is
    log-scaled; accuracies are shown in percent, and a loss spanning more than two orders of
    magnitude gets a log-scaled value axis.
    """
    _require_matplotlib()
    # The object-oriented API only: no pyplot, so no GUI backend and no global figure state.
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, PercentFormatter

    by_type: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for point in points:
        step, value = int(point["step"]), float(point["value"])
        if step <= 0 or not math.isfinite(value):
            continue  # a log-scaled step axis has no room for step 0
        series = by_type.setdefault(str(point.get("type", "")), {})
        series.setdefault(str(point["metric"]), []).append((step, value))
    paths = []
    for metric_type, series in sorted(by_type.items()):
        figure = Figure(figsize=(9, 5.5), dpi=100, layout="constrained")
        axes = figure.subplots()
        values = []
        train_first = sorted(
            series.items(), key=lambda item: (not item[0].startswith(_TRAIN_PREFIX), item[0])
        )
        for name, xy in train_first:
            xy = sorted(dict(xy).items())  # one value per step, the last written wins
            steps, ys = zip(*xy, strict=True)
            values += ys
            if name.startswith(_TRAIN_PREFIX):
                axes.plot(steps, ys, "-", marker=".", linewidth=1.8, label=name)
            else:
                axes.plot(steps, ys, "--", marker="o", markersize=4, linewidth=1.5, label=name)
        axes.set_xscale("log")
        axes.xaxis.set_major_formatter(FuncFormatter(lambda step, _: f"{step:,.0f}"))
        if metric_type == _ACCURACY_TYPE:
            axes.yaxis.set_major_formatter(PercentFormatter(1.0))
        elif min(values) > 0 and max(values) / min(values) > 100:
            axes.set_yscale("log")
        axes.set_xlabel("global step (log scale)")
        axes.set_ylabel(metric_type)
        last_step = max(step for xy in series.values() for step, _ in xy)
        axes.set_title(f"{metric_type} (up to step {last_step})")
        axes.grid(True, which="major", alpha=0.5)
        axes.grid(True, which="minor", alpha=0.15)
        axes.legend(loc="best", fontsize="small")
        path = os.path.join(directory, _file_stem(metric_type) + ".png")
        temporary = path + ".tmp.png"
        figure.savefig(temporary, format="png")
        os.replace(temporary, path)  # atomic: a viewer never sees half a PNG
        paths.append(path)
    return paths


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
        self._renderer: concurrent.futures.ThreadPoolExecutor | None = None
        self._renders: list[concurrent.futures.Future] = []
        self._render_generation = 0

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        points = points_of(self.trainer, step, scalars)
        if not points:
            return
        self._file.append(points)
        self.points += points
        if self.render_pngs:
            self._request_render()

    def truncate_after(self, step: int) -> None:
        self.points = self._file.truncate_after(step)

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
        self._renders.append(
            self._renderer.submit(self._render_task, self._render_generation, list(self.points))
        )

    def _render_task(self, generation: int, points: list[Point]) -> None:
        if generation != self._render_generation:
            return  # superseded by a newer request: render only the latest points
        self.png_paths = render_plots(points, self.directory)

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

    def render(self) -> list[str]:
        """Renders the PNGs of all points now, in this thread; returns their paths."""
        self.flush()
        self.png_paths = render_plots(self.points, self.directory)
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
