"""`tensorboard`: event files read back with TensorBoard's own reader and served by a real
`tensorboard --logdir` server; a run directory per dataset, or (`layout="single"`) one."""

import io
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from observability_helpers import (
    LEARNING_RATE,
    ONE_DEVICE,
    make_data,
    make_trainer,
    record_compilations,
)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard_runs import keyed_scalars, read_runs

import loopax
from loopax import hooks

TRAIN_TAGS = ["train/loss", "train/moving_average_loss", "train/Moving Average Accuracy"]
RUN_TAGS = ["loss", "moving_average_loss", "Moving Average Accuracy"]  # in the train run


def read_events(logdir):
    accumulator = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def run_logged(logdir, steps=12, **kwargs):
    trainer = make_trainer()
    compiled = record_compilations(trainer)
    loop = loopax.Loop(trainer)
    recorded = {}

    def record(loop, metrics):
        recorded[loop.trainer.global_step] = {k: float(v) for k, v in metrics.items()}

    loop.on_step("record", record)
    hooks.evaluate(loop, make_data("test", 2, seed=1, shuffle=False), every_n_steps=6)
    writer = hooks.tensorboard(loop, logdir, **kwargs)
    loop.run_steps(make_data(loop_forever=True), steps)
    return loop, writer, recorded, compiled


