"""`plot`: JSON-lines points, PNGs, resume into the same directory, and life without matplotlib."""

import json
import math
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from observability_helpers import make_data, make_trainer, record_compilations

import loopax
from loopax import hooks
from loopax.hooks._points import points_of

HELPERS = os.path.dirname(os.path.abspath(__file__))
TRAIN_SERIES = {"train/loss", "train/moving_average_loss", "train/Moving Average Accuracy"}
EVAL_SERIES = {"eval/test/mean_loss", "eval/test/Accuracy"}


def read_points(directory):
    with open(os.path.join(directory, "plot_points.jsonl")) as file:
        return [json.loads(line) for line in file]


def steps_of(points, metric):
    return [point["step"] for point in points if point["metric"] == metric]


def test_points_and_pngs(tmp_path):
    trainer = make_trainer()
    compiled = record_compilations(trainer)
    loop = loopax.Loop(trainer)
    plotter = hooks.plot(
        loop, tmp_path, eval_datasets=make_data("test", 2, seed=1), start_step=3, factor=2
    )
    loop.run_steps(make_data(loop_forever=True), 20)

    points = read_points(tmp_path)
    assert points == plotter.points
    for point in points:
        assert list(point) == ["metric", "short", "type", "step", "value"]
        assert math.isfinite(point["value"])
    assert {point["metric"] for point in points} == TRAIN_SERIES | EVAL_SERIES
    # The grid 3, 9 (gaps 3, 6) fires after those loop steps, so at global steps one more;
    # then the end of the run at 20.
    expected_steps = [4, 10, 20]
    for metric in TRAIN_SERIES | EVAL_SERIES:
        assert steps_of(points, metric) == expected_steps
    first = [p for p in points if p["metric"] == "train/loss"][0]
    assert first == {
        "metric": "train/loss",
        "short": "batch",
        "type": "loss",
        "step": 4,
        "value": first["value"],
    }
    accuracy = [p for p in points if p["metric"] == "eval/test/Accuracy"]
    assert {(p["short"], p["type"]) for p in accuracy} == {("acc", "accuracy")}
    # One key for one metric: the plot's series are the loop's history keys, same values.
    for point in points:
        assert (point["step"], pytest.approx(point["value"])) in loop.history[point["metric"]]
    assert compiled == []

    assert sorted(os.path.basename(path) for path in plotter.png_paths) == [
        "accuracy.png",
        "loss.png",
    ]
    import matplotlib.image

    for path in plotter.png_paths:
        with open(path, "rb") as file:
            assert file.read(8) == b"\x89PNG\r\n\x1a\n"
        assert os.path.getsize(path) > 10_000
        image = matplotlib.image.imread(path)
        assert image.shape[0] >= 400 and image.shape[1] >= 600
        colors = np.unique(image[..., :3].reshape(-1, 3), axis=0)
        assert len(colors) > 50  # lines, text and a legend: not a blank canvas
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".tmp.png")]


def test_resume_into_the_same_directory_continues_the_curves(tmp_path):
    trainer = make_trainer()
    loop = loopax.Loop(trainer)
    hooks.plot(loop, tmp_path, start_step=2, factor=2, render=False)
    loop.run_steps(make_data(loop_forever=True), 6)
    checkpoint = jax.device_get(trainer.state)  # "checkpoint" at global step 6
    loop.run_steps(make_data(loop_forever=True), 6)
    before = read_points(tmp_path)
    # Grid 2 (global step 3), then the end of the first run (6); the second run starts on
    # grid point 6, which still fires (7), then its end (12).
    assert steps_of(before, "train/loss") == [3, 6, 7, 12]

    # A new process restores the checkpoint of step 6 and plots into the same directory:
    # the points after step 6 are dropped, then the grid continues.
    trainer.state = jax.tree.map(np.array, checkpoint)
    resumed = loopax.Loop(trainer)
    plotter = hooks.plot(resumed, tmp_path, start_step=2, factor=2)
    resumed.run_steps(make_data(loop_forever=True), 10)
    after = read_points(tmp_path)
    assert steps_of(after, "train/loss") == [3, 6, 7, 15, 16]  # grid 6 and 14, then the end
    assert after[: 2 * 3] == before[: 2 * 3]  # the points up to step 6 are kept as they were
    assert sorted(os.path.basename(p) for p in plotter.png_paths) == ["accuracy.png", "loss.png"]


def test_non_finite_values_are_skipped():
    trainer = make_trainer()
    points = points_of(
        trainer,
        7,
        {
            "train/loss": float("nan"),
            "train/moving_average_loss": 1.5,
            "train/Moving Average Accuracy": float("inf"),
        },
    )
    assert points == [
        {
            "metric": "train/moving_average_loss",
            "short": "~loss",
            "type": "loss",
            "step": 7,
            "value": 1.5,
        }
    ]


def test_bad_arguments(tmp_path):
    loop = loopax.Loop(make_trainer())
    with pytest.raises(ValueError, match="factor must be a finite number > 1"):
        hooks.plot(loop, tmp_path, factor=1.0)
    with pytest.raises(ValueError, match="start_step must be a positive int"):
        hooks.plot(loop, tmp_path, start_step=0)
    with pytest.raises(ValueError, match="two eval_datasets are named 'test'"):
        hooks.plot(loop, tmp_path, eval_datasets=[make_data("test"), make_data("test")])


WITHOUT_MATPLOTLIB = textwrap.dedent("""
    import sys
    sys.modules["matplotlib"] = None  # as if it were not installed
    sys.path.insert(0, {helpers!r})
    import loopax
    from loopax import hooks
    from observability_helpers import make_data, new_trainer

    loop = loopax.Loop(new_trainer())
    test = make_data("test", 1)
    hooks.progress_bar(loop)
    hooks.tensorboard(loop, sys.argv[1] + "/tb")
    hooks.evaluate(loop, test, every_n_steps=2)
    hooks.metrics_log(loop, sys.argv[1] + "/metrics.csv")
    hooks.plot(loop, sys.argv[1] + "/points", eval_datasets=test, render=False)
    try:
        hooks.plot(loop, sys.argv[1] + "/plots")
    except ImportError as err:
        print("IMPORT ERROR:", err)
    loop.run_steps(make_data(loop_forever=True), 2)
    assert not [name for name, module in sys.modules.items()
                if module is not None and name.split(".")[0] in ("tensorflow", "matplotlib")]
    print("OK")
""")


def test_everything_but_rendering_works_without_matplotlib(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_MATPLOTLIB.format(helpers=HELPERS), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        "IMPORT ERROR: loopax.hooks.plot renders PNGs with matplotlib, which is not "
        "installed; install it with `pip install loopax[plot]`" in result.stdout
    )
    assert result.stdout.rstrip().endswith("OK")
    assert len(read_points(tmp_path / "points")) == 3 + 2  # train and eval series at step 2
    assert not (tmp_path / "plots").exists()


def test_attaching_the_hook_leaves_matplotlib_for_the_render_thread(tmp_path):
    # Importing matplotlib takes ~0.5 s: a resumed process must not wait for it at attach.
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {HELPERS!r})
        import loopax
        from loopax import hooks
        from observability_helpers import new_trainer

        hooks.plot(loopax.Loop(new_trainer()), sys.argv[1])
        print(sorted(name for name in sys.modules if name.split(".")[0] == "matplotlib"))
    """)
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"
