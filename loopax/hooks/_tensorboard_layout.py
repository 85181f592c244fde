"""`hooks.tensorboard`'s layouts: which run directory and tag each loopax key goes to.

The `"per_dataset"` layout writes a run per dataset (`train`, `eval/<dataset>`) with the
metric's name as the tag, so TensorBoard overlays training and evaluation; `"single"` writes
every key as a tag of the logdir itself.
"""

from __future__ import annotations

import os
from typing import Any

PER_DATASET = "per_dataset"
SINGLE = "single"
LAYOUTS = (PER_DATASET, SINGLE)
TRAIN_RUN = "train"
_EVAL_RUNS = "eval"
_EVENT_FILE_PREFIX = "events.out.tfevents."
# In its dataset's run, an evaluation's loss takes the train loss's tag: one chart for both.
RUN_TAGS = {"mean_loss": "loss"}


def check_layout(layout: Any) -> str:
    """Returns `layout` if it is one of `LAYOUTS`.

    Raises:
      ValueError: it is not, naming the choices.
    """
    if layout not in LAYOUTS:
        raise ValueError(
            f"tensorboard: layout={layout!r} is not one of {list(LAYOUTS)}; "
            f"{PER_DATASET!r} (the default) writes a run directory per dataset, "
            f"{SINGLE!r} every tag into logdir itself"
        )
    return layout


def _safe_component(part: str) -> str:
    # A dataset name becomes directories: no empty, "." or ".." component leaves the logdir.
    return "_" if part in ("", ".", "..") else part


def run_and_tag(layout: str, key: str) -> tuple[str, str]:
    """The run directory (relative to the logdir, `""` for itself) and tag of `key`.

    With the `"per_dataset"` layout, `train/<metric>` goes to run `train` as `<metric>`,
    `eval/<dataset>/<metric>` to run `eval/<dataset>` as `<metric>` (`mean_loss` as `loss`,
    beside the train loss), and any other tag (the run summary, parameter histograms) to run
    `train` unchanged. With `"single"`, every key is a tag of the logdir itself.

    Example:
      >>> run_and_tag("per_dataset", "eval/test/mean_loss")
      ('eval/test', 'loss')
      >>> run_and_tag("per_dataset", "train/loss"), run_and_tag("single", "train/loss")
      (('train', 'loss'), ('', 'train/loss'))
    """
    if layout == SINGLE:
        return "", key
    kind, _, rest = key.partition("/")
    if kind == TRAIN_RUN and rest:
        return TRAIN_RUN, rest
    if kind == _EVAL_RUNS:
        dataset, _, metric = rest.rpartition("/")
        if dataset and metric:
            parts = "/".join(_safe_component(part) for part in dataset.split("/"))
            return f"{_EVAL_RUNS}/{parts}", RUN_TAGS.get(metric, metric)
    return TRAIN_RUN, key


def _has_events(directory: str) -> bool:
    try:
        return any(name.startswith(_EVENT_FILE_PREFIX) for name in os.listdir(directory))
    except OSError:
        return False


def existing_runs(logdir: str) -> set[str]:
    """The runs of the `"per_dataset"` layout that hold event files under `logdir`.

    `train`, every directory under `eval` with events, and `""` (the logdir itself) when
    it holds events (a run started with the single layout). Other directories (another
    program's runs, the profile plugin's) are left alone.
    """
    runs = {run for run in ("", TRAIN_RUN) if _has_events(os.path.join(logdir, run))}
    for directory, _, names in os.walk(os.path.join(logdir, _EVAL_RUNS)):
        if any(name.startswith(_EVENT_FILE_PREFIX) for name in names):
            runs.add(os.path.relpath(directory, logdir).replace(os.sep, "/"))
    return runs
