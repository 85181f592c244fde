"""The guides' code that users copy (once the README's): the custom metric runs as written, on 1
and 4 devices; the NNX model and the frozen optimizer run as written."""

import re
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import pytest

import loopax
from loopax import losses, optimizers

GUIDES = Path(__file__).resolve().parents[1] / "docs" / "guides"


def _readme_block(marker: str, page: str = "models.md") -> str:
    blocks = re.findall(r"```python\n(.*?)```", (GUIDES / page).read_text(), flags=re.S)
    matching = [block for block in blocks if marker in block]
    assert len(matching) == 1, f"expected one python block of {page} with {marker!r}"
    return matching[0]


@pytest.fixture(scope="module")
def readme_metric_class():
    source = _readme_block("class MeanAbsoluteError(Metric)", "extending.md")
    # The block ends by passing the metric to a Trainer of the guide's model: run the class part.
    namespace: dict = {}
    exec(source.split("trainer = ")[0], namespace)  # noqa: S102 (our own guide)
    return namespace["MeanAbsoluteError"]


def _train_and_evaluate(metric_class, devices):
    def model_fn(ctx, spec, inputs):
        return nn.Dense(1)(nn.tanh(nn.Dense(8)(inputs[0])))

    trainer = loopax.Trainer(
        model_fn,
        losses.mean_squared_error,
        optimizers.sgd(0.05),
        train_metrics=[metric_class()],
        eval_metrics=[metric_class()],
        devices=devices,
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 3)).astype(np.float32)
    y = np.sin(x.sum(axis=1, keepdims=True)).astype(np.float32)
    train = loopax.ArrayDataset(x, y, 16, loop_forever=True)
    metrics = loopax.Loop(trainer).run_steps(train, 12)
    evaluation = trainer.evaluate(loopax.ArrayDataset(x, y, 24, shuffle=False, name="eval"))
    return float(metrics["Mean Absolute Error"]), evaluation


@pytest.mark.cpu_devices
def test_readme_metric_gives_the_same_result_on_one_and_four_devices(readme_metric_class):
    assert len(jax.devices()) >= 4
    train_one, eval_one = _train_and_evaluate(readme_metric_class, jax.devices()[:1])
    train_four, eval_four = _train_and_evaluate(readme_metric_class, jax.devices()[:4])
    assert train_one > 0
    np.testing.assert_allclose(train_four, train_one, rtol=1e-5)
    assert list(eval_four) == ["mean_loss", "Mean Absolute Error"]
    for name in eval_one:
        np.testing.assert_allclose(eval_four[name], eval_one[name], rtol=1e-5)


def test_readme_metric_matches_numpy(readme_metric_class):
    metric = readme_metric_class()
    labels, predictions = np.array([1.0, 2.0, 4.0]), np.array([1.5, 2.0, 2.0])
    state = metric.accumulate(metric.init(), metric.update([labels], [predictions]))
    assert float(metric.compute(state)) == pytest.approx(np.abs(labels - predictions).mean())


def test_readme_nnx_model_and_frozen_optimizer_run_as_written():
    import optax

    source = _readme_block("class MLP(nnx.Module)")
    namespace: dict = {"loopax": loopax, "losses": losses, "optimizers": optimizers}
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 64)).astype(np.float32)
    namespace["train"] = loopax.ArrayDataset(
        x, rng.integers(0, 10, 64).astype(np.int32), 16, loop_forever=True
    )
    exec(source.replace("run_steps(train, 100)", "run_steps(train, 3)"), namespace)  # noqa: S102
    assert namespace["trainer"].global_step == 3
    assert namespace["model"] is namespace["trainer"].nnx_module()

    frozen_block = _readme_block("optax.multi_transform")
    frozen = {"optax": optax}
    exec(frozen_block, frozen)  # noqa: S102
    params = {"Dense_0": {"kernel": np.ones((2, 2))}, "Dense_1": {"kernel": np.ones((2, 2))}}
    state = frozen["optimizer"].init(params)
    updates, _ = frozen["optimizer"].update(params, state, params)
    assert not np.any(updates["Dense_0"]["kernel"]) and np.all(updates["Dense_1"]["kernel"])
