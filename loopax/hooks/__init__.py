"""Schedules, trigger helpers and ready hooks for `loopax.Loop`."""

from .._public import show_errors_under
from ..loop import Schedule as Schedule
from ..loop._internal import AnyOf as AnyOf
from ._checkpointing._checkpointer import Checkpointer as Checkpointer
from ._checkpointing._checkpointer import NoGoodCheckpointError as NoGoodCheckpointError
from ._checkpointing._coordination import CoordinationError as CoordinationError
from ._checkpointing._hook import checkpoint as checkpoint
from ._checkpointing._io import DamagedCheckpointError as DamagedCheckpointError
from ._checkpointing._writer import BackgroundSaveError as BackgroundSaveError
from ._checkpointing._writer import NonFiniteSaveError as NonFiniteSaveError
from ._early_stopping import EarlyStopping as EarlyStopping
from ._early_stopping import early_stopping as early_stopping
from ._evaluate import Evaluator as Evaluator
from ._evaluate import evaluate as evaluate
from ._evaluate import report_eval as report_eval
from ._metrics_log import MetricsLog as MetricsLog
from ._metrics_log import metrics_log as metrics_log
from ._mlflow import MlflowWriter as MlflowWriter
from ._mlflow import mlflow as mlflow
from ._nan_guard import NanGuard as NanGuard
from ._nan_guard import nan_guard as nan_guard
from ._plateau import ReduceLROnPlateau as ReduceLROnPlateau
from ._plateau import reduce_lr_on_plateau as reduce_lr_on_plateau
from ._plot import Plotter as Plotter
from ._plot import plot as plot
from ._profile import Profiler as Profiler
from ._profile import profile as profile
from ._progress import ProgressBar as ProgressBar
from ._progress import progress_bar as progress_bar
from ._replicas import check_replicas as check_replicas
from ._schedules import AtSteps as AtSteps
from ._schedules import EveryNEpochs as EveryNEpochs
from ._schedules import EveryNSteps as EveryNSteps
from ._schedules import Exponential as Exponential
from ._schedules import FirstNSteps as FirstNSteps
from ._schedules import NTimes as NTimes
from ._schedules import Periodic as Periodic
from ._tensorboard import TensorBoardWriter as TensorBoardWriter
from ._tensorboard import tensorboard as tensorboard
from ._throughput import Throughput as Throughput
from ._throughput import throughput as throughput
from ._time_limit import TimeLimit as TimeLimit
from ._time_limit import time_limit as time_limit
from ._triggers import at_steps as at_steps
from ._triggers import every_n_epochs as every_n_epochs
from ._triggers import every_n_steps as every_n_steps
from ._triggers import exponential_callback as exponential_callback
from ._triggers import first_n_steps as first_n_steps
from ._triggers import n_times_during_loop as n_times_during_loop
from ._triggers import on_schedule as on_schedule
from ._triggers import periodic_callback as periodic_callback
from ._writers import MetricWriter as MetricWriter
from ._writers import WriterHooks as WriterHooks
from ._writers import write_metrics as write_metrics

__all__ = [
    "AnyOf",
    "AtSteps",
    "BackgroundSaveError",
    "Checkpointer",
    "CoordinationError",
    "DamagedCheckpointError",
    "EarlyStopping",
    "Evaluator",
    "EveryNEpochs",
    "EveryNSteps",
    "Exponential",
    "FirstNSteps",
    "MetricWriter",
    "MetricsLog",
    "MlflowWriter",
    "NTimes",
    "NanGuard",
    "NoGoodCheckpointError",
    "NonFiniteSaveError",
    "Periodic",
    "Plotter",
    "Profiler",
    "ProgressBar",
    "ReduceLROnPlateau",
    "Schedule",
    "TensorBoardWriter",
    "Throughput",
    "TimeLimit",
    "WriterHooks",
    "at_steps",
    "check_replicas",
    "checkpoint",
    "early_stopping",
    "evaluate",
    "every_n_epochs",
    "every_n_steps",
    "exponential_callback",
    "first_n_steps",
    "metrics_log",
    "mlflow",
    "n_times_during_loop",
    "nan_guard",
    "on_schedule",
    "periodic_callback",
    "plot",
    "profile",
    "progress_bar",
    "reduce_lr_on_plateau",
    "report_eval",
    "tensorboard",
    "throughput",
    "time_limit",
    "write_metrics",
]

show_errors_under(__name__, globals())  # `loopax.HookError: ...` in a traceback
