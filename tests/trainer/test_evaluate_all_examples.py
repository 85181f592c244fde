"""`Trainer.evaluate` counts every example once, on any device count (issue 9, item 9).

On N devices a batch that N does not divide runs, in one compiled step, as its largest
part that N divides plus its remainder padded to one example per device, the padding left
out of every merge. Results are checked against NumPy over every example and one device.
"""

import itertools
import json
import textwrap
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loopax
from loopax import metrics
from loopax.testing import free_port

ONE_DEVICE = jax.devices()[:1]
FOUR_DEVICES = jax.devices()[:4]
NUM_CLASSES = 3
FEATURES = 5
# (examples, batch size): last batches of 1, 2, 3, 5 and 7 examples, a batch smaller than
# the 4 devices, a batch size 4 does not divide, and the 360 examples in 64s.
CASES = [(17, 16), (18, 16), (19, 16), (21, 16), (23, 16), (10, 3), (12, 6), (360, 64), (362, 64)]
RUNS = ["one device", "shard_map", "pmap"]

pytestmark = pytest.mark.skipif(
    jax.device_count() < 4,
    reason="needs 4 devices: XLA_FLAGS=--xla_force_host_platform_device_count=4 before jax loads",
)


def model_fn(ctx, spec, inputs):
    return nn.Dense(NUM_CLASSES)(inputs[0])


class MeanAbsoluteLogit(metrics.Metric):
    """A user metric written to the protocol, not mask-aware: sum and count of |logits|."""

    name, short_name, metric_type = "mean_abs_logit", "|logit|", "loss"

    def init(self):
        return (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))

    def update(self, labels, predictions):
        values = jnp.abs(predictions[0])
        return (jnp.sum(values), jnp.asarray(values.size, jnp.float32))

    def merge(self, a, b):
        return (a[0] + b[0], a[1] + b[1])

    def compute(self, state):
        return state[0] / jnp.maximum(state[1], 1.0)


class ExampleCount(metrics.Metric):
    """How many examples the eval metrics saw, in an int32 state: exactly once each."""

    name, short_name, metric_type = "examples", "n", "count"

    def init(self):
        return jnp.zeros((), jnp.int32)

    def update(self, labels, predictions):
        return jnp.asarray(labels[0].shape[0], jnp.int32)

    def merge(self, a, b):
        return a + b

    def compute(self, state):
        return state


def make_trainer(run):
    devices = ONE_DEVICE if run == "one device" else FOUR_DEVICES
    parallel = "pmap" if run == "pmap" else "shard_map"
    return loopax.Trainer(
        model_fn,
        loopax.losses.sparse_categorical_crossentropy_logits,
        optax.sgd(0.1),
        eval_metrics=[metrics.SparseCategoricalAccuracy(), MeanAbsoluteLogit(), ExampleCount()],
        devices=devices,
        parallel=parallel,
    )


@pytest.fixture(scope="module")
def trainers():
    """One trainer per run, shared: each compiles once per batch shape."""
    return {run: make_trainer(run) for run in RUNS}


def classification_data(num_examples, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_examples, FEATURES)).astype(np.float32)
    y = rng.integers(0, NUM_CLASSES, size=(num_examples,)).astype(np.int32)
    return x, y


def numpy_results(trainer, x, y):
    """The eval results over every example of (x, y), computed on the host."""
    params = jax.device_get(trainer.params)["Dense_0"]
    logits = x.astype(np.float64) @ params["kernel"] + params["bias"]
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return {
        "mean_loss": float(np.mean(-log_softmax[np.arange(len(y)), y])),
        "Accuracy": float(np.mean(np.argmax(logits, axis=1) == y)),
        "mean_abs_logit": float(np.mean(np.abs(logits))),
        "examples": float(len(y)),
    }


def host(values):
    """eval_step's device values as host numbers, in order (`jax.device_get` sorts keys)."""
    return {name: float(value) for name, value in values.items()}


def assert_results_close(got, want):
    assert list(got) == ["mean_loss", "Accuracy", "mean_abs_logit", "examples"]
    for name in want:
        np.testing.assert_allclose(
            got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=f"{name}: {got} vs {want}"
        )


