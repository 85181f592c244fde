"""`Trainer(compiler_options=...)`: XLA compiles every program of the trainer with them, and
with nothing else; XLA's refusal of one names it; bad types fail at construction."""

import collections
import contextlib
import os
import re
import threading

import jax
import numpy as np
import pytest
from _tiny import tiny_arrays, tiny_batch, tiny_data, tiny_trainer

import loopax
from loopax.hooks._run_summary import run_summary


def programs_dumped(directory):
    """The program names in XLA's dump file names (`module_0012.jit_train.<what>.txt`)."""
    names = (re.match(r"module_\d+\.jit_([^.]+)\.", name) for name in os.listdir(directory))
    return {match.group(1) for match in names if match}


def every_program(trainer):
    """Runs `trainer` through each kind of program; what each returned, on the host."""
    _, inputs, labels = tiny_batch()
    stacked = [np.stack([a, a]) for a in inputs], [np.stack([a, a]) for a in labels]
    results = [trainer.train_step(None, inputs, labels), trainer.train_steps(None, *stacked)]
    on_device = tiny_data(on_device=True, devices=trainer.devices, shuffle=True, seed=1)
    loopax.Loop(trainer, steps_per_execution=2).run_steps(on_device, 2)  # the fused gather
    results += [trainer.evaluate(tiny_data()), trainer.predict(tiny_arrays(8)[0])]
    return jax.device_get((results, trainer.state_dict()))


def test_every_program_compiles_with_the_options_of_its_trainer_only(tmp_path):
    dump = tmp_path / "dump"
    dumping = tiny_trainer(compiler_options={"xla_dump_to": str(dump)})
    assert dict(dumping.compiler_options) == {"xla_dump_to": str(dump)}
    assert "compiler_options={'xla_dump_to'" in repr(dumping)
    dumped = every_program(dumping)

    # The state's creation, a step, fused steps on stacked batches and on the devices' arrays
    # (a program per group size), the eval metrics' fresh states, evaluation, prediction. A
    # program JAX loads from its persistent cache is dumped too (its optimized HLO).
    assert programs_dumped(dump) >= {
        "create",
        "train",
        "train_steps",
        "train_steps_gathered",
        "_eval_metrics",
        "eval",
        "predict",
    }
    files = sorted(os.listdir(dump))

    plain = tiny_trainer()
    assert dict(plain.compiler_options) == {}
    assert repr(plain).endswith("executors=0)")
    # XLA_FLAGS' --xla_dump_to names no program's options: only `dumping` wrote there.
    jax.tree.map(np.testing.assert_array_equal, every_program(plain), dumped)
    assert sorted(os.listdir(dump)) == files


@contextlib.contextmanager
def cache_lookups():
    """The persistent cache's lookups and hits on this thread, counted by JAX's events.

    The train program compiles on the calling thread; another test's compiling left running
    in the background is not counted.
    """
    counts = collections.Counter()
    thread = threading.get_ident()

    def listener(event, **kwargs):
        if threading.get_ident() == thread:
            counts[event] += 1

    jax.monitoring.register_event_listener(listener)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_listener(listener)


LOOKUPS = "/jax/compilation_cache/compile_requests_use_cache"
HITS = "/jax/compilation_cache/cache_hits"


def test_the_options_are_part_of_the_persistent_cache_key():
    # A GPU option: on a CPU it changes no result, only the key (tests/conftest.py keeps one
    # persistent cache for the run, and min compile time 0 keeps every program in it).
    options = {"xla_gpu_autotune_level": 1}
    batch = tiny_batch()
    tiny_trainer().train_step(*batch)  # compiled or loaded: in the cache now
    with cache_lookups() as first:
        tiny_trainer(compiler_options=options).train_step(*batch)
    assert first[LOOKUPS] == 1 and first[HITS] == 0  # not the program compiled without them
    with cache_lookups() as again:
        tiny_trainer(compiler_options=options).train_step(*batch)
    assert again[LOOKUPS] == again[HITS] == 1  # the same options: loaded


@pytest.mark.parametrize(
    ("options", "refused"),
    [
        ({"xla_no_such_option": True}, "No such compile option: 'xla_no_such_option'"),
        ({"xla_dump_hlo_as_text": "yes"}, "'yes' is not a valid bool value"),
    ],
    ids=["unknown name", "wrong value type"],
)
@pytest.mark.parametrize("first", ["train_step", "evaluate"])
def test_an_option_xla_refuses_fails_the_first_compile_naming_it(options, refused, first):
    trainer = tiny_trainer(compiler_options=options)
    ((key, value),) = options.items()
    expected = (
        rf"XLA refused Trainer\(compiler_options=\.\.\.\)'s '{key}': {value!r} .*{refused}.*"
        "each key must be a field of XLA's DebugOptions"
    )
    with pytest.raises(ValueError, match=expected) as raised:
        if first == "train_step":
            trainer.train_step(*tiny_batch())
        else:  # the eval metrics' states are compiled first, with jax.jit
            trainer.evaluate(tiny_data())
    assert isinstance(raised.value.__cause__, jax.errors.JaxRuntimeError)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ([("xla_dump_to", "d")], TypeError, r"must be a mapping .* got list"),
        ({1: True}, TypeError, r"has the key 1 \(int\); keys must be XLA option names"),
        ({"xla_dump_to": None}, TypeError, r"'xla_dump_to': None \(NoneType\); a value must"),
        ({"xla_dump_to": ["d"]}, TypeError, r"'xla_dump_to': \['d'\] \(list\)"),
        ({"--xla_dump_to": "d"}, ValueError, r"without the leading '--' of XLA_FLAGS"),
        ({"": 1}, ValueError, r"has the key ''"),
    ],
)  # fmt: skip
def test_bad_options_fail_at_construction(options, error, message):
    with pytest.raises(error, match=r"Trainer\(compiler_options=\.\.\.\) .*" + message):
        tiny_trainer(compiler_options=options)


def test_numpy_scalars_become_python_values_and_the_options_are_read_only():
    given = {"xla_gpu_autotune_level": np.int64(1), "xla_dump_hlo_as_text": np.bool_(True)}
    trainer = tiny_trainer(compiler_options=given)
    options = trainer.compiler_options
    assert options == {"xla_gpu_autotune_level": 1, "xla_dump_hlo_as_text": True}
    assert [type(v) for v in options.values()] == [int, bool]
    given["xla_dump_to"] = "elsewhere"  # the trainer keeps its own copy
    assert "xla_dump_to" not in trainer.compiler_options
    with pytest.raises(TypeError):
        trainer.compiler_options["xla_dump_to"] = "d"  # pyright: ignore[reportIndexIssue]


def test_the_run_summary_shows_the_options():
    # The summary that hooks.tensorboard and hooks.mlflow log.
    summary = run_summary(tiny_trainer(compiler_options={"xla_gpu_autotune_level": 1}), [])
    assert "**compiler options:** `xla_gpu_autotune_level=1`" in summary
    assert "compiler options" not in run_summary(tiny_trainer(), [])
