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

# JAX records this duration event once per program it lowers (traced, then turned into the
# module XLA compiles), on the thread that lowers it: loopax lowers every train program on
# the training thread, those it compiles in the background included.
LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"

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
        self.lowerings = []  # the names of the programs lowered, in order

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
        elif event == LOWERING_EVENT:
            self.lowerings.append(str(kwargs.get("fun_name", "")))


def train_program(name):
    # One step, stacked steps, steps gathering their batches on the device.
    return name in ("jit(train)", "jit(train_steps)", "jit(train_steps_gathered)")


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


class FirstGroupEnd(loopax.hooks.Schedule):
    """Fires once, at the end of a run's first group, which it does not cut short.

    A clock schedule's kind (`time_based`): with fused steps it is asked at group ends only.
    """

    time_based = True
    checks_every_step = True

    def start_run(self, run):
        self.fired_once = False

    def should_fire(self, run):
        fire, self.fired_once = not self.fired_once, True
        return fire


def programs_before_the_first_step(steps_per_execution, on_device):
    """The train programs lowered and compiled before a run's first group ended, and in all.

    The run: 39 steps, a hook every 13 (groups of 8, 4 and 1 between its firings with K=8).
    """
    trainer = new_trainer()
    loop = loopax.Loop(trainer, steps_per_execution=steps_per_execution)
    first = {}

    def at_first_group_end(loop, metrics):
        jax.block_until_ready(metrics["loss"])
        first["step"] = trainer.global_step
        first["lowered"] = [name for name in log.lowerings if train_program(name)]
        first["compiled"] = [name for name, _ in log.compiles if train_program(name)]

    loop.on_step("first group", at_first_group_end, when=FirstGroupEnd())
    hooks.every_n_steps(loop, 13, "cut", lambda loop, metrics: None)
    with CompileLog() as log:
        loop.run_steps(make_data(on_device), 39)
    compiled = [name for name, _ in log.compiles if train_program(name)]
    return first, compiled, trainer


@pytest.mark.parametrize("on_device", [True, False], ids=["on-device", "host-batches"])
def test_before_its_first_step_a_fused_run_builds_only_the_first_groups_program(on_device):
    """Issue 33 item 4: a fused run's first step waits for one program, as a per-step run's.

    The other group sizes (4 and 1 here) are lowered and compiled once the first group has
    run: before, they were lowered on the training thread before the first group and
    compiled beside its program, and the first step waited for that.
    """
    first, compiled, trainer = programs_before_the_first_step(K, on_device)
    assert first["step"] == K  # the hook did not cut the first group short
    assert len(first["lowered"]) == 1, first  # the 8 steps' program alone
    assert len(first["compiled"]) == 1, first
    # Over the run: one program per group size (8, 4, 1), each compiled once.
    assert len(compiled) == 3, compiled
    assert sorted(executor.info.steps for executor in trainer.executors()) == [1, 4, 8]

    per_step_first, per_step_compiled, _ = programs_before_the_first_step(1, on_device)
    assert per_step_first["step"] == 1
    assert len(per_step_first["lowered"]) == len(first["lowered"])
    assert len(per_step_compiled) == 1  # one program for every step
