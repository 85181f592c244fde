"""What `plot`'s figures draw: one colour per dataset, focused accuracy axes, the best step.

Each test runs a short real training with evaluations and reads back the matplotlib
figures (`Plotter.figures()`, which the PNGs are saved from): their lines' colours,
labels, data and axis limits, not pixels.
"""

import os

from matplotlib.colors import to_hex
from observability_helpers import make_data, make_trainer

import loopax
from loopax import hooks

STEPS = 24
BEST_POINT = "_best point"


def train(tmp_path, attach=None, datasets=("a", "b"), steps=STEPS):
    """Trains `steps` steps evaluating `datasets` every 4; returns the loop and the plotter."""
    loop = loopax.Loop(make_trainer())
    seeds = {"a": 1, "b": 2}
    hooks.evaluate(
        loop, [make_data(name, 2, seed=seeds[name]) for name in datasets], every_n_steps=4
    )
    plotter = hooks.plot(loop, tmp_path / "plots", start_step=1, factor=1.5)
    if attach is not None:
        attach(loop)  # after the plot: the plot reads the hooks when the run starts
    loop.run_steps(make_data(loop_forever=True, seed=3), steps)
    plotter.flush()
    return loop, plotter


def group_of(key):
    return "train" if key.startswith("train/") else key.rsplit("/", 1)[0]


def series_lines(figure):
    """`{metric key: Line2D}` of the metric series drawn in `figure`."""
    (axes,) = figure.axes
    labels = {line.get_label(): line for line in axes.lines}
    return {label: line for label, line in labels.items() if label.startswith(("train/", "eval/"))}


def values_of(plotter, key):
    return {p["step"]: p["value"] for p in plotter.points if p["metric"] == key}


def best_lines(figure):
    """The best step's vertical line and star (or None) in `figure`."""
    (axes,) = figure.axes
    vertical = [line for line in axes.lines if line.get_label().startswith("best ")]
    stars = [line for line in axes.lines if line.get_label() == BEST_POINT]
    assert len(vertical) == 1 and len(stars) <= 1
    return vertical[0], (stars[0] if stars else None)


def test_each_dataset_has_one_colour_in_every_figure(tmp_path):
    _, plotter = train(tmp_path)
    figures = plotter.figures()
    assert sorted(figures) == ["accuracy", "loss"]
    colors = {}  # group -> colours it is drawn in, across figures
    for figure in figures.values():
        groups_here = set()
        for key, line in series_lines(figure).items():
            colors.setdefault(group_of(key), set()).add(to_hex(line.get_color()))
            groups_here.add(group_of(key))
        assert groups_here == {"train", "eval/a", "eval/b"}  # each figure shows every dataset
    assert all(len(drawn_in) == 1 for drawn_in in colors.values()), colors
    assert len({next(iter(drawn_in)) for drawn_in in colors.values()}) == 3, colors
    # The loss figure holds two train series (batch loss and moving average) and the
    # accuracy figure one, so a per-figure colour cycle would shift the eval colours.
    assert len([k for k in series_lines(figures["loss"]) if k.startswith("train/")]) == 2

    # A new process reading the same points draws them in the same colours.
    again = hooks.plot(loopax.Loop(make_trainer()), tmp_path / "plots").figures()
    for metric_type, figure in again.items():
        for key, line in series_lines(figure).items():
            assert line.get_color() == series_lines(figures[metric_type])[key].get_color()
    # And the PNGs are those figures.
    assert sorted(os.path.basename(path) for path in plotter.png_paths) == [
        "accuracy.png",
        "loss.png",
    ]


def test_the_accuracy_axis_focuses_on_the_eval_curves(tmp_path):
    _, plotter = train(tmp_path, datasets=("a",), steps=40)
    figures = plotter.figures()
    evaluated = list(values_of(plotter, "eval/a/Accuracy").values())
    train_values = list(values_of(plotter, "train/Moving Average Accuracy").values())
    lowest, highest = min(evaluated), max(evaluated + train_values)
    # The train curve starts well below the eval curve: what would squash it.
    assert min(train_values) < lowest - 0.05
    bottom, top = figures["accuracy"].axes[0].get_ylim()
    assert bottom < lowest and top > highest  # every eval point and every curve's top shows
    assert bottom > min(train_values)  # the train curve's start runs off below
    assert bottom > lowest - 0.1 * (highest - lowest) - 0.02  # a margin, not more

    # The loss figure is not focused: every value shows.
    loss_values = [p["value"] for p in plotter.points if p["type"] == "loss"]
    bottom, top = figures["loss"].axes[0].get_ylim()
    assert bottom <= min(loss_values) and top >= max(loss_values)


