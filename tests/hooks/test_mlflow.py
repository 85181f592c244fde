"""`hooks.mlflow` against a real local MLflow store (sqlite), read back with MlflowClient."""

import shutil

import pytest
from observability_helpers import make_data, new_trainer

import loopax
from loopax import hooks

pytest.importorskip("mlflow")
pytest.importorskip("sqlalchemy")
from mlflow.tracking import MlflowClient  # noqa: E402


def attach(tmp_path, store, *, plot=False):
    trainer = new_trainer()
    loop = loopax.Loop(trainer)
    hooks.checkpoint(loop, tmp_path / "ckpt", every_n_steps=4)
    hooks.evaluate(loop, make_data("test", 2, seed=1), every_n_steps=5)
    if plot:
        hooks.plot(loop, tmp_path / "plots")
    writer = hooks.mlflow(loop, tracking_uri=store, experiment="digits", every_n_steps=2)
    return loop, writer


def history(client, run_id):
    run = client.get_run(run_id)
    return {
        key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
        for key in run.data.metrics
    }


@pytest.fixture
def store(tmp_path, monkeypatch):
    # MLflow puts a sqlite store's artifacts under ./mlruns: keep them in the test's directory.
    monkeypatch.chdir(tmp_path)
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def test_points_parameters_and_artifacts(tmp_path, store):
    loop, writer = attach(tmp_path / "a", store, plot=True)
    loop.run_steps(make_data(loop_forever=True), 12)
    client = MlflowClient(tracking_uri=store)
    run = client.get_run(writer.run_id)
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "digits"
    points = history(client, writer.run_id)
    # The same keys and values as the loop's history.
    assert {"train/loss", "train/learning_rate", "eval/test/Accuracy"} <= set(points)
    assert [step for step, _ in points["train/loss"]] == [2, 4, 6, 8, 10, 12]
    for key in ("train/loss", "eval/test/Accuracy", "eval/test/mean_loss"):
        recorded = dict(loop.history[key])
        assert [value for _, value in points[key]] == pytest.approx(
            [recorded[step] for step, _ in points[key]]
        ), key
    params = run.data.params
    assert params["devices"] == "1" and params["processes"] == "1"
    assert params["batch_size"] == "16" and float(params["optimizer/learning_rate"]) == 0.1
    artifacts = {a.path for a in client.list_artifacts(writer.run_id)}
    assert "run_summary.md" in artifacts and "plots" in artifacts
    assert any(a.path.endswith(".png") for a in client.list_artifacts(writer.run_id, "plots"))


def test_a_resumed_training_continues_the_run_with_every_step_once(tmp_path, store):
    reference, ref_writer = attach(tmp_path / "reference", store)
    reference.run_to_step(make_data(loop_forever=True), 12)

    first, writer = attach(tmp_path / "b", store)

    def crash(loop, metrics):
        if loop.trainer.global_step == 6:
            raise RuntimeError("the process dies")

    first.on_step("crash", crash, priority=loopax.Priority.UI + 1)
    with pytest.raises(loopax.HookError, match="the process dies"):
        first.run_to_step(make_data(loop_forever=True), 12)
    assert MlflowClient(tracking_uri=store).get_run(writer.run_id).info.status == "FAILED"
    # As if it died before a checkpoint after step 4 committed: MLflow holds steps to 6.
    for step_dir in (tmp_path / "b" / "ckpt").iterdir():
        if step_dir.name.isdigit() and int(step_dir.name) > 4:
            shutil.rmtree(step_dir)
    resumed, again = attach(tmp_path / "b", store)
    assert resumed.trainer.global_step == 4 and again.run_id == writer.run_id
    resumed.run_to_step(make_data(loop_forever=True), 12)

    client = MlflowClient(tracking_uri=store)
    expected, got = history(client, ref_writer.run_id), history(client, writer.run_id)
    assert set(got) == set(expected)
    for key in expected:
        assert [s for s, _ in got[key]] == [s for s, _ in expected[key]], key  # each once
        assert [v for _, v in got[key]] == pytest.approx([v for _, v in expected[key]]), key
    assert client.get_run(writer.run_id).info.status == "FINISHED"
    assert len(client.search_runs([client.get_run(writer.run_id).info.experiment_id])) == 2
