"""Fused execution: `Loop(trainer, steps_per_execution=K)` runs up to K steps per compiled call.

Whatever K, a run must give what K = 1 gives: the same parameters (bit for bit on CPU), the
same steps for every step-based trigger, the same logs and checkpoints, the same first bad
step. Every-step hooks run once per group of fused steps, time-based ones at group ends.
"""

import csv
import math

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from tensorboard_runs import keyed_scalars

import loopax
from loopax import hooks

ONE_DEVICE = jax.devices()[:1]
BATCH_SIZE = 8
BATCHES_PER_EPOCH = 13  # an epoch that is not a multiple of any K > 1 tested
STEPS = 101  # not a multiple of any K > 1 tested
FUSED = [4, 32]


def model_fn(ctx, spec, inputs):
    hidden = nn.relu(nn.Dense(16)(inputs[0]))
    # Dropout: each fused step must draw the random bits its single step would.
    hidden = nn.Dropout(0.3, deterministic=not ctx.training)(hidden)
    return nn.Dense(1)(hidden)


def new_trainer(**kwargs):
    kwargs.setdefault("devices", ONE_DEVICE)
    return loopax.Trainer(model_fn, loopax.losses.mean_squared_error, optax.adam(0.01), **kwargs)


def make_data(batches=BATCHES_PER_EPOCH, *, loop_forever=True, nan_at_batch=None, **kwargs):
    """A shuffled regression set; with `nan_at_batch=k` the k-th batch holds NaN (in order)."""
    rng = np.random.default_rng(0)
    inputs = rng.normal(size=(batches * BATCH_SIZE, 4)).astype(np.float32)
    labels = inputs[:, :2].sum(axis=1, keepdims=True)
    if nan_at_batch is not None:
        inputs[nan_at_batch * BATCH_SIZE : (nan_at_batch + 1) * BATCH_SIZE] = np.nan
        kwargs["shuffle"] = False
    kwargs.setdefault("name", "train")
    return loopax.ArrayDataset(
        inputs, labels, BATCH_SIZE, loop_forever=loop_forever, seed=1, **kwargs
    )


def make_test_data():
    return make_data(3, loop_forever=False, name="test", shuffle=False)


_COMPILED = {}


def make_trainer():
    """The module's trainer back at its freshly initialized state (step 0).

    Compiling costs seconds and a step microseconds: one trainer serves every K (its
    executables are per step count and shape), handed out again with its initial state.
    """
    if "trainer" not in _COMPILED:
        trainer = new_trainer()
        initial = []
        trainer.add_state_initializer(lambda state: initial.append(jax.device_get(state)) or state)
        trainer.train_step(*make_data().yield_batch())
        _COMPILED["trainer"] = trainer, initial[0]
    trainer, initial_state = _COMPILED["trainer"]
    trainer.state = jax.tree.map(np.array, initial_state)
    assert trainer.global_step == 0
    return trainer


def host_params(trainer):
    return jax.device_get(trainer.params)


def assert_trees_equal(expected, actual):
    assert jax.tree.structure(expected) == jax.tree.structure(actual)
    for (path, want), got in zip(
        jax.tree_util.tree_flatten_with_path(expected)[0], jax.tree.leaves(actual), strict=True
    ):
        assert np.array_equal(want, got), jax.tree_util.keystr(path)


def max_difference(expected, actual):
    return max(
        float(np.max(np.abs(np.asarray(want) - np.asarray(got))))
        for want, got in zip(jax.tree.leaves(expected), jax.tree.leaves(actual), strict=True)
    )


class Firings:
    """Hooks that record `(global step, loss of the metrics they were given)` per name."""

    def __init__(self):
        self.steps = {}

    def hook(self, name):
        def record(loop, metrics):
            self.steps.setdefault(name, []).append(
                (loop.trainer.global_step, float(np.asarray(metrics["loss"])))
            )

        return record

    def on_evaluation(self, loop, evaluation):
        self.steps.setdefault("evaluation", []).append((evaluation.step, evaluation.values))


