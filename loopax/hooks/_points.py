"""Metric points, as the plot and metrics-log hooks write them.

A point is `{"metric": key, "short": ..., "type": ..., "step": global_step, "value": ...}`
where `key` is the one name of the metric everywhere (`"train/loss"`,
`"eval/test/Accuracy"`); non-finite values are skipped. `PointsFile` appends them to a
JSON-lines or CSV file (each append is in the OS's hands when it returns, so it survives
the process being killed) and, on resume, drops the points of steps that will be run again.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

from .. import _validate
from ..trainer import Trainer
from ._metric_info import describe_key

Point = dict[str, Any]
FIELDS: tuple[str, ...] = ("metric", "short", "type", "step", "value")
FORMATS = ("jsonl", "csv")


def points_of(trainer: Trainer, step: int, scalars: Mapping[str, float]) -> list[Point]:
    """One point per finite scalar (`{key: value}`), described by its key."""
    points = []
    for key, value in scalars.items():
        value = float(value)
        if not math.isfinite(value):
            continue
        info = describe_key(trainer, key)
        points.append(
            {
                "metric": key,
                "short": info.short_name,
                "type": info.metric_type,
                "step": int(step),
                "value": value,
            }
        )
    return points


def format_from_path(path: str, file_format: str | None) -> str:
    """The file format: `file_format` if given, else from the suffix (`.csv` or JSON lines)."""
    if file_format is None:
        file_format = "csv" if str(path).lower().endswith(".csv") else "jsonl"
    if file_format not in FORMATS:
        raise ValueError(
            f"format must be one of {FORMATS} (or None to pick from the file "
            f"suffix), got {file_format!r}"
        )
    return file_format


class PointsFile:
    """Appends points to a JSON-lines or CSV file; `truncate_after` prepares a resume.

    Args:
      path: the file; its directory is created on the first append.
      file_format: `"jsonl"` or `"csv"`.
    """

    path: str
    file_format: str

    def __init__(self, path: str, file_format: str):
        self.path = _validate.path("path", path)
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
                        points.append(
                            {**row, "step": int(row["step"]), "value": float(row["value"])}
                        )
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
