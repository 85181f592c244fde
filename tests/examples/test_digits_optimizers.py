"""Every optimizer, selected by name as `examples/digits.py --optimizer NAME` does, trains."""

import importlib.util
from pathlib import Path

import jax
import pytest

import loopax
from loopax import losses, metrics, optimizers

pytest.importorskip("sklearn")
_SPEC = importlib.util.spec_from_file_location(
    "digits_example", Path(__file__).resolve().parents[2] / "examples" / "digits.py"
)
digits = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(digits)

LEARNING_RATES = {"sgd": 0.1, "adam": 1e-3, "adamw": 1e-3, "rmsprop": 1e-3}


@pytest.fixture(scope="module")
def splits():
    return digits.load_digits(seed=0)


@pytest.mark.parametrize("name", sorted(LEARNING_RATES))
def test_optimizer_by_name_trains_digits(name, splits):
    (train_x, train_y), (test_x, test_y) = splits
    trainer = loopax.Trainer(
        digits.model_fn,
        losses.sparse_categorical_crossentropy_logits,
        optimizers.from_name(name, learning_rate=LEARNING_RATES[name]),
        eval_metrics=[metrics.SparseCategoricalAccuracy()],
        devices=jax.devices()[:1],
    )
    train = loopax.ArrayDataset(train_x, train_y, 64, loop_forever=True)
    test = loopax.ArrayDataset(test_x, test_y, 40, shuffle=False, name="test")
    before = trainer.evaluate(test)["Accuracy"]
    loopax.Loop(trainer).run_steps(train, 300)
    after = trainer.evaluate(test)["Accuracy"]
    assert before < 0.3
    assert after > 0.9, f"{name}: test accuracy {after:.3f} after 300 steps"
