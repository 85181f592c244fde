"""The fused program's loop body against a hand-written `lax.scan` over stacked batches.

On a GPU a `lax.scan` body's kernels are launched once per iteration, so each op loopax
adds to the body (reading the batch from the on-device data, bookkeeping) costs every
step. These tests compare the optimized HLO (`compiled.as_text()`) of loopax's fused
program on an on-device `ArrayDataset` with the hand-written scan of the same step (same
model, optimizer, loss and loss moving average) over batches stacked beforehand: the body
must match it in instructions and fusions within the margins below, run a known trip
count (XLA:GPU runs a loop of unknown trip count with a host sync per iteration) and copy
no whole dataset array per step.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hlo_helpers import computes_on_vectors, entry_gathers, loop_bodies
from test_step_buffers import averaging_step

import loopax

K, BATCH, EXAMPLES = 8, 8, 256
# Measured (jax 0.10.2, CPU): the hand-written body has 24 ops, 19 of them fusions, and so
# has loopax's for sliced data, the permuted copy and rows picked through the permutation
# alike (the group's rows are read before the loop; before, the read inside it made 25 and
# 20, and 26 and 21 with one gather per array without a copy). Each fusion is a kernel
# launched per step on a GPU: none more is allowed; one other op (a copy or bitcast an XLA
# version may place otherwise) is.
MARGIN = {"instructions": 1, "fusions": 0, "gathers": 0}


def data():
    rng = np.random.default_rng(0)
    inputs = rng.normal(size=(EXAMPLES, 3)).astype(np.float32)
    return inputs, inputs[:, :1] * 2.0


def hand_written_body():
    """The hand-written scan's loop body: the step of `test_step_buffers`, scanned."""
    inputs, labels = data()
    model, optimizer = nn.Dense(1), optax.adam(0.01)
    params = model.init(jax.random.key(0), inputs[:BATCH])

    update = averaging_step(model, optimizer)

    def step(state, batch):
        return update(state, *batch)

    def steps(state, xs, ys):
        return jax.lax.scan(step, state, (xs, ys))

    state = (params, optimizer.init(params), (jnp.zeros(()), jnp.zeros(())))
    stacked = (jnp.zeros((K, BATCH, 3)), jnp.zeros((K, BATCH, 1)))
    compiled = jax.jit(steps, donate_argnums=0).lower(state, *stacked).compile()
    (body,) = loop_bodies(compiled.as_text())
    return body


def model_fn(ctx, spec, inputs):
    return nn.Dense(1)(inputs[0])


def loopax_body(**options):
    # On one device, as the hand-written scan (on more, the body also averages over them).
    devices = jax.devices()[:1]
    trainer = loopax.Trainer(
        model_fn, loopax.losses.mean_squared_error, optax.adam(0.01), devices=devices
    )
    inputs, labels = data()
    dataset = loopax.ArrayDataset(
        inputs, labels, BATCH, loop_forever=True, on_device=True, devices=devices, **options
    )
    loopax.Loop(trainer, steps_per_execution=K).run_steps(dataset, K)
    (fused,) = [e for e in trainer.executors() if e.info.graph_type == "train_steps"]
    (body,) = loop_bodies(fused.run.as_text(), EXAMPLES)
    return body


@pytest.mark.parametrize(
    ("reading", "options"),
    [
        ("slice", {"shuffle": False}),
        ("copy", {"shuffle": True}),
        ("gather", {"shuffle": True, "shuffled_copy": False}),
    ],
)
def test_the_fused_body_is_the_hand_written_scans(reading, options):
    ours, theirs = loopax_body(**options), hand_written_body()
    assert theirs["known trip count"] and theirs["gathers"] == 0
    assert ours["known trip count"], ours
    assert ours["whole-array copies"] == 0, ours
    for count, margin in MARGIN.items():
        assert ours[count] <= theirs[count] + margin, (reading, count, ours, theirs)


def test_an_extra_op_in_the_body_is_seen():
    # The counts can fail: a scan whose step also gathers its batch's rows has more.
    inputs = jnp.asarray(data()[0])

    def steps(total, rows):
        def step(total, index):
            return total + jnp.take(inputs, rows[index], axis=0).sum(), None

        return jax.lax.scan(step, total, jnp.arange(K))[0]

    def plain(total, xs):
        return jax.lax.scan(lambda total, x: (total + x.sum(), None), total, xs)[0]

    rows = jnp.zeros((K, BATCH), jnp.int32)
    gathered = jax.jit(steps).lower(jnp.zeros(()), rows).compile()
    stacked = jax.jit(plain).lower(jnp.zeros(()), jnp.zeros((K, BATCH, 3))).compile()
    (ours,), (theirs,) = loop_bodies(gathered.as_text()), loop_bodies(stacked.as_text())
    assert ours["gathers"] > theirs["gathers"] == 0


def test_the_shuffled_groups_read_is_one_gather_per_array_with_no_index_arithmetic():
    # A fused group's rows of shuffled data come from one gather per dataset array, whose
    # indices are a slice of the epochs' joined permutations: no gather of the permutation
    # itself, no select between two epochs' examples, and none of the negative-index fix-up
    # (`compare` and `select` over the indices) that `array.at[rows].get()` adds. Before,
    # the read made 4 gathers (both epochs' permutations, then each array) with a compare
    # and two selects over every index in each.
    devices = jax.devices()[:1]
    trainer = loopax.Trainer(
        model_fn, loopax.losses.mean_squared_error, optax.adam(0.01), devices=devices
    )
    inputs, labels = data()
    dataset = loopax.ArrayDataset(
        inputs, labels, BATCH, loop_forever=True, on_device=True, devices=devices
    )
    loopax.Loop(trainer, steps_per_execution=K).run_steps(dataset, K)
    (fused,) = [e for e in trainer.executors() if e.info.graph_type == "train_steps"]
    reads = entry_gathers(fused.run.as_text())
    assert len(reads) == 2, reads  # the inputs' and the labels'
    for lines in reads:
        for op in ("select", "compare", "gather"):
            ops = [line for line in lines if computes_on_vectors([line], op)]
            assert len(ops) == (op == "gather"), (op, lines)


def test_index_arithmetic_around_a_gather_is_seen():
    # The check can fail: `array.at[rows].get()` maps negative indices first.
    table = jnp.zeros((EXAMPLES, 3))

    def read(rows):
        return table.at[rows].get(mode="promise_in_bounds")

    text = jax.jit(read).lower(jnp.zeros((BATCH,), jnp.int32)).compile().as_text()
    (lines,) = entry_gathers(text)
    assert computes_on_vectors(lines, "select") and computes_on_vectors(lines, "compare")
