"""The plot hook's figures: one per metric type, one colour per dataset, the best step marked.

matplotlib is imported inside `draw_figures` only (see `_plot.py` for why).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from typing import Any

from ._points import Point

ACCURACY_TYPE = "accuracy"
TRAIN_GROUP = "train"
# matplotlib's tab10, by name: the train series take the first; each evaluated dataset the
# next in the order it was first plotted (wrapping after nine datasets). Fixed here, not the
# axes' property cycle, which restarts in every figure (and follows the user's rcParams).
TRAIN_COLOR = "#1f77b4"
EVAL_COLORS = (
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#bcbd22",
    "#17becf",
    "#7f7f7f",
)
BEST_COLOR = "#000000"  # in no dataset's colour: the best step is not a series
BEST_LINE_LABEL = "best"  # the vertical line's label starts with it
BEST_POINT_LABEL = "_best point"  # "_": matplotlib leaves it out of the legend
# Within one figure, a dataset's second, third... series (e.g. the batch loss and its moving
# average) differ by line style, their colour staying the dataset's.
_TRAIN_STYLES = ("-", "-.", ":", (0, (5, 1)))
_EVAL_MARKERS = ("o", "s", "^", "D")
_FOCUS_MARGIN = 0.05  # of the focused value range, on each side


@dataclasses.dataclass(frozen=True)
class BestMetric:
    """The metric whose best step the plots mark.

    Attributes:
      metric: its key (`"eval/test/Accuracy"`).
      mode: `"min"` or `"max"`: which value is best.
    """

    metric: str
    mode: str


def series_group(key: str, dataset: str | None) -> str:
    """The colour group of a series: `"train"`, or `"eval/<dataset>"` for an evaluation."""
    if key.startswith("train/"):
        return TRAIN_GROUP
    if dataset is not None:
        return f"eval/{dataset}"
    return key.rsplit("/", 1)[0]  # e.g. a metric of another trainer, read back from the file


def group_colors(groups: Mapping[str, str]) -> dict[str, str]:
    """`{group: colour}`: train's own, then the evaluated datasets in `groups`' order."""
    colors = {TRAIN_GROUP: TRAIN_COLOR}
    for group in groups.values():
        if group not in colors:
            colors[group] = EVAL_COLORS[(len(colors) - 1) % len(EVAL_COLORS)]
    return colors


def _file_stem(metric_type: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", metric_type).strip("._") or "metric"


def _best_point(
    series: Mapping[str, list[tuple[int, float]]], best: BestMetric
) -> tuple[int, float] | None:
    """`(step, value)` of the best plotted value of `best.metric` (the earliest on ties)."""
    xy = series.get(best.metric)
    if not xy:
        return None
    sign = 1.0 if best.mode == "min" else -1.0
    return min(xy, key=lambda point: (sign * point[1], point[0]))


def _focused_limits(
    series: Mapping[str, list[tuple[int, float]]], groups: Mapping[str, str]
) -> tuple[float, float] | None:
    """Value limits of a higher-is-better figure: the eval curves' bottom to every curve's top.

    The train curve's early low values would squash the curves that matter; it may run off
    below. The top stays the highest of all, so a train curve above the eval ones (the gap
    that shows overfitting) stays in sight.
    """
    evaluated = [y for key, xy in series.items() if groups[key] != TRAIN_GROUP for _, y in xy]
    if not evaluated:
        return None
    bottom = min(evaluated)
    top = max(y for xy in series.values() for _, y in xy)
    margin = max(_FOCUS_MARGIN * (top - bottom), 0.01 * max(abs(top), abs(bottom)), 1e-6)
    return bottom - margin, top + margin


def _format_best(value: float, metric_type: str) -> str:
    return f"{value:.2%}" if metric_type == ACCURACY_TYPE else f"{value:.4g}"


def best_label(best: BestMetric, point: tuple[int, float], metric_type: str, own: bool) -> str:
    """The best step's legend entry: with the value in the metric's own figure.

    In its own figure: `best eval/val/mean_loss 0.0323 (step 1300)`. In the others, whose
    axes show another metric, the step and the metric that chose it, without its value:
    `best step 1300 (lowest eval/val/mean_loss)`.
    """
    step, value = point
    if own:
        return f"{BEST_LINE_LABEL} {best.metric} {_format_best(value, metric_type)} (step {step})"
    chosen_by = "lowest" if best.mode == "min" else "highest"
    return f"{BEST_LINE_LABEL} step {step} ({chosen_by} {best.metric})"


def _mark_best(
    axes: Any,
    best: BestMetric,
    point: tuple[int, float],
    metric_type: str,
    star_color: str | None,
) -> None:
    """The best step's vertical line; with `star_color` (its own figure), a star on its point."""
    step, value = point
    axes.axvline(
        step,
        color=BEST_COLOR,
        linestyle=":",
        linewidth=1.2,
        label=best_label(best, point, metric_type, own=star_color is not None),
    )
    if star_color is not None:
        axes.plot(
            [step],
            [value],
            linestyle="none",
            marker="*",
            markersize=15,
            markerfacecolor=star_color,
            markeredgecolor=BEST_COLOR,
            label=BEST_POINT_LABEL,
            zorder=3,
        )


