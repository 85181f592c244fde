"""Reading `hooks.tensorboard`'s run directories back with TensorBoard's own reader.

`hooks.tensorboard` writes a run per dataset (`train`, `eval/<dataset>`) with the metric's
name as the tag; `EventMultiplexer` finds the runs as `tensorboard --logdir` does, and
`keyed_scalars` names their points with loopax's keys (`train/loss`, `eval/test/mean_loss`),
so tests compare them with `loop.history` and the other writers.
"""

from pathlib import Path

from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

SIZES = {"scalars": 0, "tensors": 0}


def read_runs(logdir):
    """{run: EventAccumulator} of every run under `logdir` (`"."` for `logdir` itself)."""
    multiplexer = EventMultiplexer(size_guidance=SIZES)
    multiplexer.AddRunsFromDirectory(str(logdir))
    multiplexer.Reload()
    return {run: multiplexer.GetAccumulator(run) for run in multiplexer.Runs()}


def loopax_key(run, tag):
    """The loopax key of `tag` in `run` (the inverse of the per-dataset layout)."""
    if run == ".":
        return tag
    if run == "train":
        return f"train/{tag}"
    assert run.startswith("eval/"), run
    return f"{run}/{'mean_loss' if tag == 'loss' else tag}"


def keyed_scalars(logdir):
    """{loopax key: [(step, value)]} of every run's scalars, as TensorBoard shows them."""
    scalars = {}
    for run, accumulator in read_runs(Path(logdir)).items():
        for tag in accumulator.Tags()["scalars"]:
            key = loopax_key(run, tag)
            assert key not in scalars, (key, run, tag)
            scalars[key] = [(event.step, event.value) for event in accumulator.Scalars(tag)]
    return scalars
