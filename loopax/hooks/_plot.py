"""`plot`: metric points in a JSON-lines file and PNG plots of them, curves continued on resume.

matplotlib is an optional dependency (`pip install loopax[plot]`): it is imported only when a
plot is rendered, and checked when the hook is attached.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import math
import os
import re
from typing import Any

import jax

from ..trainer._hooks import Priority
from ._evaluate import EvalWatcher, check_datasets, evaluate_once
from ._metric_info import is_writer_process
from ._points import Point, PointsFile, eval_points, train_points
from ._triggers import exponential_callback

POINTS_FILE_NAME = "plot_points.jsonl"
_ACCURACY_TYPE = "accuracy"
_TRAIN_PREFIX = "Train: "


def _require_matplotlib() -> None:
    try:
        importlib.import_module("matplotlib")
    except ImportError as err:
        raise ImportError(
            "loopax.hooks.plot renders PNGs with matplotlib, which is not installed; install it "
            "with `pip install loopax[plot]` (or pass render=False to only write the points)"
        ) from err


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
        train_first = sorted(series.items(), key=lambda item: (not item[0].startswith(_TRAIN_PREFIX), item[0]))
        for name, xy in train_first:
            xy = sorted(dict(xy).items())  # one value per step, the last written wins
            steps, ys = zip(*xy)
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


class Plotter:
    """Collects metric points and renders them; created by `plot`.

    Attributes:
      directory: where the points file and the PNGs are.
      points_path: the JSON-lines file of points.
      points: every point so far, those of earlier runs in the directory included.
      trigger: the `ExponentialTrigger` that schedules it.
      png_paths: the PNGs written by the last render.

    PNGs render in a background thread (matplotlib takes a fraction of a second per figure),
    the latest points superseding a render not yet started; the end of each run waits for it.
    """

    checks_finite_lazily = True

    def __init__(self, directory: str, eval_datasets: tuple[Any, ...], render: bool):
        self.directory = directory
        self.eval_datasets = eval_datasets
        self.render_pngs = render
        self.points_path = os.path.join(directory, POINTS_FILE_NAME)
        self.points: list[Point] = []
        self.png_paths: list[str] = []
        self.trigger: Any = None
        self._file = PointsFile(self.points_path, "jsonl")
        self._watcher = EvalWatcher()
        self._run_index: int | None = None
        self._last_train_step = -1
        self._renderer: concurrent.futures.ThreadPoolExecutor | None = None
        self._renders: list[concurrent.futures.Future] = []
        self._render_generation = 0

    def _start_run_if_new(self, loop: Any) -> None:
        if loop.run_index == self._run_index:
            return
        self._run_index = loop.run_index
        # Resuming from a checkpoint: the steps after it run again, so drop their points.
        self.points = self._file.truncate_after(loop.trainer.global_step - 1)

    def _append(self, points: list[Point]) -> None:
        self._file.append(points)
        self.points += points

    def _collect_evaluations(self, loop: Any) -> None:
        step, new = self._watcher.new_results(loop)
        for name, results in new.items():
            self._append(eval_points(loop.trainer, name, results, step))

    def watch(self, loop: Any, metrics: Any) -> None:
        """Every step: records evaluations that other hooks stored (no device access)."""
        del metrics
        self._start_run_if_new(loop)
        self._collect_evaluations(loop)

    def collect(self, loop: Any, metrics: Any) -> None:
        """Records the train metrics, evaluates the eval datasets and renders the PNGs."""
        self._start_run_if_new(loop)
        step = loop.trainer.global_step
        if metrics and step != self._last_train_step:
            self._last_train_step = step
            self._append(train_points(loop.trainer, jax.device_get(metrics), step))
        for dataset in self.eval_datasets:
            evaluate_once(loop, dataset)
        self._collect_evaluations(loop)
        if self.render_pngs:
            self._request_render()

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

    def wait(self, loop: Any = None, metrics: Any = None) -> None:
        """Waits until the PNGs of the points so far are written (an OnEnd hook)."""
        del loop, metrics
        self._check_renders(wait=True)

    def render(self) -> list[str]:
        """Renders the PNGs of all points now, in this thread; returns their paths."""
        self.wait()
        self.png_paths = render_plots(self.points, self.directory)
        return self.png_paths


def plot(
    loop: Any,
    directory: str | os.PathLike,
    *,
    eval_datasets: Any = (),
    start_step: int = 10,
    factor: float = 1.2,
    render: bool = True,
    priority: int = Priority.LOG,
) -> Plotter:
    """Plots train and eval metrics on an exponential schedule: dense early, sparse later.

    At the steps of `exponential_callback(start_step, factor)` and at the end of every run, it
    reads the train metrics, evaluates `eval_datasets` (reusing any evaluation already run at
    that step, e.g. by `evaluate`), appends the points to `<directory>/plot_points.jsonl` and
    renders one PNG per metric type (`loss.png`, `accuracy.png`, ...) with train and eval series
    on a log-scaled step axis. Evaluations that `evaluate` stores at other steps are added to the
    curves too. Points are JSON lines `{"metric", "short", "type", "step", "value"}` with train
    series `Train: <metric>` and eval series `<metric> on <dataset>`; `step` is the global step;
    non-finite values are skipped. Resuming into the same directory continues the curves (points
    of the steps that run again are dropped first). Only process 0 writes; every process
    evaluates.

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
    if render:
        _require_matplotlib()
    directory = os.fspath(directory)
    plotter = Plotter(directory, eval_datasets, render)
    writer = is_writer_process()
    if writer:
        os.makedirs(directory, exist_ok=True)
    # Every process runs the schedule (evaluations are collective); only process 0 writes.
    collect = plotter.collect if writer else _evaluate_only(plotter)
    plotter.trigger = exponential_callback(
        loop, start_step, factor, f"plot({directory})", collect, call_on_end=True, priority=priority
    )
    if writer:
        watch = _LazyHook(plotter.watch)
        loop.on_step(f"plot({directory}): evaluations", watch, priority=priority)
        # Registered after the trigger's OnEnd hook, so it waits for the final render.
        loop.on_end(f"plot({directory}): wait for the PNGs", plotter.wait, priority=priority)
    return plotter


class _LazyHook:
    """Wraps a hook that reads no device value, so the loop does not check the loss before it."""

    checks_finite_lazily = True

    def __init__(self, fn: Any):
        self.fn = fn

    def __call__(self, loop: Any, metrics: Any) -> Any:
        return self.fn(loop, metrics)


def _evaluate_only(plotter: Plotter) -> Any:
    def evaluate_datasets(loop: Any, metrics: Any) -> None:
        del metrics
        for dataset in plotter.eval_datasets:
            evaluate_once(loop, dataset)

    return evaluate_datasets