@pytest.mark.parametrize("num_examples,batch_size", CASES)
@pytest.mark.parametrize("run", RUNS)
def test_evaluate_counts_every_example_once(trainers, run, num_examples, batch_size):
    x, y = classification_data(num_examples)
    dataset = loopax.ArrayDataset(x, y, batch_size, shuffle=False, drop_remainder=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is dropped: no warning
        results = trainers[run].evaluate(dataset)
    assert results["examples"] == num_examples
    assert_results_close(results, numpy_results(trainers[run], x, y))


@pytest.mark.parametrize("run", ["shard_map", "pmap"])
def test_four_devices_give_the_one_device_result(trainers, run):
    x, y = classification_data(47, seed=1)
    # Batches of every remainder, and one smaller than the device count.
    sizes = [13, 2, 16, 3, 5, 1, 7]
    starts = np.cumsum([0, *sizes])
    batches = [([x[a:b]], [y[a:b]]) for a, b in itertools.pairwise(starts)]
    dataset = loopax.IterableDataset(lambda: iter(batches), name="uneven")
    expected = trainers["one device"].evaluate(dataset)
    results = trainers[run].evaluate(dataset)
    assert results["examples"] == 47
    assert_results_close(results, expected)
    assert_results_close(results, numpy_results(trainers[run], x, y))


def test_a_user_metric_that_is_not_a_sum_is_exact():
    class LargestLogit(metrics.Metric):
        name, short_name = "largest_logit", "max"

        def init(self):
            return jnp.full((), -jnp.inf, jnp.float32)

        def update(self, labels, predictions):
            return jnp.max(predictions[0])

        def merge(self, a, b):
            return jnp.maximum(a, b)

        def compute(self, state):
            return state

    x, y = classification_data(11, seed=2)
    # The largest logit is the last example's, alone in the padded remainder step.
    x[10] *= 50.0
    results = {}
    for devices in (ONE_DEVICE, FOUR_DEVICES):
        trainer = loopax.Trainer(
            model_fn,
            loopax.losses.sparse_categorical_crossentropy_logits,
            optax.sgd(0.1),
            eval_metrics=[LargestLogit()],
            devices=devices,
        )
        results[len(devices)] = trainer.evaluate(
            loopax.ArrayDataset(x, y, 6, shuffle=False, drop_remainder=False)
        )
        params = jax.device_get(trainer.params)["Dense_0"]
        expected = np.max(x @ params["kernel"] + params["bias"])
        np.testing.assert_allclose(results[len(devices)]["largest_logit"], expected, rtol=1e-5)
    np.testing.assert_allclose(results[4]["mean_loss"], results[1]["mean_loss"], rtol=1e-5)


@pytest.mark.parametrize("run", ["shard_map", "pmap"])
def test_eval_step_updates_the_running_values_with_a_whole_uneven_batch(trainers, run):
    trainer = trainers[run]
    x, y = classification_data(12, seed=3)
    trainer.reset_eval_metrics()
    first = trainer.eval_step(None, [x[:5]], [y[:5]])
    assert list(first) == ["mean_loss", "Accuracy", "mean_abs_logit", "examples"]
    assert all(isinstance(value, jax.Array) for value in first.values())
    assert_results_close(host(first), numpy_results(trainer, x[:5], y[:5]))
    second = trainer.eval_step(None, [x[5:8]], [y[5:8]])  # smaller than the device count
    assert_results_close(host(second), numpy_results(trainer, x[:8], y[:8]))
    third = trainer.eval_step(None, [x[8:]], [y[8:]])  # divisible: the usual step
    assert_results_close(host(third), numpy_results(trainer, x, y))


@pytest.mark.parametrize("run", ["shard_map", "pmap"])
def test_a_second_evaluation_compiles_nothing(run):
    trainer = make_trainer(run)
    compiled = []
    trainer.on_exec_creation(lambda info: compiled.append((info.graph_type, info.input_shapes)))
    x, y = classification_data(30)
    datasets = [
        loopax.ArrayDataset(x, y, 8, drop_remainder=False),  # 8, 8, 8, 6
        loopax.ArrayDataset(x[:3], y[:3], 8, drop_remainder=False),
    ]  # 3
    first = [trainer.evaluate(dataset) for dataset in datasets]
    # One executable per batch shape, as on one device: the uneven ones are one step each.
    assert compiled == [
        ("eval", ((8, FEATURES),)),
        ("eval", ((6, FEATURES),)),
        ("eval", ((3, FEATURES),)),
    ]
    assert len(trainer.executors()) == 3
    compiled.clear()
    second = [trainer.evaluate(dataset) for dataset in datasets]
    assert compiled == []
    assert [e.hits for e in trainer.executors()] == [5, 1, 1]
    for got, want in zip(second, first, strict=True):
        assert_results_close(got, want)


def test_an_uneven_batch_updates_the_metrics_once_like_one_batch():
    # A moving average folds each batch once: pieces of a batch must not count as batches.
    x, y = classification_data(23, seed=4)
    results = []
    for devices in (ONE_DEVICE, FOUR_DEVICES):
        trainer = loopax.Trainer(
            model_fn,
            loopax.losses.sparse_categorical_crossentropy_logits,
            optax.sgd(0.1),
            eval_metrics=[metrics.MovingAverageSparseCategoricalAccuracy(new_example_weight=0.5)],
            devices=devices,
        )
        results.append(
            trainer.evaluate(loopax.ArrayDataset(x, y, 7, shuffle=False, drop_remainder=False))
        )  # 7, 7, 7, 2
    np.testing.assert_allclose(list(results[1].values()), list(results[0].values()), rtol=1e-5)


def test_divisible_batches_run_the_usual_step_only():
    trainer = make_trainer("shard_map")
    x, y = classification_data(32)
    trainer.evaluate(loopax.ArrayDataset(x, y, 8, drop_remainder=False))
    (executor,) = trainer.executors()
    assert executor.info.input_shapes == ((8, FEATURES),)
    assert executor.hits == 3


def test_dropped_examples_warn_with_the_counts(trainers):
    trainer = trainers["shard_map"]
    x, y = classification_data(360)
    dataset = loopax.ArrayDataset(x, y, 64, shuffle=False, name="val")
    with pytest.warns(RuntimeWarning) as record:
        results = trainer.evaluate(dataset)
    assert len(record) == 1, "one warning per evaluation, not per batch"
    assert str(record[0].message) == (
        "dataset 'val' drops its last 40 of 360 examples (drop_remainder=True with batch_size "
        "64): this evaluation covers 320; build it with drop_remainder=False to evaluate every "
        "example"
    )
    assert record[0].filename == __file__
    # The warning tells the truth: the 320 examples of the first 5 batches were evaluated.
    assert results["examples"] == 320
    assert_results_close(results, numpy_results(trainer, x[:320], y[:320]))
    with pytest.warns(RuntimeWarning, match="drops its last 40 of 360"):
        trainer.evaluate(dataset)  # again on the next evaluation


def test_no_warning_when_nothing_is_dropped(trainers):
    x, y = classification_data(320)
    datasets = [
        loopax.ArrayDataset(x, y, 64),  # drop_remainder=True, but 64 divides 320
        loopax.ArrayDataset(x[:300], y[:300], 64, drop_remainder=False),
        loopax.IterableDataset(lambda: iter([([x[:5]], [y[:5]])]), name="other"),
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [trainers["shard_map"].evaluate(dataset) for dataset in datasets]
    assert [str(warning.message) for warning in caught] == []
    # Nothing dropped: every example of every dataset was evaluated.
    assert [result["examples"] for result in results] == [320, 300, 5]


def test_a_train_batch_must_still_divide_by_the_devices():
    trainer = make_trainer("shard_map")
    x, y = classification_data(6)
    with pytest.raises(
        ValueError,
        match="batch size 6 is not divisible by the 4 devices; use a "
        "batch size that is a multiple of 4",
    ):
        trainer.train_step(None, [x], [y])
    results = trainer.evaluate(loopax.ArrayDataset(x, y, 6, drop_remainder=False))
    assert results["examples"] == 6


def test_an_uneven_batch_is_validated_as_a_whole(trainers):
    x, y = classification_data(7)
    with pytest.raises(ValueError, match=r"mixes batch sizes \[6, 7\]"):
        trainers["shard_map"].eval_step(None, [x], [y[:6]])
    with pytest.raises(TypeError, match="not an array"):
        trainers["shard_map"].eval_step(None, [x], [y.tolist()])


# -- several processes ----------------------------------------------------------------------

WORKER = textwrap.dedent('''
    """Evaluates this process's share of 14 examples, in batches of 4, on 2 CPU devices."""
    import json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax
    port, num_processes, process_id, local_examples = map(int, sys.argv[1:5])
    if num_processes:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes, process_id)
    import flax.linen as nn, numpy as np, optax, loopax

    def model_fn(ctx, spec, inputs):
        return nn.Dense(3)(inputs[0])

    rng = np.random.default_rng(0)
    x = rng.normal(size=(14, 5)).astype(np.float32)
    y = rng.integers(0, 3, size=(14,)).astype(np.int32)
    start = 7 * process_id
    x, y = x[start : start + local_examples], y[start : start + local_examples]
    devices = jax.devices() if num_processes else jax.devices()[:1]
    trainer = loopax.Trainer(model_fn, loopax.losses.sparse_categorical_crossentropy_logits,
                             optax.sgd(0.1), devices=devices,
                             eval_metrics=[loopax.metrics.SparseCategoricalAccuracy()])
    batches = [([x[i : i + 4]], [y[i : i + 4]]) for i in range(0, len(x), 4)]
    try:
        results = trainer.evaluate(loopax.IterableDataset(lambda: iter(batches), name="share"))
    except ValueError as err:
        results = {"error": str(err)}
    print("RESULTS " + json.dumps(results))
''')


def _run_workers(zygote, tmp_path, num_processes, local_examples):
    """Runs the worker in processes forked from the pre-imported `zygote` (tests/zygote.py)."""
    worker = tmp_path / "eval_worker.py"
    worker.write_text(WORKER)
    port = str(free_port())
    logs = [tmp_path / f"worker{num_processes}-{index}.log" for index in range(len(local_examples))]
    processes = [
        zygote.start(
            [worker, port, str(num_processes), str(index), str(examples)], out=log, err=log
        )
        for (index, examples), log in zip(enumerate(local_examples), logs, strict=True)
    ]
    try:
        for process in processes:
            process.wait(timeout=240)
    finally:
        for process in processes:
            process.kill()  # a hung one (nothing if it ended)
    results = []
    for process, log in zip(processes, logs, strict=True):
        out = log.read_text()
        assert process.returncode == 0, out
        (line,) = [line for line in out.splitlines() if line.startswith("RESULTS ")]
        results.append(json.loads(line[len("RESULTS ") :]))
    return results


def test_two_processes_evaluate_every_example_once(zygote_server, tmp_path):
    # 7 examples per process in batches of 4: the last batch holds 3 per process, which
    # the 2 devices of each process do not divide.
    (reference,) = _run_workers(zygote_server, tmp_path, 0, [14])
    results = _run_workers(zygote_server, tmp_path, 2, [7, 7])
    for result in results:
        assert list(result) == ["mean_loss", "Accuracy"]
        for name in reference:
            np.testing.assert_allclose(result[name], reference[name], rtol=1e-5, atol=1e-6)


def test_two_processes_with_different_batch_sizes_evaluate_the_union(zygote_server, tmp_path):
    # Last batches of 3 and 1 examples (issue 21: this raised before, and hung with different
    # numbers of batches): the processes agree on each batch's sizes and pad with masked shards.
    (reference,) = _run_workers(
        zygote_server, tmp_path, 0, [12]
    )  # examples 0-6 and 7-11, on one device
    results = _run_workers(zygote_server, tmp_path, 2, [7, 5])
    for result in results:
        assert list(result) == ["mean_loss", "Accuracy"]
        for name in reference:
            np.testing.assert_allclose(result[name], reference[name], rtol=1e-5, atol=1e-6)
