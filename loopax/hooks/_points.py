"""Metric points, as the plot and metrics-log hooks write them.

A point is `{"metric": ..., "short": ..., "type": ..., "step": global_step, "value": ...}`;
train series are named `Train: <metric>`, eval series `<metric> on <dataset>`; non-finite values
are skipped (SEMANTICS.md, "Metrics pretty-printing and reports"). `PointsFile` appends them to
a JSON-lines or CSV file and, on resume, drops the points of steps that will be run again.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from typing import Any, Iterable, Mapping

from ._metric_info import eval_metric_infos, train_metric_infos

Point = dict[str, Any]
FIELDS = ("metric", "short", "type", "step", "value")
FORMATS = ("jsonl", "csv")


def train_points(trainer: Any, host_metrics: Mapping[str, Any], step: int) -> list[Point]:
    """Points for the train metrics (host values, keyed as `train_step` returns them)."""
    return _points(train_metric_infos(trainer), host_metrics, step, "Train: {name}", "{short}")


def eval_points(trainer: Any, dataset_name: str, results: Mapping[str, float], step: int) -> list[Point]:
    """Points for one dataset's evaluation results."""
    return _points(
        eval_metric_infos(trainer),
        results,
        step,
        "{name} on " + dataset_name.replace("{", "{{").replace("}", "}}"),
        "{short}",
    )


def _points(infos, values, step: int, name_format: str, short_format: str) -> list[Point]:
    points = []
    for info in infos:
        if info.key not in values:
            continue
        value = float(values[info.key])
        if not math.isfinite(value):
            continue
        points.append({
            "metric": name_format.format(name=info.name),
            "short": short_format.format(short=info.short_name),
            "type": info.metric_type,
            "step": int(step),
            "value": value,
        })
    return points


def format_from_path(path: str, file_format: str | None) -> str:
    """The file format: `file_format` if given, else from the suffix (`.csv` or JSON lines)."""
    if file_format is None:
        file_format = "csv" if str(path).lower().endswith(".csv") else "jsonl"
    if file_format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS} (or None to pick from the file "
                         f"suffix), got {file_format!r}")
    return file_format


class PointsFile:
    """Appends points to a JSON-lines or CSV file; `truncate_after` prepares a resume.

    Args:
      path: the file; its directory is created on the first append.
      file_format: `"jsonl"` or `"csv"`.
    """

    def __init__(self, path: str, file_format: str):
        self.path = os.fspath(path)
        self.file_format = format_from_path(self.path, file_format)

    def read(self) -> list[Point]:
        """The points in the file (none if it does not exist); unreadable lines are skipped."""
        if not os.path.exists(self.path):
            return []
        with open(self.path, newline="", encoding="utf-8") as file:
            if self.file_format == "csv":
                points = []
                for row in csv.DictReader(file):
                    try:
                        points.append({**row, "step": int(row["step"]), "value": float(row["value"])})
                    except (KeyError, TypeError, ValueError):
                        continue  # a line cut short by a crash
                return points
            points = []
            for line in file:
                try:
                    point = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a crash
                if isinstance(point, dict) and "step" in point and "value" in point:
                    points.append(point)
            return points

    def _encode(self, points: Iterable[Point], header: bool) -> str:
        if self.file_format == "jsonl":
            return "".join(json.dumps(point) + "\n" for point in points)
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, FIELDS, extrasaction="ignore", lineterminator="\n")
        if header:
            writer.writeheader()
        writer.writerows(points)
        return buffer.getvalue()

    def append(self, points: list[Point]) -> None:
        """Appends `points` (writing the CSV header first in a new file)."""
        if not points:
            return
        directory = os.path.dirname(self.path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        header = not os.path.exists(self.path) or os.path.getsize(self.path) == 0
        with open(self.path, "a", newline="", encoding="utf-8") as file:
            file.write(self._encode(points, header))

    def _ends_with_newline(self) -> bool:
        if not os.path.exists(self.path) or os.path.getsize(self.path) == 0:
            return True
        with open(self.path, "rb") as file:
            file.seek(-1, os.SEEK_END)
            return file.read(1) == b"\n"

    def truncate_after(self, step: int) -> list[Point]:
        """Drops the points with `step > step` (they will be computed again on resume).

        Rewrites the file atomically only when something is dropped or its last line was cut
        short by a crash (so appends start on a fresh line). Returns the points kept.
        """
        points = self.read()
        kept = [point for point in points if point["step"] <= step]
        if len(kept) != len(points) or not self._ends_with_newline():
            temporary = self.path + ".tmp"
            with open(temporary, "w", newline="", encoding="utf-8") as file:
                file.write(self._encode(kept, header=True))
            os.replace(temporary, self.path)
        return kept
