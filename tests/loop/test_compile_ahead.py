"""Fused group sizes compiled ahead, in the background: no group after the first compiles.

With `steps_per_execution=K` a group ends at the next step a scheduled hook fires at, so a
schedule asks for several power-of-two group sizes, each a program of its own. When a group
starts the steps up to the next such step, the loop has the trainer compile the sizes they
will take on a background thread (`Trainer.compile_ahead`); the training thread compiles
only the group it runs first. What is checked here does not depend on timing: which thread
compiled each program (JAX reports every compilation with its program's name), when and where
`on_exec_creation` reports them, and that the results are those of the steps run one by one.
"""

import threading

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import loopax
from loopax import hooks
from loopax.testing._compilations import BACKEND_COMPILE_EVENT

ONE_DEVICE = jax.devices()[:1]
BATCH_SIZE = 8
K = 8


def model_fn(ctx, spec, inputs):
    hidden = nn.relu(nn.Dense(16)(inputs[0]))
    hidden = nn.Dropout(0.3, deterministic=not ctx.training)(hidden)
    return nn.Dense(1)(hidden)


def new_trainer():
    return loopax.Trainer(
        model_fn, loopax.losses.mean_squared_error, optax.adam(0.01), devices=ONE_DEVICE
    )


def make_data(on_device):
    rng = np.random.default_rng(0)
    inputs = rng.normal(size=(13 * BATCH_SIZE, 4)).astype(np.float32)
    labels = inputs[:, :2].sum(axis=1, keepdims=True)
    return loopax.ArrayDataset(
        inputs, labels, BATCH_SIZE, loop_forever=True, seed=1, on_device=on_device,
        devices=ONE_DEVICE if on_device else None,
    )  # fmt: skip


class CompileLog:
    """Every XLA compilation while it is open: (program name, thread name)."""

    def __init__(self):
        self.compiles = []

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._on_duration)

    def _on_duration(self, event, duration, **kwargs):
        del duration
        if event == BACKEND_COMPILE_EVENT:
            name = str(kwargs.get("fun_name", ""))
            self.compiles.append((name, threading.current_thread().name))


def train_program(name):
    # One step, stacked steps, steps gathering their batches on the device.
    return name in ("jit(train)", "jit(train_steps)", "jit(program)")


@pytest.mark.parametrize("on_device", [True, False], ids=["on-device", "host-batches"])
def test_after_the_first_group_no_train_program_compiles_on_the_training_thread(on_device):
    trainer = new_trainer()
    loop = loopax.Loop(trainer, steps_per_execution=K)
    reports = []  # (graph type, steps, thread) of each report, in order
    trainer.on_exec_creation(
        lambda info: reports.append((info.graph_type, info.steps, threading.current_thread()))
    )
    compiles_by_step = {}

    def note(loop, metrics):
        compiles_by_step[trainer.global_step] = list(log.compiles)

    # Every 13 steps: groups of 8, 4 and 1 in each stretch between firings.
    hooks.every_n_steps(loop, 13, "note", note)
    with CompileLog() as log:
        loop.run_steps(make_data(on_device), 39)

    main = threading.current_thread().name
    train_compiles = [(name, thread) for name, thread in log.compiles if train_program(name)]
    on_main = [name for name, thread in train_compiles if thread == main]
    assert len(on_main) == 1, log.compiles  # the first group's, 8 steps
    assert len(train_compiles) == 3, log.compiles  # 8, 4 and 1 steps
    in_background = [name for name, thread in train_compiles if thread.startswith("loopax-")]
    assert len(in_background) == 2, log.compiles
    # The state's creation compiled in the background too, beside the first group's program.
    creation = [thread for name, thread in log.compiles if "create" in name]
    assert len(creation) == 1 and creation[0].startswith("loopax-compile"), log.compiles
    # Nothing compiled after the first stretch of 13 steps.
    assert compiles_by_step[26] == compiles_by_step[13] == compiles_by_step[39]
    # Each program reported once, on the training thread, when first used: 8, then 4, then 1.
    assert [(graph, steps) for graph, steps, _ in reports] == [
        ("train_steps", 8),
        ("train_steps", 4),
        ("train_steps" if on_device else "train", 1),
    ]
    assert {thread for _, _, thread in reports} == {threading.current_thread()}
    assert len(trainer.executors()) == 3


@pytest.mark.parametrize("on_device", [True, False], ids=["on-device", "host-batches"])
def test_results_equal_the_steps_run_one_by_one(on_device):
    fused = new_trainer()
    loop = loopax.Loop(fused, steps_per_execution=K)
    losses = {}
    hooks.every_n_steps(
        loop, 5, "loss", lambda loop, m: losses.setdefault(loop.trainer.global_step, m["loss"])
    )
    loop.run_steps(make_data(on_device), 23)

    one_by_one = new_trainer()
    data = make_data(on_device)
    step_losses = {}
    for _ in range(23):
        metrics = one_by_one.train_step(*data.yield_batch())
        step_losses[one_by_one.global_step] = metrics["loss"]

    for (path, want), got in zip(
        jax.tree_util.tree_flatten_with_path(jax.device_get(one_by_one.params))[0],
        jax.tree.leaves(jax.device_get(fused.params)),
        strict=True,
    ):
        if on_device:  # the same programs' arithmetic: bit for bit
            assert np.array_equal(want, got), jax.tree_util.keystr(path)
        else:  # batches stacked on the host: equal to float rounding (see the fused guide)
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    for step, loss in losses.items():
        np.testing.assert_allclose(np.asarray(loss), np.asarray(step_losses[step]), rtol=1e-6)


def test_a_group_needing_a_program_still_compiling_waits_for_it_and_compiles_it_once():
    """The sizes asked for are compiled once, whichever thread gets to them first."""
    trainer = new_trainer()
    loop = loopax.Loop(trainer, steps_per_execution=K)
    hooks.every_n_steps(loop, 5, "cut", lambda loop, metrics: None)  # groups of 4, then 1
    with CompileLog() as log:
        loop.run_steps(make_data(True), 20)
    train_compiles = [name for name, _ in log.compiles if train_program(name)]
    assert len(train_compiles) == 2, log.compiles  # 4 and 1 steps, each once
    assert trainer.global_step == 20
    assert sorted(info.info.steps for info in trainer.executors()) == [1, 4]