def test_a_run_directory_per_dataset_with_the_metric_names_as_tags(tmp_path):
    loop, writer, recorded, compiled = run_logged(tmp_path, every_n_steps=5)
    runs = read_runs(tmp_path)  # the runs `tensorboard --logdir` finds
    assert sorted(runs) == ["eval/test", "train"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["eval", "train"]
    train, test = runs["train"], runs["eval/test"]
    assert set(train.Tags()["scalars"]) == {*RUN_TAGS, "learning_rate"}
    # The evaluation's loss is tagged `loss` like the train loss: one chart draws both.
    assert set(test.Tags()["scalars"]) == {"loss", "Accuracy"}
    for tag in RUN_TAGS:
        scalars = train.Scalars(tag)
        # every 5 steps (global steps 5, 10) and at the end of the run (12)
        assert [s.step for s in scalars] == [5, 10, 12]
        np.testing.assert_allclose(
            [s.value for s in scalars], [recorded[step][tag] for step in (5, 10, 12)], rtol=1e-6
        )
    assert [s.value for s in train.Scalars("learning_rate")] == pytest.approx([LEARNING_RATE] * 3)
    assert [s.step for s in test.Scalars("loss")] == [6, 12]
    # One key for one metric: each run's points are those of the loop's history keys.
    scalars = keyed_scalars(tmp_path)
    assert set(scalars) == {*TRAIN_TAGS, "train/learning_rate", *loop.history.keys()}
    for key, points in scalars.items():
        assert [(step, pytest.approx(value)) for step, value in points] == loop.history[key]
    # The run summary, as Markdown text at the first step, in the train run.
    assert train.Tags()["tensors"] == ["run/summary"] and test.Tags()["tensors"] == []
    summary = train.Tensors("run/summary")
    text = summary[0].tensor_proto.string_val[0].decode()
    assert summary[0].step == 1
    assert "**parameters:** 58 (232 B)" in text  # Dense(4 -> 8) + Dense(8 -> 2)
    # Flax numbers the outer Dense(2) first: it is created before the inner Dense(8).
    assert "| Dense_1/kernel | (4, 8) | float32 | 32 |" in text
    assert "**devices:** 1 (cpu" in text and "**command line:**" in text
    assert "other variables" not in text  # this model has parameters only
    assert compiled == []  # logging never compiles anything
    assert not [name for name in sys.modules if name.split(".")[0] == "tensorflow"]


def test_the_single_layout_keeps_every_key_as_a_tag_in_the_logdir(tmp_path):
    loop, writer, recorded, compiled = run_logged(tmp_path, every_n_steps=5, layout="single")
    assert [path.name for path in tmp_path.iterdir() if path.is_dir()] == []
    events = read_events(tmp_path)
    scalar_tags = events.Tags()["scalars"]
    assert set(scalar_tags) == {
        *TRAIN_TAGS,
        "train/learning_rate",
        "eval/test/mean_loss",
        "eval/test/Accuracy",
    }
    for tag in TRAIN_TAGS:
        scalars = events.Scalars(tag)
        assert [s.step for s in scalars] == [5, 10, 12]
        key = tag.split("/", 1)[1]
        np.testing.assert_allclose(
            [s.value for s in scalars], [recorded[step][key] for step in (5, 10, 12)], rtol=1e-6
        )
    assert [s.step for s in events.Scalars("eval/test/mean_loss")] == [6, 12]
    for tag in scalar_tags:
        assert [(s.step, pytest.approx(s.value)) for s in events.Scalars(tag)] == loop.history[tag]
    summary = events.Tensors("run/summary")
    assert "**parameters:** 58 (232 B)" in summary[0].tensor_proto.string_val[0].decode()
    assert compiled == []


def test_an_eval_metric_named_loss_keeps_its_own_tag_beside_mean_loss(tmp_path):
    writer = loopax.hooks.TensorBoardWriter(tmp_path)
    writer.write_scalars(3, {"eval/val/mean_loss": 0.5, "eval/val/loss": 0.25, "train/loss": 1})
    writer.write_scalars(3, {"eval/my/set/mean_loss": 0.75, "eval/../x": 2.0, "lr": 0.1})
    writer.close()
    runs = {
        run: {
            tag: [(s.step, pytest.approx(s.value)) for s in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]
        }
        for run, events in read_runs(tmp_path).items()
    }
    assert runs == {
        "eval/val": {"mean_loss": [(3, 0.5)], "loss": [(3, 0.25)]},
        "train": {"loss": [(3, 1.0)], "lr": [(3, 0.1)]},  # another tag: in the train run
        "eval/my/set": {"loss": [(3, 0.75)]},  # a dataset name with "/": nested directories
        "eval/_": {"x": [(3, 2.0)]},  # no dataset name leaves the logdir
    }
    with pytest.raises(
        ValueError, match=r"layout='flat' is not one of \['per_dataset', 'single'\]"
    ):
        hooks.tensorboard(loopax.Loop(make_trainer()), tmp_path, layout="flat")


def test_histograms_and_a_second_run(tmp_path):
    loop, writer, _, _ = run_logged(
        tmp_path, steps=4, every_n_steps=100, histograms_every_n_steps=2, summary=False
    )
    loop.run_steps(make_data(loop_forever=True), 3)  # a second run appends to the same file
    assert sorted(read_runs(tmp_path)) == ["eval/test", "train"]
    events = read_events(tmp_path / "train")
    assert "run/summary" not in events.Tags()["tensors"]
    histograms = [tag for tag in events.Tags()["tensors"] if tag.startswith("params/")]
    assert sorted(histograms) == [
        "params/Dense_0/bias",
        "params/Dense_0/kernel",
        "params/Dense_1/bias",
        "params/Dense_1/kernel",
    ]
    kernel = events.Tensors("params/Dense_1/kernel")  # the (4, 8) kernel
    assert [event.step for event in kernel] == [2, 4, 6]
    buckets = np.frombuffer(kernel[0].tensor_proto.tensor_content, np.float64).reshape(-1, 3)
    assert buckets[:, 2].sum() == 32  # every kernel entry lands in a bucket
    # every_n_steps=100 never fires: only the ends of both runs are logged
    assert [s.step for s in events.Scalars("loss")] == [4, 7]
    writer.close()
    with pytest.raises(RuntimeError, match="closed"):
        writer.write_scalars(8, {"train/loss": 0.0})


def test_rejects_bad_arguments(tmp_path):
    loop = loopax.Loop(make_trainer())
    with pytest.raises(ValueError, match="n must be a positive int"):
        hooks.tensorboard(loop, tmp_path, every_n_steps=0)
    with pytest.raises(ValueError, match="max_pending"):
        hooks.tensorboard(loop, tmp_path, max_pending=0)


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _get_json(url):
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def test_a_real_tensorboard_server_serves_the_scalars(tmp_path):
    run_logged(tmp_path, every_n_steps=4)
    port = _free_port()
    log_path = tmp_path.parent / f"{tmp_path.name}-tensorboard.log"
    with open(log_path, "wb") as log:  # a file, not a pipe: a full pipe would block the server
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tensorboard.main",
                "--logdir",
                str(tmp_path),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--load_fast",
                "false",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}/data/plugin/scalars"
    try:
        deadline = time.monotonic() + 60
        tags = {}
        while time.monotonic() < deadline:
            if server.poll() is not None:
                pytest.fail(f"tensorboard exited: {log_path.read_text()[-2000:]}")
            try:
                tags = _get_json(f"{base}/tags")
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                tags = {}
            if tags.get("eval/test", {}).get("Accuracy"):
                break
            time.sleep(0.25)  # polling an external server: nothing to inject a clock into
        assert set(tags) == {"train", "eval/test"}, tags
        assert {*RUN_TAGS, "learning_rate"} <= set(tags["train"])
        assert {"loss", "Accuracy"} == set(tags["eval/test"])
        # One chart, `loss`, holds a curve per run: training and evaluation overlaid.
        for run, steps in (("train", [4, 8, 12]), ("eval/test", [6, 12])):
            query = urllib.parse.urlencode({"tag": "loss", "run": run})
            points = _get_json(f"{base}/scalars?{query}")  # [[wall_time, step, value], ...]
            assert [step for _, step, _ in points] == steps
            assert all(np.isfinite(value) for _, _, value in points)
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)