def assert_best_marked(figures, metric_type, key, best_step, best_value, mode="min"):
    for this_type, figure in figures.items():
        vertical, star = best_lines(figure)
        assert list(vertical.get_xdata()) == [best_step, best_step]
        if this_type == metric_type:
            assert vertical.get_label().startswith(f"best {key} ")
            assert vertical.get_label().endswith(f"(step {best_step})")
            assert star is not None
            assert (list(star.get_xdata()), list(star.get_ydata())) == ([best_step], [best_value])
            series = series_lines(figure)[key]
            assert to_hex(star.get_markerfacecolor()) == to_hex(series.get_color())
        else:
            # Another metric's axes: the step and what chose it, never the other's value
            # (a loss in the accuracy figure).
            chosen_by = "lowest" if mode == "min" else "highest"
            assert vertical.get_label() == f"best step {best_step} ({chosen_by} {key})"
            assert star is None


def test_without_hooks_the_first_datasets_mean_loss_is_marked(tmp_path):
    _, plotter = train(tmp_path)
    values = values_of(plotter, "eval/a/mean_loss")
    best_step = min(values, key=lambda step: (values[step], step))
    # Dataset "b" (evaluated second) has a best value of its own: the star tells them apart.
    assert values_of(plotter, "eval/b/mean_loss")[best_step] != values[best_step]
    assert_best_marked(plotter.figures(), "loss", "eval/a/mean_loss", best_step, values[best_step])


def test_early_stoppings_monitor_is_marked_at_its_best_step(tmp_path):
    stoppers = []

    def attach(loop):
        stoppers.append(hooks.early_stopping(loop, "eval/b/Accuracy", patience=100))

    _, plotter = train(tmp_path, attach)
    (stopper,) = stoppers
    values = values_of(plotter, "eval/b/Accuracy")
    assert stopper.best_step is not None and stopper.best == values[stopper.best_step]
    assert max(values.values()) == stopper.best
    figures = plotter.figures()
    assert_best_marked(
        figures, "accuracy", "eval/b/Accuracy", stopper.best_step, stopper.best, mode="max"
    )
    legend = figures["loss"].axes[0].get_legend().get_texts()[-1].get_text()
    assert legend == f"best step {stopper.best_step} (highest eval/b/Accuracy)"


def test_a_checkpoints_best_metric_comes_before_early_stoppings_monitor(tmp_path):
    def attach(loop):
        hooks.early_stopping(loop, "eval/b/Accuracy", patience=100)
        hooks.checkpoint(
            loop, tmp_path / "ckpt", every_n_steps=4, best_metric="eval/b/mean_loss", keep=2
        )

    _, plotter = train(tmp_path, attach)
    values = values_of(plotter, "eval/b/mean_loss")
    best_step = min(values, key=lambda step: (values[step], step))
    assert_best_marked(plotter.figures(), "loss", "eval/b/mean_loss", best_step, values[best_step])


def test_higher_is_better_focuses_the_marked_metrics_figure(tmp_path):
    # A loss watched with mode="max" (an odd choice, but it names which way is better):
    # its figure is focused like an accuracy's, from the eval curves' bottom.
    def attach(loop):
        hooks.early_stopping(loop, "eval/a/mean_loss", mode="max", patience=100)

    _, plotter = train(tmp_path, attach)
    evaluated = [
        v
        for key in ("eval/a/mean_loss", "eval/b/mean_loss")
        for v in values_of(plotter, key).values()
    ]
    train_values = [
        p["value"]
        for p in plotter.points
        if p["type"] == "loss" and p["metric"].startswith("train/")
    ]
    assert min(train_values) < min(evaluated)  # the train loss ends below the eval losses
    bottom, top = plotter.figures()["loss"].axes[0].get_ylim()
    assert min(train_values) < bottom < min(evaluated)
    assert top > max(evaluated + train_values)


def test_a_figure_of_points_without_evaluations_has_no_marker(tmp_path):
    loop = loopax.Loop(make_trainer())
    plotter = hooks.plot(loop, tmp_path, start_step=2, factor=2)
    loop.run_steps(make_data(loop_forever=True), 6)
    for figure in plotter.figures().values():
        (axes,) = figure.axes
        assert not [line for line in axes.lines if not line.get_label().startswith("train/")]


def test_one_step_at_a_power_of_ten_with_the_best_line_on_it_draws_without_a_warning(tmp_path):
    # The README's job at its first evaluation: every point at step 100, the best step's line
    # on them; matplotlib's log autoscaling found no width there and warned.
    loop = loopax.Loop(make_trainer())
    hooks.evaluate(loop, [make_data("a", 2, seed=1)], every_n_steps=100)
    plotter = hooks.plot(loop, tmp_path / "plots")
    hooks.throughput(loop, every_n_steps=100)  # its figures' points: step 100 alone
    loop.run_steps(make_data(loop_forever=True, seed=3), 100)
    figures = plotter.figures()  # a warning fails the test
    (axes,) = figures["throughput"].axes
    assert {line.get_xdata()[0] for line in axes.lines} == {100}
    low, high = axes.get_xlim()
    assert low < 100 < high