def attach_dense_triggers(loop, firings):
    """Every step-based trigger kind, close together: groups stay short."""
    hooks.every_n_steps(loop, 7, "every 7", firings.hook("every_n_steps"))
    hooks.n_times_during_loop(loop, 5, "5 times", firings.hook("n_times_during_loop"))
    hooks.exponential_callback(loop, 3, 1.7, "exponential", firings.hook("exponential"))
    hooks.at_steps(loop, [1, 13, 50, 99], "at", firings.hook("at_steps"))
    hooks.first_n_steps(loop, 3, "first", firings.hook("first_n_steps"))
    loop.on_step(
        "combined",
        firings.hook("combined"),
        when=hooks.EveryNSteps(30) | hooks.AtSteps([11]),
    )


def attach_sparse_triggers(loop, firings):
    """Triggers far apart: groups of 32 steps run between them."""
    hooks.every_n_steps(loop, 45, "every 45", firings.hook("every_n_steps"))
    hooks.n_times_during_loop(loop, 2, "twice", firings.hook("n_times_during_loop"))
    hooks.exponential_callback(loop, 5, 2.5, "exponential", firings.hook("exponential"))
    hooks.at_steps(loop, [37, 100], "at", firings.hook("at_steps"))


def train(steps_per_execution, attach, *, steps=STEPS, tmp_path=None, trainer=None):
    """Runs `steps` steps with the hooks `attach(loop, firings)` registers, a checkpoint
    every 20 steps and an evaluation every 10; returns the loop, the firings and the
    checkpointed steps."""
    trainer = trainer or make_trainer()
    loop = loopax.Loop(trainer, steps_per_execution=steps_per_execution)
    firings = Firings()
    attach(loop, firings)
    checkpointer = None
    if tmp_path is not None:
        checkpointer = hooks.checkpoint(loop, tmp_path / "ckpt", every_n_steps=20, keep=None)
        hooks.evaluate(loop, make_test_data(), every_n_steps=10)
        loop.on_evaluation("record", firings.on_evaluation)
    loop.run_steps(make_data(), steps)
    saved = None
    if checkpointer is not None:
        checkpointer.wait()
        saved = checkpointer.all_steps()
    return loop, firings.steps, saved


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The K = 1 runs every fused run must match, per trigger set."""
    runs = {}
    for name, attach in (("dense", attach_dense_triggers), ("sparse", attach_sparse_triggers)):
        loop, fired, saved = train(1, attach, tmp_path=tmp_path_factory.mktemp(name))
        runs[name] = host_params(loop.trainer), fired, saved
    return runs


# -- construction --------------------------------------------------------------------------


@pytest.mark.parametrize("steps_per_execution", [0, -4, 1.5, True, "4", None])
def test_bad_steps_per_execution_raises(steps_per_execution):
    with pytest.raises(ValueError, match=r"steps_per_execution must be a positive int"):
        loopax.Loop(new_trainer(), steps_per_execution=steps_per_execution)


def test_the_loop_repr_shows_steps_per_execution():
    loop = loopax.Loop(new_trainer(), steps_per_execution=8)
    assert loop.steps_per_execution == 8
    assert "steps_per_execution=8" in repr(loop)


@pytest.mark.parametrize("steps_per_execution", [1, *FUSED])
def test_a_batch_that_is_not_spec_inputs_labels_raises_the_same_error_whatever_k(
    steps_per_execution,
):
    pairs = [(np.ones((BATCH_SIZE, 4), np.float32),)] * 40  # 1-tuples: not a batch
    loop = loopax.Loop(new_trainer(), steps_per_execution=steps_per_execution)

    class Pairs:
        name = "pairs"

        def __init__(self):
            self.batches = iter(pairs)

        def yield_batch(self):
            return next(self.batches)

        def reset(self):
            pass

    with pytest.raises(ValueError, match=r"dataset 'pairs' yielded a tuple of 1 items"):
        loop.run_steps(Pairs(), 5)


# -- the same results and the same hook steps as single steps -------------------------------


@pytest.mark.parametrize("steps_per_execution", FUSED)
@pytest.mark.parametrize("triggers", ["dense", "sparse"])
def test_every_trigger_fires_at_the_steps_of_single_steps(
    reference, tmp_path, steps_per_execution, triggers
):
    attach = attach_dense_triggers if triggers == "dense" else attach_sparse_triggers
    loop, fired, saved = train(steps_per_execution, attach, tmp_path=tmp_path)
    want_params, want_fired, want_saved = reference[triggers]
    assert_trees_equal(want_params, host_params(loop.trainer))
    # The same steps, each hook given its step's own metrics (the same loss, bit for bit).
    assert fired == want_fired
    assert saved == want_saved == [20, 40, 60, 80, 100, 101]
    assert [step for step, _ in fired["evaluation"]] == [*range(10, 101, 10), 101]


def test_the_sparse_triggers_run_groups_of_the_full_length():
    trainer = new_trainer()
    compiled = []
    trainer.on_exec_creation(lambda info: compiled.append(info.input_shapes[0][0]))
    train(32, attach_sparse_triggers, trainer=trainer)
    # Step counts of the compiled calls (the single step's leading axis is its batch).
    assert 32 in compiled


@pytest.mark.parametrize("steps_per_execution", FUSED)
def test_run_epochs_with_an_epoch_not_a_multiple_of_k(steps_per_execution):
    def run(steps_per_execution):
        loop = loopax.Loop(make_trainer(), steps_per_execution=steps_per_execution)
        firings = Firings()
        hooks.every_n_steps(loop, 5, "every 5", firings.hook("every_n_steps"))
        # end_step is unknown in the first epoch, extrapolated after it.
        hooks.n_times_during_loop(loop, 4, "4 times", firings.hook("n_times_during_loop"))
        hooks.every_n_epochs(loop, 2, "every 2 epochs", firings.hook("every_n_epochs"))
        loop.on_epoch_end("epoch end", firings.hook("epoch_end"))
        loop.on_end("end", firings.hook("end"))
        loop.run_epochs(make_data(loop_forever=False), 3)
        return host_params(loop.trainer), firings.steps

    want_params, want_fired = run(1)
    params, fired = run(steps_per_execution)
    assert_trees_equal(want_params, params)
    assert fired == want_fired
    assert [step for step, _ in fired["epoch_end"]] == [13, 26, 39]


@pytest.mark.parametrize("steps_per_execution", FUSED)
def test_a_second_run_on_the_same_loop_continues_identically(steps_per_execution):
    def run(steps_per_execution):
        loop = loopax.Loop(make_trainer(), steps_per_execution=steps_per_execution)
        firings = Firings()
        attach_dense_triggers(loop, firings)
        data = make_data()
        loop.run_steps(data, 37)
        loop.run_steps(data, 41)
        return host_params(loop.trainer), firings.steps

    want_params, want_fired = run(1)
    params, fired = run(steps_per_execution)
    assert_trees_equal(want_params, params)
    assert fired == want_fired


# -- groups: every-step hooks, group_metrics, executables ----------------------------------


def per_step_losses(steps):
    """The loss of each of `steps` single steps."""
    loop = loopax.Loop(make_trainer())
    losses = []
    loop.on_step("loss", lambda loop, metrics: losses.append(np.asarray(metrics["loss"])))
    loop.run_steps(make_data(), steps)
    return np.stack(losses)


def test_plain_on_step_hooks_run_once_per_group_with_its_last_step_metrics():
    loop = loopax.Loop(make_trainer(), steps_per_execution=8)
    hooks.every_n_steps(loop, 5, "every 5", lambda loop, metrics: None)
    groups = []

    def record(loop, metrics):
        assert loop.trainer.global_step == loop.loop_step + 1
        group_losses = np.asarray(loop.group_metrics["loss"])
        assert np.array_equal(np.asarray(metrics["loss"]), group_losses[-1])
        groups.append((loop.loop_step - len(group_losses) + 1, loop.loop_step, group_losses))

    loop.on_step("record", record)
    loop.run_steps(make_data(), 45)
    # Contiguous groups covering every step, none past the every-5 steps or longer than K.
    assert [first for first, _, _ in groups] == [0, *[last + 1 for _, last, _ in groups[:-1]]]
    assert groups[-1][1] == 44
    assert {last + 1 for _, last, _ in groups} >= set(range(5, 46, 5))
    assert all(1 <= last - first + 1 <= 8 for first, last, _ in groups)
    assert len(groups) < 45
    # Every step's loss is in its group's metrics, bit for bit those of single steps.
    losses = np.concatenate([group_losses for _, _, group_losses in groups])
    assert np.array_equal(losses, per_step_losses(45))


def test_group_metrics_of_single_steps_have_an_axis_of_one():
    loop = loopax.Loop(make_trainer())
    shapes = []
    loop.on_step("shape", lambda loop, metrics: shapes.append(loop.group_metrics["loss"].shape))
    loop.run_steps(make_data(), 3)
    assert shapes == [(1,), (1,), (1,)]


@pytest.mark.parametrize("steps_per_execution", [2, 8, 32])
def test_at_most_log2_k_plus_one_executables_per_shape(steps_per_execution):
    trainer = new_trainer()
    compiled = []
    trainer.on_exec_creation(compiled.append)
    loop = loopax.Loop(trainer, steps_per_execution=steps_per_execution)
    attach_dense_triggers(loop, Firings())
    attach_sparse_triggers(loop, Firings())
    # 99 examples in batches of 8: 12 full batches and one of 3, so two batch shapes.
    data = make_data(loop_forever=False)
    data = loopax.ArrayDataset(
        data.inputs[0][:99], data.labels[0][:99], BATCH_SIZE, seed=1, drop_remainder=False
    )
    loop.run_epochs(data, 9)
    assert trainer.global_step == 9 * 13

    per_shape = {}
    for info in compiled:
        assert info.graph_type in ("train", "train_steps"), info
        shapes = info.input_shapes
        if info.graph_type == "train":
            per_shape.setdefault(shapes, []).append(1)
        else:
            per_shape.setdefault(tuple(shape[1:] for shape in shapes), []).append(shapes[0][0])
    assert set(per_shape) == {((BATCH_SIZE, 4),), ((3, 4),)}
    limit = int(math.log2(steps_per_execution)) + 1
    for shape, counts in per_shape.items():
        assert len(counts) == len(set(counts)) <= limit, (shape, counts)
        assert all(count & (count - 1) == 0 and count <= steps_per_execution for count in counts)
    assert len(trainer.executors()) == len(compiled)

    # Another run compiles nothing.
    loop.run_epochs(data, 2)
    assert len(trainer.executors()) == len(compiled)


def test_time_based_triggers_fire_at_group_ends():
    trainer = make_trainer()
    loop = loopax.Loop(trainer, steps_per_execution=8)
    group_ends, periodic = [], []
    loop.on_step("group end", lambda loop, metrics: group_ends.append(trainer.global_step))
    # One clock second per step run.
    hooks.periodic_callback(
        loop,
        10.0,
        "every 10 s",
        lambda loop, metrics: periodic.append(trainer.global_step),
        clock=lambda: float(trainer.global_step),
    )
    loop.run_steps(make_data(), 100)
    assert len(periodic) >= 5
    assert set(periodic) <= set(group_ends)
    assert all(
        later - earlier >= 10 for earlier, later in zip(periodic, periodic[1:], strict=False)
    )


def test_a_clock_schedule_never_cuts_a_group_short():
    # A progress bar or a periodic callback predicts the step its period ends at and asks
    # again from there; with fused steps that must not split the groups.
    trainer = make_trainer()
    loop = loopax.Loop(trainer, steps_per_execution=8)
    lengths, periodic = [], []
    loop.on_step("length", lambda loop, metrics: lengths.append(len(loop.group_metrics["loss"])))
    hooks.periodic_callback(
        loop,
        10.0,
        "every 10 s",
        lambda loop, metrics: periodic.append(trainer.global_step),
        clock=lambda: float(trainer.global_step),  # one clock second per step
    )
    loop.run_steps(make_data(), 96)
    assert lengths == [8] * 12
    # The period starts at the first group end (8), then fires at the first group end
    # 10 clock seconds after the last firing.
    assert periodic == [24, 40, 56, 72, 88]


def test_request_stop_ends_the_run_at_the_end_of_the_group():
    trainer = make_trainer()
    loop = loopax.Loop(trainer, steps_per_execution=8)
    ends = []
    loop.on_step(
        "stop", lambda loop, metrics: trainer.global_step >= 10 and loop.request_stop("enough")
    )
    loop.on_end("end", lambda loop, metrics: ends.append(loop.loop_step))
    loop.run_steps(make_data(), 100)
    # Groups of 8: the first group end at or past global step 10 is 16.
    assert trainer.global_step == 16 and ends == [16]
    assert loop.stop_reason == "enough"


def test_request_stop_from_a_scheduled_hook_stops_at_its_step():
    trainer = make_trainer()
    loop = loopax.Loop(trainer, steps_per_execution=32)
    hooks.every_n_steps(loop, 13, "stop", lambda loop, metrics: loop.request_stop("13"))
    loop.run_steps(make_data(), 100)
    assert trainer.global_step == 13


# -- non-finite losses -----------------------------------------------------------------------


@pytest.mark.parametrize("bad_step", [0, 8, 13, 15, 21])
def test_the_first_bad_step_inside_a_group_is_named(tmp_path, bad_step):
    loop = loopax.Loop(make_trainer(), steps_per_execution=8)
    checkpointer = hooks.checkpoint(loop, tmp_path / "ckpt", every_n_steps=16, keep=None)
    with pytest.raises(loopax.NonFiniteLossError, match=rf"at step {bad_step} ") as error:
        loop.run_steps(make_data(40, nan_at_batch=bad_step), 32)
    assert error.value.step == bad_step
    checkpointer.wait()
    # No checkpoint holds the bad step's state.
    assert all(step <= bad_step for step in checkpointer.all_steps())


class PoisonedDataset:
    """The module's data in order; the batches listed in `bad` hold NaN inputs.

    The batch index keeps counting after a rollback (the loop does not rewind the data).
    """

    name = "poisoned"

    def __init__(self, bad=()):
        data = make_data(50, shuffle=False)
        self.inputs, self.labels = data.inputs[0], data.labels[0]
        self.bad = bad
        self.index = 0

    def yield_batch(self):
        index, self.index = self.index, self.index + 1
        start = (index * BATCH_SIZE) % len(self.inputs)
        inputs = self.inputs[start : start + BATCH_SIZE].copy()
        if index in self.bad:
            inputs[:] = np.nan
        return None, [inputs], [self.labels[start : start + BATCH_SIZE]]

    def reset(self):
        pass

    def get_state(self):
        return {"index": self.index}

    def set_state(self, state):
        self.index = state["index"]


def guarded_run(tmp_path, steps_per_execution, bad):
    trainer = loopax.Trainer(
        model_fn,
        loopax.losses.mean_squared_error,
        # sgd: an adam keeping its learning rate in its state is not bit-identical when
        # fused (see test_an_optimizer_holding_its_learning_rate_is_bit_identical).
        loopax.optimizers.sgd(0.01),
        devices=ONE_DEVICE,
    )
    loop = loopax.Loop(trainer, steps_per_execution=steps_per_execution)
    hooks.checkpoint(loop, tmp_path / f"ckpt{steps_per_execution}", every_n_steps=5)
    guard = hooks.nan_guard(loop, max_skips=3)
    restored = []
    loop.on_restore("record", lambda loop, step: restored.append(step))
    loop.run_steps(PoisonedDataset(bad), 60)
    return guard, restored, host_params(trainer), loop.history.get_state()


@pytest.mark.parametrize(
    "bad", [{3, 9, 40}, {20, 21, 22, 23}], ids=["isolated", "streak rolled back"]
)
def test_nan_guard_skips_and_rolls_back_as_with_single_steps(tmp_path, bad):
    want_guard, want_restored, want_params, want_history = guarded_run(tmp_path, 1, bad)
    guard, restored, params, history = guarded_run(tmp_path, 8, bad)
    assert guard.skipped_steps == want_guard.skipped_steps
    assert guard.rolled_back_to == want_guard.rolled_back_to
    assert restored == want_restored
    assert_trees_equal(want_params, params)
    assert history == want_history


# -- logs: history, metrics_log, TensorBoard --------------------------------------------------


def logged_run(run_dir, steps_per_execution):
    loop = loopax.Loop(make_trainer(), steps_per_execution=steps_per_execution)
    hooks.evaluate(loop, make_test_data(), every_n_steps=25)
    hooks.metrics_log(loop, run_dir / "log.csv", every_n_steps=3)
    hooks.tensorboard(loop, run_dir / "tb", every_n_steps=5, summary=False)
    loop.run_steps(make_data(), STEPS)
    loop.flush()
    with open(run_dir / "log.csv", newline="") as file:
        rows = list(csv.reader(file))
    return loop.history.get_state(), rows, keyed_scalars(run_dir / "tb")


def test_history_metrics_log_and_tensorboard_are_those_of_single_steps(tmp_path):
    want_history, want_rows, want_scalars = logged_run(tmp_path / "single", 1)
    history, rows, scalars = logged_run(tmp_path / "fused", 32)
    assert history == want_history
    # The same rows; the file interleaves train rows (written when the loop reads their step)
    # and evaluation rows (written at once) by in-flight windows, which count compiled calls.
    assert rows[0] == want_rows[0] and sorted(rows) == sorted(want_rows)
    for metric in {row[0] for row in want_rows[1:]}:
        assert [row for row in rows if row[0] == metric] == [
            row for row in want_rows if row[0] == metric
        ]
    assert scalars == want_scalars
    logged = [int(row[3]) for row in rows[1:] if row[0] == "train/loss"]
    assert logged == [*range(3, STEPS, 3), STEPS]


# -- checkpoints and resume --------------------------------------------------------------------


class Crash(Exception):
    pass


def interrupted_then_resumed(tmp_path, first_k, second_k, crash_at=50):
    """Runs to STEPS with K = `first_k` until a hook crashes at the first group end past
    `crash_at` (None: no first run), then resumes from the newest checkpoint with
    K = `second_k`, as a new process would (a new trainer, loop and dataset)."""
    directory = tmp_path / f"ckpt-{first_k}-{second_k}"
    loop = loopax.Loop(new_trainer(), steps_per_execution=first_k)
    attach_sparse_triggers(loop, Firings())

    def crash(loop, metrics):
        if loop.trainer.global_step >= crash_at:
            raise Crash

    checkpointer = hooks.checkpoint(loop, directory, every_n_steps=20, keep=None)
    if crash_at is not None:
        loop.on_step("crash", crash)
        with pytest.raises(loopax.HookError):
            loop.run_to_step(make_data(), STEPS)
    checkpointer.wait()

    loop = loopax.Loop(new_trainer(), steps_per_execution=second_k)
    firings = Firings()
    attach_sparse_triggers(loop, firings)
    checkpointer = hooks.checkpoint(loop, directory, every_n_steps=20, keep=None)
    restored = checkpointer.restored_step
    loop.run_to_step(make_data(), STEPS)
    checkpointer.wait()
    return restored, host_params(loop.trainer), firings.steps, loop.history.get_state()


@pytest.mark.parametrize(("first_k", "second_k"), [(32, 32), (32, 4), (4, 32), (1, 32), (32, 1)])
def test_a_run_resumed_with_any_k_continues_as_an_uninterrupted_one(tmp_path, first_k, second_k):
    restored, want_params, want_fired, want_history = interrupted_then_resumed(
        tmp_path, 1, 1, crash_at=None
    )
    assert restored is None
    restored, params, fired, history = interrupted_then_resumed(tmp_path, first_k, second_k)
    assert restored == 40
    assert_trees_equal(want_params, params)
    assert fired == {
        name: [entry for entry in entries if entry[0] > restored]
        for name, entries in want_fired.items()
    }
    assert history == want_history


@pytest.mark.parametrize(
    "optimizer",
    [
        lambda: loopax.optimizers.adam(0.01),
        lambda: optax.inject_hyperparams(optax.adam)(learning_rate=0.01),
    ],
    ids=["loopax.optimizers.adam", "inject_hyperparams(optax.adam)"],
)
def test_an_optimizer_holding_its_learning_rate_matches_to_float_rounding(optimizer):
    # With the learning rate in the optimizer state (optax.inject_hyperparams, every
    # loopax.optimizers optimizer), XLA compiles the scanned step a little differently from
    # the single step: the results differ in the last bits (2e-10 here, up to 6e-8 after 60
    # dropout steps), the documented tolerance. Constant hyperparameters stay bit-identical.
    def run(steps_per_execution):
        trainer = loopax.Trainer(
            lambda ctx, spec, inputs: nn.Dense(1)(inputs[0]),
            loopax.losses.mean_squared_error,
            optimizer(),
            devices=ONE_DEVICE,
        )
        inputs = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
        data = loopax.ArrayDataset(inputs, inputs[:, :1], BATCH_SIZE, loop_forever=True, seed=1)
        loopax.Loop(trainer, steps_per_execution=steps_per_execution).run_steps(data, 32)
        return host_params(trainer)

    single, fused = run(1), run(8)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), single, fused)


# -- parallel and accumulated steps ----------------------------------------------------------


def parallel_run(parallel, steps_per_execution, devices=4, accumulate_steps=1):
    trainer = new_trainer(
        devices=jax.devices()[:devices], parallel=parallel, accumulate_steps=accumulate_steps
    )
    loop = loopax.Loop(trainer, steps_per_execution=steps_per_execution)
    losses = []
    hooks.every_n_steps(loop, 9, "every 9", lambda loop, metrics: None)
    loop.on_step(
        "losses", lambda loop, metrics: losses.append(np.asarray(loop.group_metrics["loss"]))
    )
    loop.run_steps(make_data(), 45)
    assert trainer.global_step == 45
    return host_params(trainer), np.concatenate(losses)


needs_4_devices = pytest.mark.skipif(
    jax.device_count() < 4,
    reason="needs 4 devices: XLA_FLAGS=--xla_force_host_platform_device_count=4 before jax loads",
)


@needs_4_devices
def test_shard_map_on_4_devices_is_bit_identical():
    want_params, want_losses = parallel_run("shard_map", 1)
    params, losses = parallel_run("shard_map", 8)
    assert_trees_equal(want_params, params)
    assert np.array_equal(want_losses, losses)


@needs_4_devices
def test_pmap_on_4_devices_matches_closely():
    want_params, want_losses = parallel_run("pmap", 1)
    params, losses = parallel_run("pmap", 8)
    # pmap's fused program may reorder float sums: observed within float32 rounding.
    assert max_difference(want_params, params) <= 1e-6
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("devices", [1, pytest.param(4, marks=needs_4_devices)])
def test_accumulated_steps_are_bit_identical(devices):
    want_params, want_losses = parallel_run("shard_map", 1, devices, accumulate_steps=2)
    params, losses = parallel_run("shard_map", 4, devices, accumulate_steps=2)
    assert_trees_equal(want_params, params)
    assert np.array_equal(want_losses, losses)
