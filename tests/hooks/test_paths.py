"""Every path argument of the ready hooks expands `~` to the home directory, as a shell
does, and refuses an empty path, which would write into the working directory (issue 22,
items 5 and 12)."""

import os

import pytest
from observability_helpers import make_data, make_trainer

import loopax
from loopax import hooks

# hook -> (attach it with a path, what it leaves at that path after a run)
ATTACH = {
    "checkpoint": (lambda loop, path: hooks.checkpoint(loop, path, every_n_steps=2), "2"),
    "tensorboard": (lambda loop, path: hooks.tensorboard(loop, path, every_n_steps=2), None),
    "metrics_log": (lambda loop, path: hooks.metrics_log(loop, path, every_n_steps=2), None),
    "plot": (lambda loop, path: hooks.plot(loop, path, render=False), "plot_points.jsonl"),
}


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A home directory of its own, and a working directory elsewhere."""
    home = tmp_path / "home"
    home.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    return home, work


@pytest.mark.parametrize("hook", sorted(ATTACH))
def test_a_tilde_path_writes_into_the_home_directory(hook, home):
    home_dir, work_dir = home
    attach, leaves = ATTACH[hook]
    target = "~/runs/out.csv" if hook == "metrics_log" else "~/runs/out"
    loop = loopax.Loop(make_trainer())
    attached = attach(loop, target)
    loop.run_steps(make_data(loop_forever=True), 4)
    if hook == "checkpoint":
        attached.wait()
    written = home_dir / "runs" / ("out.csv" if hook == "metrics_log" else "out")
    assert written.exists(), sorted(p.name for p in (home_dir / "runs").iterdir())
    if leaves is not None:
        assert (written / leaves).exists(), sorted(os.listdir(written))
    assert not (work_dir / "~").exists()


@pytest.mark.parametrize("hook", sorted(ATTACH))
def test_an_empty_path_is_refused_naming_the_argument(hook, home):
    attach, _ = ATTACH[hook]
    loop = loopax.Loop(make_trainer())
    argument = {"checkpoint": "directory", "plot": "directory", "metrics_log": "path"}.get(
        hook, "logdir"
    )
    with pytest.raises(ValueError, match=rf"{argument} is empty; pass a path such as"):
        attach(loop, "")
    assert os.listdir(home[1]) == []  # nothing written into the working directory


def test_a_path_of_another_type_is_refused():
    loop = loopax.Loop(make_trainer())
    with pytest.raises(TypeError, match="logdir must be a str or a pathlib.Path, got int"):
        hooks.tensorboard(loop, 3)