def test_only_process_zero_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    loop = loopax.Loop(make_trainer())
    hooks.tensorboard(loop, tmp_path / "tb", every_n_steps=1)
    loop.run_steps(make_data(loop_forever=True), 2)
    assert not (tmp_path / "tb").exists()


def test_hooks_read_the_device_only_on_the_steps_they_fire(tmp_path, monkeypatch):
    loop = loopax.Loop(make_trainer())
    now = [0.0]
    hooks.progress_bar(loop, refresh_seconds=1000, clock=lambda: now[0], file=io.StringIO())
    hooks.tensorboard(loop, tmp_path / "tb", every_n_steps=7)
    hooks.metrics_log(loop, tmp_path / "metrics.csv", every_n_steps=7)
    hooks.plot(loop, tmp_path / "plot", start_step=7, factor=3, render=False)
    hooks.evaluate(loop, make_data("test", 1), every_n_steps=7, call_on_end=False)
    reads = []
    device_get = jax.device_get
    to_numpy = np.asarray

    def record():
        # The TensorBoard writer thread reads whenever it likes: the loop never waits for it.
        if threading.current_thread() is threading.main_thread():
            reads.append(loop.loop_step)

    def counting_device_get(tree):
        record()
        return device_get(tree)

    def counting_to_numpy(array, *args, **kwargs):
        if isinstance(array, jax.Array):
            record()
        return to_numpy(array, *args, **kwargs)

    monkeypatch.setattr(jax, "device_get", counting_device_get)
    monkeypatch.setattr(np, "asarray", counting_to_numpy)
    loop.run_steps(make_data(loop_forever=True), 12)
    # Step 6: the evaluation every 7 steps; then the end of the run (loop_step is 12 by then),
    # where the loop waits for its steps, checks their losses, hands the writers the train
    # metrics they asked for at steps 6 and 7, and the progress bar (writing lines to a file
    # that is no terminal) reads the last step's for its last line. No other step reads
    # anything: the writers never make the loop wait, nor does the bar.
    assert sorted(set(reads)) == [6, 12]


def test_an_event_file_that_cannot_be_opened_fails_the_run_naming_the_logdir(tmp_path):
    # The writer thread opens the event file (off the first step's path): its failure still
    # reaches the run, at a write or at the run's end.
    (tmp_path / "file").write_text("")
    logdir = tmp_path / "file" / "tb"
    loop = loopax.Loop(make_trainer())
    hooks.tensorboard(loop, logdir)
    # At a write (a HookError naming the hook) or at the run's end flush (the error itself).
    with pytest.raises(RuntimeError) as raised:
        loop.run_steps(make_data(loop_forever=True), 3)
    assert f"writing TensorBoard events to {str(logdir)!r} failed: NotADirectoryError" in str(
        raised.value
    )
    with pytest.raises(RuntimeError, match="NotADirectoryError"):  # and at every later write
        loop.run_steps(make_data(loop_forever=True), 3)


def test_event_records_carry_tensorflow_s_masked_crc32c():
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    from loopax.hooks._event_file import crc32c, record
    from loopax.hooks._event_file import masked_crc32c as ours

    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    rng = np.random.default_rng(0)
    for data in [b"", b"a", rng.bytes(100), rng.bytes(4096)]:
        assert ours(data) == masked_crc32c(data)
    framed = record(b"xyz")
    assert len(framed) == 8 + 4 + 3 + 4 and framed[12:15] == b"xyz"


def test_written_events_reach_the_disk_every_flush_seconds_without_a_flush(tmp_path):
    writer = loopax.hooks.TensorBoardWriter(tmp_path, flush_seconds=0.05, max_pending=1)
    writer.write_scalars(3, {"train/loss": 0.5})
    deadline = time.monotonic() + 60  # the periodic flush comes after 0.05 s; never hang
    while time.monotonic() < deadline:
        # The writer thread makes the run directory with its event file.
        scalars = (tmp_path / "train").is_dir() and read_events(tmp_path / "train").Tags()[
            "scalars"
        ]
        if scalars:
            break
        time.sleep(0.05)
    assert scalars == ["loss"]
    assert read_events(tmp_path / "train").Scalars("loss")[0].step == 3
    writer.close()