def draw_figures(
    points: list[Point], groups: Mapping[str, str], best: BestMetric | None
) -> dict[str, Any]:
    """`{metric type: matplotlib Figure}` of `points`, drawn as `Plotter.figures` documents.

    Args:
      points: the metric points.
      groups: `{metric key: series_group(...)}` of every key in `points`, in the order the
        keys were first plotted (it orders the datasets' colours).
      best: the metric whose best step is marked, or None for no mark.
    """
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
    for series in by_type.values():
        for key, xy in series.items():
            series[key] = sorted(dict(xy).items())  # one value per step, the last written wins
    groups = dict(groups)  # its order first: it orders the colours
    for series in by_type.values():
        for key in series:
            groups.setdefault(key, series_group(key, None))
    colors = group_colors(groups)
    best_type = next((t for t, s in by_type.items() if best and best.metric in s), None)
    best_point = _best_point(by_type[best_type], best) if best and best_type else None
    higher_is_better = {ACCURACY_TYPE}
    if best and best_type and best.mode == "max":
        higher_is_better.add(best_type)

    figures = {}
    for metric_type, series in sorted(by_type.items()):
        figure = Figure(figsize=(9, 5.5), dpi=100, layout="constrained")
        axes = figure.subplots()
        drawn: dict[str, int] = {}  # group -> series drawn in this figure
        for key in sorted(series, key=lambda k: (groups[k] != TRAIN_GROUP, k)):
            group = groups[key]
            index = drawn[group] = drawn.get(group, -1) + 1
            steps, ys = zip(*series[key], strict=True)
            if group == TRAIN_GROUP:
                style = _TRAIN_STYLES[index % len(_TRAIN_STYLES)]
                line: dict[str, Any] = {"linestyle": style, "marker": ".", "linewidth": 1.8}
            else:
                marker = _EVAL_MARKERS[index % len(_EVAL_MARKERS)]
                line = {"linestyle": "--", "marker": marker, "markersize": 4, "linewidth": 1.5}
            axes.plot(steps, ys, color=colors[group], label=key, **line)
        if best and best_point is not None:
            on_its_series = colors[groups[best.metric]] if metric_type == best_type else None
            _mark_best(axes, best, best_point, best_type or "", on_its_series)
        drawn_steps = {step for xy in series.values() for step, _ in xy}
        if len(drawn_steps) == 1 and min(drawn_steps) > 0:
            # One step (a first evaluation's): matplotlib's log autoscaling of one point with
            # the best step's line on it can find no width (at a power of ten) and warns.
            axes.set_xlim(min(drawn_steps) / 2, min(drawn_steps) * 2)
        axes.set_xscale("log")
        axes.xaxis.set_major_formatter(FuncFormatter(lambda step, _: f"{step:,.0f}"))
        values = [y for xy in series.values() for _, y in xy]
        limits = _focused_limits(series, groups) if metric_type in higher_is_better else None
        if limits is not None:
            axes.set_ylim(*limits)
        elif metric_type != ACCURACY_TYPE and min(values) > 0 and max(values) / min(values) > 100:
            axes.set_yscale("log")
        if metric_type == ACCURACY_TYPE:
            axes.yaxis.set_major_formatter(PercentFormatter(1.0))
        axes.set_xlabel("global step (log scale)")
        axes.set_ylabel(metric_type)
        last_step = max(step for xy in series.values() for step, _ in xy)
        axes.set_title(f"{metric_type} (up to step {last_step})")
        axes.grid(True, which="major", alpha=0.5)
        axes.grid(True, which="minor", alpha=0.15)
        axes.legend(loc="best", fontsize="small")
        figures[metric_type] = figure
    return figures


def save_pngs(figures: Mapping[str, Any], directory: str) -> list[str]:
    """Writes each figure to `<directory>/<metric type>.png` atomically; returns the paths."""
    paths = []
    for metric_type, figure in figures.items():
        path = os.path.join(directory, _file_stem(metric_type) + ".png")
        temporary = path + ".tmp.png"
        figure.savefig(temporary, format="png")
        os.replace(temporary, path)  # atomic: a viewer never sees half a PNG
        paths.append(path)
    return paths
