"""Trigger helpers and ready hooks for `loopax.Loop`."""

from ._checkpoint import Checkpointer as Checkpointer
from ._checkpoint import checkpoint as checkpoint
from ._evaluate import Evaluator as Evaluator
from ._evaluate import evaluate as evaluate
from ._evaluate import report_eval as report_eval
from ._metrics_log import MetricsLog as MetricsLog
from ._metrics_log import metrics_log as metrics_log
from ._plot import Plotter as Plotter
from ._plot import plot as plot
from ._progress import ProgressBar as ProgressBar
from ._progress import progress_bar as progress_bar
from ._tensorboard import TensorBoardWriter as TensorBoardWriter
from ._tensorboard import tensorboard as tensorboard
from ._triggers import every_n_steps as every_n_steps
from ._triggers import exponential_callback as exponential_callback
from ._triggers import n_times_during_loop as n_times_during_loop
from ._triggers import periodic_callback as periodic_callback

__all__ = [
    "Checkpointer",
    "Evaluator",
    "MetricsLog",
    "Plotter",
    "ProgressBar",
    "TensorBoardWriter",
    "checkpoint",
    "evaluate",
    "every_n_steps",
    "exponential_callback",
    "metrics_log",
    "n_times_during_loop",
    "periodic_callback",
    "plot",
    "progress_bar",
    "report_eval",
    "tensorboard",
]
