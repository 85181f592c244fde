"""`mlflow`: the loop's metric points in an MLflow run that a resumed training continues."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ..loop import Loop, Priority
from ..optimizers._internal import injected_hyperparameters
from ._metric_info import is_writer_process
from ._plot import PLOTTERS
from ._run_summary import run_summary
from ._writers import MetricWriter, write_metrics

_MAX_BATCH = 900  # MLflow's log_batch takes at most 1000 metrics


def _client(tracking_uri: str | None) -> Any:
    try:
        from mlflow.tracking import MlflowClient  # noqa: PLC0415 - an optional extra
    except ImportError as err:
        raise ImportError(
            "hooks.mlflow needs MLflow: pip install 'loopax[mlflow]' (mlflow-skinny, and "
            "sqlalchemy and alembic for a local sqlite:/// store)"
        ) from err
    return MlflowClient(tracking_uri=tracking_uri)


class MlflowWriter(MetricWriter):
    """Sends metric points to an MLflow run, in batches; created by `hooks.mlflow`.

    Its state (the run id) is kept in the checkpoints: a resumed training continues the
    same run, and skips the points that run already holds (a resumed run computes the same
    values), so no step is logged twice.

    Attributes:
      run_id: the MLflow run's id, or None before the first write.
      experiment: the experiment's name.
    """

    def __init__(self, loop: Loop, tracking_uri: str | None, experiment: str, run_name: str | None):
        self.loop = loop
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.run_id: str | None = None
        self._client: Any = None
        self._pending: list[tuple[str, float, int]] = []
        self._resumed = False
        self._logged_through: dict[str, int] = {}  # per key, on a resumed run
        self._batch_size: int | None = None

    # -- checkpointed state ----------------------------------------------------------------

    def get_state(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    def set_state(self, state: dict[str, Any]) -> None:
        run_id = state.get("run_id")
        if run_id and run_id != self.run_id:
            self.run_id, self._resumed = str(run_id), True
            self._logged_through.clear()

    # -- the run -----------------------------------------------------------------------------

    @property
    def client(self) -> Any:
        """The `MlflowClient` (made at first use)."""
        if self._client is None:
            self._client = _client(self.tracking_uri)
        return self._client

    def _open_run(self) -> str:
        client = self.client
        if self.run_id is not None:
            client.update_run(self.run_id, status="RUNNING")  # a resumed run goes on
            return self.run_id
        found = client.get_experiment_by_name(self.experiment)
        experiment_id = (
            found.experiment_id if found is not None else client.create_experiment(self.experiment)
        )
        run = client.create_run(experiment_id, run_name=self.run_name, tags={"loopax": "1"})
        run_id: str = run.info.run_id
        self.run_id = run_id
        self._log_parameters()
        return run_id

    def _log_parameters(self) -> None:
        from mlflow.entities import Param  # noqa: PLC0415

        trainer = self.loop.trainer
        params: dict[str, Any] = {
            "devices": trainer.num_devices,
            "processes": jax.process_count(),
            "parallel": trainer.parallel,
            "steps_per_execution": self.loop.steps_per_execution,
            "accumulate_steps": trainer.accumulate_steps,
        }
        if self._batch_size is not None:
            params["batch_size"] = self._batch_size * jax.process_count()
        state = trainer.state
        if state is not None:
            for name, value in injected_hyperparameters(state.opt_state).items():
                params[f"optimizer/{name}"] = f"{value:.6g}"
        mesh = getattr(trainer, "mesh", None)
        if mesh is not None:
            params["mesh"] = str(dict(mesh.shape)) if hasattr(mesh, "shape") else str(mesh)
        self.client.log_batch(
            self.run_id, params=[Param(key, str(value)) for key, value in params.items()]
        )
        with tempfile.TemporaryDirectory() as tmp:
            summary = Path(tmp) / "run_summary.md"
            summary.write_text(run_summary(trainer) + "\n")
            self.client.log_artifact(self.run_id, str(summary))

    def on_start(self, loop: Loop, dataset: Any) -> None:
        del loop
        batch_size = getattr(dataset, "batch_size", None)
        if isinstance(batch_size, (int, np.integer)):
            self._batch_size = int(batch_size)

    # -- points ----------------------------------------------------------------------------

    def _already_logged(self, key: str, step: int) -> bool:
        if not self._resumed or self.run_id is None:
            return False
        if key not in self._logged_through:
            history = self.client.get_metric_history(self.run_id, key)
            self._logged_through[key] = max((m.step for m in history), default=-1)
        return step <= self._logged_through[key]

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        if self.run_id is None or self._client is None:
            self._open_run()
        for key, value in scalars.items():
            value = float(value)
            if np.isfinite(value) and not self._already_logged(key, step):
                self._pending.append((key, value, int(step)))
        if len(self._pending) >= _MAX_BATCH:
            self.flush()

    def truncate_after(self, step: int) -> None:
        # MLflow cannot drop points it holds: drop those not sent yet. A resumed run skips
        # what the run holds; a rollback in this process logs its steps again.
        self._pending = [point for point in self._pending if point[2] <= step]

    def flush(self) -> None:
        if not self._pending:
            return
        from mlflow.entities import Metric  # noqa: PLC0415

        now = int(time.time() * 1000)
        while self._pending:
            batch, self._pending = self._pending[:_MAX_BATCH], self._pending[_MAX_BATCH:]
            metrics = [Metric(key, value, now, step) for key, value, step in batch]
            self.client.log_batch(self.run_id, metrics=metrics)

    def on_end(self, loop: Loop, metrics: Any) -> None:
        """Sends what is pending, the plots as artifacts, and marks the run finished."""
        del metrics
        if self.run_id is None:
            return
        self.flush()
        for plotter in loop.shared_data.get(PLOTTERS, []):
            plotter.flush()  # its last render finished
            for png in plotter.png_paths:
                if Path(png).exists():
                    self.client.log_artifact(self.run_id, str(png), artifact_path="plots")
        self.client.set_terminated(self.run_id, status="FINISHED")

    def on_error(self, loop: Loop, error: BaseException) -> None:
        del loop, error
        if self.run_id is not None:
            # A resumed run skips what this sends: its values are the same.
            self.flush()
            self.client.set_terminated(self.run_id, status="FAILED")

    def __repr__(self) -> str:
        return f"MlflowWriter(experiment={self.experiment!r}, run_id={self.run_id!r})"


def mlflow(
    loop: Loop,
    *,
    tracking_uri: str | None = None,
    experiment: str = "loopax",
    run_name: str | None = None,
    every_n_steps: int = 100,
) -> MlflowWriter:
    """Logs the loop's metric points, hyperparameters and plots to an MLflow run.

    The same keys and points as the other writers (`train/loss`, `train/learning_rate`,
    `eval/test/Accuracy`, ...): train metrics every `every_n_steps` and at the end of each
    run, every evaluation when it is published. At the first write, the run gets the
    Trainer's hyperparameters as parameters (devices, processes, steps per execution,
    accumulation, the global batch size when the dataset has a `batch_size`, the
    optimizer's injected hyperparameters such as `optimizer/learning_rate`, and the mesh)
    and the run summary (`run_summary.md`, as TensorBoard's text) as an artifact; at the end
    of each run, the PNGs of the loop's `hooks.plot` as artifacts under `plots/`.

    Points are sent in batches, when `loop.flush()` runs (before every checkpoint commits)
    and at the end of each run. The run id is kept in the checkpoints: a resumed training
    continues the same run and leaves out the points the run already holds, so no step is
    logged twice and every value equals an uninterrupted run's (a resumed run computes the
    same values). A rollback in the same process (`nan_guard`) logs its steps again. Only
    process 0 writes. Needs `pip install 'loopax[mlflow]'`.

    Args:
      loop: the `loopax.Loop`.
      tracking_uri: where runs are kept: None for MLflow's default (`MLFLOW_TRACKING_URI`
        or `./mlruns`), a server `http://...`, or a local store `sqlite:///path.db`.
      experiment: the experiment's name (created if missing).
      run_name: the run's name (None: MLflow picks one).
      every_n_steps: log the train metrics after step k iff `(k + 1) % every_n_steps == 0`.

    Returns:
      The `MlflowWriter` (`run_id`, `client`).

    Raises:
      ImportError: MLflow is not installed (at the first write).
      ValueError: `every_n_steps` is not a positive int.
    """
    writer = MlflowWriter(loop, tracking_uri, str(experiment), run_name)
    name = f"mlflow({experiment})"
    write_metrics(loop, writer, every_n_steps=every_n_steps, learning_rate=True, name=name)
    loop.add_state(name, writer)
    if is_writer_process():
        loop.on_start(name, writer.on_start, Priority.LOG - 1)
        loop.on_end(name, writer.on_end, Priority.LOG + 1, check_finite=False)
        loop.on_error(name, writer.on_error)
    return writer
