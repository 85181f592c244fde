"""`Trainer.skip_non_finite_steps`: a bad step changes nothing but the step count."""

import jax
import numpy as np
import pytest
from _tiny import tiny_batch, tiny_trainer

import loopax


def make_trainer(devices):
    return tiny_trainer(
        devices,
        model="classifier",
        metrics=[loopax.metrics.MovingAverageSparseCategoricalAccuracy()],
    )


def batch(bad=False):
    spec, [inputs], labels = tiny_batch(model="classifier")
    if bad:
        inputs[0, 0] = np.inf
    return spec, [inputs], labels


@pytest.mark.parametrize("devices", [1, 4])
def test_a_skipped_step_leaves_every_state_but_the_step_unchanged(devices):
    trainer = make_trainer(devices)
    trainer.skip_non_finite_steps()
    trainer.train_step(*batch())
    before = jax.device_get(trainer.state)
    metrics = trainer.train_step(*batch(bad=True))
    assert list(metrics) == [
        "loss",
        "moving_average_loss",
        "Moving Average Accuracy",
        "skipped_steps",
    ]
    assert not np.isfinite(float(metrics["loss"]))
    assert float(metrics["skipped_steps"]) == 1.0
    assert float(metrics["moving_average_loss"]) == pytest.approx(
        float(before.train_metrics["moving_average_loss"][0])
    )  # the average did not see the NaN
    after = jax.device_get(trainer.state)
    assert int(after.step) == int(before.step) + 1
    for field in ("params", "opt_state", "model_state", "train_metrics"):
        for want, got in zip(
            jax.tree.leaves(getattr(before, field)),
            jax.tree.leaves(getattr(after, field)),
            strict=True,
        ):
            if field == "train_metrics" and np.shape(want) == (3,):
                np.testing.assert_array_equal(got, [want[0], want[1], want[2] + 1])
            else:
                np.testing.assert_array_equal(want, got)
    trainer.train_step(*batch())  # and a good step trains again
    assert not np.array_equal(
        jax.device_get(trainer.params)["Dense_0"]["kernel"], after.params["Dense_0"]["kernel"]
    )


def test_switching_it_off_drops_the_metric_and_recompiles():
    trainer = make_trainer(1)
    compiled = []
    trainer.on_exec_creation(lambda info: compiled.append(info.graph_type))
    trainer.skip_non_finite_steps(True)
    trainer.train_step(*batch())
    trainer.skip_non_finite_steps(False)
    assert "skipped_steps" not in trainer.train_step(*batch())
    assert compiled == ["train", "train"]


def test_skipped_steps_without_a_handler_warn_with_the_steps():
    trainer = make_trainer(1)
    trainer.skip_non_finite_steps()

    def batches():
        for index in range(6):
            yield batch(bad=index in (2, 4))

    loop = loopax.Loop(trainer)
    with pytest.warns(RuntimeWarning, match=r"skipped 2 train step\(s\).*steps \[2, 4\]"):
        loop.run_steps(loopax.IterableDataset(batches, name="some bad"), 6)
    assert trainer.global_step == 6


def test_user_metric_named_skipped_steps_is_rejected():
    with pytest.raises(ValueError, match="duplicate train metric name 'skipped_steps'"):
        loopax.Trainer(
            lambda ctx, spec, x: x[0],
            None,
            loopax.optimizers.sgd(0.1),
            train_metrics=[loopax.metrics.Mean("skipped_steps", lambda labels, preds: preds[0])],
        )