def test_a_process_writing_events_never_imports_tensorboard_s_tensorflow_stub(tmp_path):
    # Importing TensorBoard's own event writer loads its TensorFlow stub and fsspec: ~0.35 s
    # of CPU in every process that logs (a resumed job waits for some of it).
    script = f"""
import sys
sys.path.insert(0, {str(__import__("pathlib").Path(__file__).parent)!r})
from observability_helpers import make_data, make_trainer
import loopax
from loopax import hooks

loop = loopax.Loop(make_trainer())
hooks.tensorboard(loop, {str(tmp_path / "tb")!r}, every_n_steps=2, histograms_every_n_steps=2)
loop.run_steps(make_data(loop_forever=True), 4)
loaded = [m for m in sys.modules if m.startswith(("tensorboard.summary",
          "tensorboard.compat.tensorflow_stub", "fsspec"))]
print("loaded:", loaded)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "loaded: []" in done.stdout, done.stdout
    events = read_events(tmp_path / "tb" / "train")
    assert "loss" in events.Tags()["scalars"]
    assert any(tag.startswith("params/") for tag in events.Tags()["tensors"])


def test_a_resume_drops_the_later_points_of_every_run_directory(tmp_path):
    def attach():
        loop = loopax.Loop(make_trainer())
        hooks.evaluate(loop, make_data("test", 2, seed=1, shuffle=False), every_n_steps=2)
        hooks.tensorboard(loop, tmp_path / "tb", every_n_steps=2, summary=False)
        return loop, hooks.checkpoint(loop, tmp_path / "ckpt", every_n_steps=4, keep=None)

    loop, checkpointer = attach()
    loop.run_steps(make_data(loop_forever=True), 10)
    checkpointer.wait()
    uninterrupted = keyed_scalars(tmp_path / "tb")
    assert [step for step, _ in uninterrupted["eval/test/mean_loss"]] == [2, 4, 6, 8, 10]
    # Another writer (a resumed process's) goes back to step 4: the evaluations of the run
    # directory it has not written to yet lose their later points too, and the steps run
    # again give the uninterrupted run's points once each.
    loop, checkpointer = attach()
    assert checkpointer.restore(4) == 4
    # Going on from step 4 moves checkpoints 8 and 10 (the first run's trajectory) aside.
    with pytest.warns(RuntimeWarning, match="another trajectory"):
        loop.run_to_step(make_data(loop_forever=True), 10)
    resumed = keyed_scalars(tmp_path / "tb")
    assert resumed.keys() == uninterrupted.keys()
    for key, points in uninterrupted.items():
        assert [step for step, _ in resumed[key]] == [step for step, _ in points], key
        np.testing.assert_allclose([v for _, v in resumed[key]], [v for _, v in points], rtol=1e-6)
        assert [(step, pytest.approx(value)) for step, value in resumed[key]] == loop.history[key]


def test_the_run_summary_lists_the_model_s_other_variables(tmp_path):
    def model_fn(ctx, spec, inputs):
        hidden = nn.BatchNorm(use_running_average=not ctx.training)(nn.Dense(8)(inputs[0]))
        return nn.Dense(2)(hidden)

    trainer = loopax.Trainer(
        model_fn,
        loopax.losses.sparse_categorical_crossentropy_logits,
        optax.sgd(0.1),
        devices=ONE_DEVICE,
    )
    loop = loopax.Loop(trainer)
    hooks.tensorboard(loop, tmp_path, every_n_steps=1)
    loop.run_steps(make_data(loop_forever=True), 1)
    [summary] = read_events(tmp_path / "train").Tensors("run/summary")
    text = summary.tensor_proto.string_val[0].decode()
    # Dense(4 -> 8) 40 + BatchNorm scale and bias 16 + Dense(8 -> 2) 18
    assert "**parameters:** 74 (296 B)" in text
    assert "| BatchNorm_0/scale | (8,) | float32 | 8 |" in text
    # BatchNorm's running mean and variance, each path starting with its collection
    assert "**other variables:** 16 (64 B)" in text
    assert "| variable | shape | dtype | count |" in text
    assert "| batch_stats/BatchNorm_0/mean | (8,) | float32 | 8 |" in text
    assert "| batch_stats/BatchNorm_0/var | (8,) | float32 | 8 |" in text


def test_a_later_process_s_event_file_sorts_after_the_earlier_ones(tmp_path):
    # Readers apply a directory's files in name order (time, host, pid, count), and a resumed
    # run's restart marker only drops points written before it. Two processes in one second
    # are ordered by pid, which wraps (pid_max is often 32768): here the earlier process got
    # a larger pid, and a clock a second ahead, than the one that writes next.
    run_logged(tmp_path, steps=2, every_n_steps=1, summary=False)
    [first] = (tmp_path / "train").iterdir()
    stamp = int(first.name.split(".")[3]) + 1
    earlier = first.with_name(f"events.out.tfevents.{stamp:010d}.{socket.gethostname()}.99999.0")
    first.rename(earlier)
    run_logged(tmp_path, steps=2, every_n_steps=1, summary=False)
    names = sorted(path.name for path in (tmp_path / "train").iterdir())
    assert len(names) == 2
    assert names[0] == earlier.name  # the second process's file is read after it
