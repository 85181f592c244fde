"""A steady per-step run on an on-device dataset costs the host few Python calls a step.

On an accelerator the host feeds the device's queue, so every microsecond of Python a step
counts: a tiny model's per-step Loop ran at half a hand-written loop's rate on an H200. With
`ArrayDataset(on_device=True)` a step's read is where its batch lies (the step program
slices it), and `Trainer.run` a cached executor's call; neither may grow back into a walk of
records, keys and dataclass copies. Counted deterministically in Python calls
(`sys.setprofile`), by loop step, over a stretch of a run with no epoch end and no hook.
"""

import collections
import sys

import jax
import numpy as np
import optax
import pytest

from loopax import ArrayDataset, Loop
from tests._tiny import python_calls_by_step, tiny_batch, tiny_data, tiny_trainer

# One epoch of 1000 batches: the counted steps 200-399 cross no epoch end (whose new
# permutation and permuted copy are a per-epoch cost, not a step's).
BATCHES = 1000
FIRST_RUN, COUNTED_RUN = 200, 200
QUIET = range(208, 392)  # 184 steps: 23 whole groups of 8, away from the run's ends
# Python calls a steady step makes: the read (`StepReader.read`, `ArrayDataset.device_step`,
# the epoch's order, one `DeviceChunk`), `Trainer.run` (the executor's kept key, the
# chunk's program arguments, the compiled call, JAX unflattening its outputs: the optax
# states' named tuples and the `TrainState`), the metrics named, the loop's tail (the
# in-flight window, whose wait every 16 steps adds a few). Measured 26.3; 44.3 before the
# per-step read was cut down (`device_steps(1)`, a `dataclasses.replace` and two
# dataclass inits a step) and the executor's key kept.
CALLS_PER_STEP = 27.0
# A fused group of 8 steps, read through `device_steps`: measured 42.3 (50.3 before).
CALLS_PER_GROUP = 45.0


def _calls_by_step(steps_per_execution: int) -> collections.Counter:
    trainer = tiny_trainer()
    loop = Loop(trainer, steps_per_execution=steps_per_execution)
    data: ArrayDataset = tiny_data(BATCHES, shuffle=True, on_device=True, devices=trainer.devices)
    loop.run_steps(data, FIRST_RUN)
    calls = python_calls_by_step(loop, data, COUNTED_RUN)
    assert loop.loop_step == FIRST_RUN + COUNTED_RUN
    return calls


@pytest.mark.parametrize("steps_per_execution", [1, 8])
def test_a_steady_step_on_device_data_makes_few_python_calls(steps_per_execution):
    calls = _calls_by_step(steps_per_execution)
    total = sum(calls[step] for step in QUIET)
    if steps_per_execution == 1:
        per_step = total / len(QUIET)
        assert 10 < per_step <= CALLS_PER_STEP, (
            f"a steady per-step run on an on-device ArrayDataset makes {per_step:.2f} Python "
            f"calls a step; at most {CALLS_PER_STEP} expected"
        )
    else:
        per_group = total / (len(QUIET) / steps_per_execution)
        assert 10 < per_group <= CALLS_PER_GROUP, (
            f"a steady fused run of groups of {steps_per_execution} on an on-device "
            f"ArrayDataset makes {per_group:.2f} Python calls a group; at most "
            f"{CALLS_PER_GROUP} expected"
        )


def test_a_kept_program_key_follows_the_data_the_steps_read():
    # `Trainer.run` keeps the on-device step program's key between steps of an epoch. A
    # one-step fused group (read through the epoch's permutation) between single steps
    # (read from its permuted copy), data of the same shapes read in order (sliced), and
    # a trainer whose programs were dropped (`skip_non_finite_steps` recompiles) each find
    # their own program: the steps equal single steps on the host datasets, bit for bit.
    params = []
    for on_device in (False, True):
        trainer = tiny_trainer()
        single = Loop(trainer)
        fused = Loop(trainer, steps_per_execution=8) if on_device else single
        devices = trainer.devices if on_device else None
        data = tiny_data(4, shuffle=True, on_device=on_device, devices=devices)
        single.run_steps(data, 6)  # over an epoch's end
        fused.run_steps(data, 9)  # groups of 8 steps and of 1
        single.run_steps(data, 6)
        trainer.skip_non_finite_steps(True)  # drops the compiled programs
        single.run_steps(data, 3)
        single.run_steps(tiny_data(4, shuffle=False, on_device=on_device, devices=devices), 6)
        params.append(jax.device_get(trainer.params))
    jax.tree.map(np.testing.assert_array_equal, *params)


def _calls(fn):
    """`fn()`'s result and the Python calls it made."""
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(profile)
    try:
        result = fn()
    finally:
        sys.setprofile(None)
    return result, calls


@pytest.mark.parametrize("injected", [False, True])
def test_the_learning_rate_is_looked_for_in_the_optimizer_state_once(injected):
    # TensorBoard logs the learning rate with the train metrics (every 100 steps by
    # default). Finding it walks the optimizer state (dozens of calls): done once, then
    # by position (a scheduled rate) or, where the state holds none (plain `optax.adam`),
    # answered None at once.
    schedule = optax.linear_schedule(0.01, 0.02, 100)
    optimizer = (
        optax.inject_hyperparams(optax.adam)(learning_rate=schedule)
        if injected
        else optax.adam(0.01)
    )
    trainer = tiny_trainer(optimizer=optimizer)
    assert trainer.learning_rate_array() is None  # no state yet
    trainer.train_step(*tiny_batch())
    trainer.learning_rate_array()  # compiles the copy of a scheduled rate
    trainer.state = trainer.state  # a new state, whose structure is looked through again
    first, walked = _calls(trainer.learning_rate_array)
    again, calls = _calls(trainer.learning_rate_array)
    assert walked > 10  # the walk, which the new state brought back, is counted
    if injected:
        assert float(first) == float(again) == pytest.approx(0.01, rel=0.05)
    else:
        assert first is None and again is None
    assert calls <= 12, f"learning_rate_array made {calls} Python calls again ({walked} first)"
