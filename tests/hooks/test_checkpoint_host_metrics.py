"""Host metrics (`StreamingMedian`, `median_loss`) in checkpoints: a resumed run's median
equals an uninterrupted run's (issue 22, item 19). Real Orbax checkpoints, real Loops."""

import numpy as np
import pytest
from _tiny import tiny_data, tiny_trainer

import loopax
from loopax import hooks, losses, metrics

TARGET = 12


def make_trainer(*extra_metrics):
    # A small sample, so the median runs past it and the sample's generator matters too.
    median = metrics.median_loss(losses.mean_absolute_error, sample_size=20, seed=3)
    return tiny_trainer(metrics=[median, *extra_metrics])


def make_dataset():
    return tiny_data(5, seed=2)


def record_medians(loop):
    """{global step: the train median after it}, read after every step."""
    medians = {}
    loop.on_step(
        "record",
        lambda loop, m: medians.__setitem__(loop.trainer.global_step, float(m["median_loss"])),
    )
    return medians


def test_a_resumed_run_goes_on_with_the_median_of_its_checkpoint(tmp_path):
    uninterrupted = loopax.Loop(make_trainer())
    want = record_medians(uninterrupted)
    uninterrupted.run_to_step(make_dataset(), TARGET)

    crashing = loopax.Loop(make_trainer())
    hooks.checkpoint(crashing, tmp_path, every_n_steps=4)

    def crash(loop, metrics):
        if loop.trainer.global_step == 7:
            raise RuntimeError("the machine went away")

    crashing.on_step("crash", crash)
    with pytest.raises(loopax.HookError):
        crashing.run_to_step(make_dataset(), TARGET)

    resumed = loopax.Loop(make_trainer())
    assert hooks.checkpoint(resumed, tmp_path).restored_step == 4
    got = record_medians(resumed)
    resumed.run_to_step(make_dataset(), TARGET)
    assert sorted(got) == list(range(5, TARGET + 1))
    # The median of steps 1-4 went into the checkpoint and goes on: equal, not just close.
    assert got == {step: want[step] for step in got}


def test_a_new_run_still_starts_the_median_afresh(tmp_path):
    loop = loopax.Loop(make_trainer())
    hooks.checkpoint(loop, tmp_path, every_n_steps=4)
    loop.run_to_step(make_dataset(), 4)

    resumed = loopax.Loop(make_trainer())
    hooks.checkpoint(resumed, tmp_path)
    assert resumed.trainer.host_metric_states.get_state()["median_loss"]["seen"] == 32
    resumed.run_steps(make_dataset(), 1)  # another run than the checkpoint's: afresh
    sample = resumed.trainer.host_metric_states.get_state()["median_loss"]
    assert sample["seen"] == 8  # this run's one batch: the checkpoint's 32 values are gone


def test_a_host_metric_that_cannot_save_its_state_warns_at_the_checkpoint(tmp_path):
    class MaxValue(metrics.HostMetric):
        name, short_name = "max_prediction", "max"

        def device_values(self, labels, predictions):
            return predictions[0]

        def init_host(self):
            return float("-inf")

        def update_host(self, state, values):
            return max(state, float(np.max(values)))

        def compute_host(self, state):
            return state

    loop = loopax.Loop(make_trainer(MaxValue()))
    hooks.checkpoint(loop, tmp_path, every_n_steps=2)
    with pytest.warns(RuntimeWarning, match="'max_prediction'.*gives no state to checkpoint"):
        loop.run_steps(make_dataset(), 4)
    resumed = loopax.Loop(make_trainer(MaxValue()))
    hooks.checkpoint(resumed, tmp_path)  # the median comes back; the maximum starts afresh
    with pytest.warns(RuntimeWarning, match="'max_prediction'"):
        saved = resumed.trainer.host_metric_states.get_state()
    assert saved["median_loss"]["seen"] == 32 and "max_prediction" not in saved
