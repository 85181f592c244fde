"""`LossMovingAverage`: the trainer's `moving_average_loss` and skipped-step count."""

import jax.numpy as jnp
import numpy as np

from loopax.metrics import Metric
from loopax.metrics._loss_average import LossMovingAverage


def test_it_is_a_metric_named_as_the_trainer_reports_it():
    average = LossMovingAverage()
    assert isinstance(average, Metric)
    assert (average.name, average.short_name, average.metric_type) == (
        "moving_average_loss",
        "~loss",
        "loss",
    )
    np.testing.assert_array_equal(average.init(), np.zeros(3, np.float32))


def test_a_loss_is_averaged_in_with_weight_max_of_one_percent_and_one_over_count():
    average = LossMovingAverage()
    state = average.init()
    mean = np.float32(0.0)
    for count, loss in enumerate(np.linspace(1.0, 3.0, 150, dtype=np.float32), start=1):
        state = average.add_loss(state, jnp.float32(loss))
        weight = np.maximum(np.float32(0.01), np.float32(1.0) / np.float32(count))
        mean = mean * (np.float32(1.0) - weight) + loss * weight
        assert float(state[1]) == count
    np.testing.assert_allclose(float(average.compute(state)), mean, rtol=1e-6)
    assert float(average.skipped(state)) == 0.0


def test_a_step_that_is_not_ok_leaves_the_average_alone_and_counts_itself():
    average = LossMovingAverage()
    state = average.add_loss(average.init(), jnp.float32(2.0))
    skipped = average.add_loss(state, jnp.float32(jnp.nan), ok=jnp.bool_(False))
    np.testing.assert_array_equal(skipped, [2.0, 1.0, 1.0])


def test_a_step_counted_as_skipped_alone_is_still_averaged_in():
    average = LossMovingAverage()
    state = average.add_loss(average.init(), jnp.float32(2.0))
    state = average.add_loss(state, jnp.float32(4.0), skipped=jnp.bool_(True))
    np.testing.assert_array_equal(state, [3.0, 2.0, 1.0])


def test_as_a_metric_it_folds_in_a_batch_of_losses_as_one_step():
    average = LossMovingAverage()
    halves = [average.update([], [jnp.array(part)]) for part in ([1.0, 2.0], [3.0, 6.0])]
    state = average.accumulate(average.init(), average.merge(*halves))
    np.testing.assert_array_equal(state, [3.0, 1.0, 0.0])
