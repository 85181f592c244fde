"""A run's steady state reads the devices only where it must: its waits and its hooks' steps.

On an accelerator every read of a device value is a copy to the host and a wait for it, and
a read of a step that has not finished blocks the host until it has, draining the queue of
dispatched steps that keeps the device busy. A CPU run shows neither in its timings, and
`jax.transfer_guard_device_to_host` guards nothing on CPU devices (their arrays are host
memory: no transfer happens), so these tests count what a run asks of the devices, the
way an accelerator would pay for it:

- a wait: `block_until_ready` of any array, finished or not;
- a read: a copy of a device array to the host (`np.asarray`, `float`, `.item()`,
  `jax.device_get`), once per group of values read together. Values whose copies were
  started together (`copy_to_host_async`, which `jax.device_get` calls on every leaf
  before it reads any) are one read, however many follow; each value read on its own is
  one read.

Whether a step has finished at a given moment depends on the machine, so nothing here
asks: every wait and every read counts, finished or not, and the counts are the same on
any machine. The arrays are replicated over the simulated CPU devices (or live on an
accelerator), so every read goes through `jax.Array`'s own copy (a single CPU device's
array is read through the buffer protocol, which no patch sees: a test below checks that
the count sees a read).
"""

import io

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax._src.lib import xla_client

import loopax
from loopax import hooks
from loopax.testing._internal import host_copies_started_on_cpu

EXAMPLES = 512
BATCH = 8
STEPS = 64
ARRAY = type(jnp.zeros(()))  # the concrete class of `jax.Array`


def model_fn(ctx, spec, inputs):
    return nn.Dense(1)(inputs[0])


def new_loop(k, on_device=True):
    trainer = loopax.Trainer(model_fn, loopax.losses.mean_squared_error, optax.adam(0.01))
    rng = np.random.default_rng(0)
    inputs = rng.normal(size=(EXAMPLES, 3)).astype(np.float32)
    data = loopax.ArrayDataset(
        inputs, inputs[:, :1] * 2.0, BATCH, seed=1, loop_forever=True, on_device=on_device
    )
    return loopax.Loop(trainer, steps_per_execution=k), data


class DeviceAsks:
    """Records the waits, the copies started and the reads of device arrays, in order.

    Attributes:
      events: `(kind, site)` in order, kind one of "wait", "start", "read", "dispatch"
        (`record_dispatches`) and "drain" (after the "wait" for an output of the newest
        dispatch); site is the loopax frame that asked (`file:line function`), for the
        failure messages.
      reads: the reads counted as above.
    """

    def __init__(self, monkeypatch):
        self.events: list[tuple[str, str]] = []
        self._batch_of: dict[int, int] = {}  # id(array) -> the batch its copy started in
        self._kept: list = []  # the arrays whose ids are in `_batch_of`, kept alive
        self._batch = 0
        self._read_batches: set[int] = set()
        self._last = None
        self.reads = 0
        self.active = False
        self.newest: set[int] = set()  # ids of the newest dispatch's outputs (see below)
        self._newest_kept: list = []
        value = ARRAY._value
        block = ARRAY.block_until_ready
        start = ARRAY.copy_to_host_async
        batched = xla_client.batched_block_until_ready

        def counted_value(array):
            if self.active and array._npy_value is None:
                self._read(array)
            return value.fget(array)

        def counted_block(array):
            if self.active:
                self.record("wait")
                if id(array) in self.newest:  # the newest step: the queue drains
                    self.record("drain")
            return block(array)

        def counted_batched(arrays):
            if self.active:
                self.record("wait")
            return batched(arrays)

        def counted_start(array):
            if self.active and array._npy_value is None:
                if self._last != "start":
                    self._batch += 1
                self._batch_of.setdefault(id(array), self._batch)
                self._kept.append(array)
                self.record("start")
            return start(array)

        monkeypatch.setattr(ARRAY, "_value", property(counted_value))
        monkeypatch.setattr(ARRAY, "block_until_ready", counted_block)
        monkeypatch.setattr(ARRAY, "copy_to_host_async", counted_start)
        monkeypatch.setattr(xla_client, "batched_block_until_ready", counted_batched)

    def newest_outputs(self, outputs):
        """The outputs of the newest dispatch: a wait for one of them drains the queue."""
        self._newest_kept = [x for x in jax.tree.leaves(outputs) if isinstance(x, ARRAY)]
        self.newest = {id(x) for x in self._newest_kept}

    def record(self, kind):
        """Records an event of `kind` asked now."""
        self._last = kind
        self.events.append((kind, _site()))

    def _read(self, array):
        batch = self._batch_of.get(id(array))
        if batch is None or batch not in self._read_batches:
            self.reads += 1  # its own copy and wait, or the first read of a started group
            if batch is not None:
                self._read_batches.add(batch)
            self.record("read")

    def count(self, kind):
        return sum(1 for event, _ in self.events if event == kind)

    def sites(self, kind):
        return sorted({site for event, site in self.events if event == kind})

    def __enter__(self):
        self.events.clear()
        self.reads = 0
        self.active = True
        return self

    def __exit__(self, *exc):
        self.active = False


def _site():
    import traceback  # noqa: PLC0415

    for frame in reversed(traceback.extract_stack()[:-3]):
        if "/loopax/" in frame.filename:
            return f"{frame.filename.rsplit('/loopax/', 1)[1]}:{frame.lineno} {frame.name}"
    return "(outside loopax)"


def reads_outside_waits(events):
    """The sites of reads made between two dispatches with no wait between them."""
    outside, waited = [], False
    for kind, site in events:
        if kind == "dispatch":
            waited = False
        elif kind == "wait":
            waited = True
        elif kind == "read" and not waited:
            outside.append(site)
    return outside


def record_dispatches(loop, asks):
    """Records each call of the trainer's compiled programs as a "dispatch" event."""

    def recorded(run):
        def recording(*args):
            result = run(*args)
            if asks.active:
                asks.record("dispatch")
                asks.newest_outputs(result)
            return result

        return recording

    for executor in loop.trainer.executors():
        executor.run = recorded(executor.run)


@pytest.fixture
def asks(monkeypatch):
    devices = jax.devices()
    if len(devices) == 1 and devices[0].platform == "cpu":
        # `--accelerator` on a machine without one: a lone CPU device's arrays are read
        # through the buffer protocol, which the count cannot see.
        pytest.skip("counting reads needs several CPU devices or an accelerator")
    with host_copies_started_on_cpu():  # as on an accelerator (loopax skips them on CPUs)
        yield DeviceAsks(monkeypatch)


def test_the_count_sees_reads_and_batches(asks):
    # The check can fail: each value read on its own is a read; values read together
    # (jax.device_get) are one.
    loop, data = new_loop(1)
    loop.run_steps(data, 3)
    alone = [loop.metrics[key] + 1 for key in loop.metrics]
    together = [loop.metrics[key] + 2 for key in loop.metrics]
    assert len(alone) >= 2 and all(isinstance(value, jax.Array) for value in alone)
    with asks:
        jax.block_until_ready(alone + together)
        for value in alone:
            float(np.asarray(value))
        jax.device_get(together)
        float(np.asarray(together[0]))  # its copy came with the others: no wait of its own
    assert asks.reads == len(alone) + 1
    assert asks.count("wait") == 1


@pytest.mark.parametrize("on_device", [True, False], ids=["on-device data", "host data"])
@pytest.mark.parametrize("k", [1, 8])
def test_a_bare_run_reads_only_its_check_where_it_waits(asks, k, on_device):
    # With no hooks, the steps of a run make no read except where the in-flight bound
    # waits for the oldest steps (and the run's end waits for all): the one value that
    # checks every loss of the steps waited for (the newest's moving average of the loss).
    loop, data = new_loop(k, on_device)
    loop.run_steps(data, 40)  # warm-up: compiles
    record_dispatches(loop, asks)
    with asks:
        loop.run_steps(data, STEPS)
    waits, dispatches = asks.count("wait"), asks.count("dispatch")
    assert dispatches == STEPS // k
    assert reads_outside_waits(asks.events) == []
    assert asks.count("start") == 0, asks.sites("start")
    assert 1 <= asks.reads <= waits, asks.sites("read")
    # Waits only where the bound forces one (for the older half of the steps in flight)
    # and at the run's end: never one a dispatch, and none for the newest step (which
    # would leave the device nothing queued) but the run's last.
    assert waits <= dispatches // 2 + 1, asks.sites("wait")
    assert asks.count("drain") == 1
    assert loop.trainer.global_step == 40 + STEPS


TB_EVERY, CHECKPOINT_EVERY, BAR_EVERY = 16, 32, 8


def readme_hooks(loop, directory):
    """The README's hooks, firing at set steps: TensorBoard, a checkpoint and the bar."""
    # The bar's clock is the loop's step: it refreshes every BAR_EVERY steps, on any machine.
    hooks.progress_bar(
        loop,
        file=io.StringIO(),
        lines=False,
        refresh_seconds=BAR_EVERY,
        clock=lambda: float(loop.loop_step),
    )
    hooks.tensorboard(loop, directory / "tensorboard", every_n_steps=TB_EVERY)
    hooks.checkpoint(loop, directory / "checkpoints", every_n_steps=CHECKPOINT_EVERY)


@pytest.mark.parametrize("k", [1, 8])
def test_the_readme_hooks_read_once_per_firing(asks, tmp_path, k):
    # Each hook reads the devices only at the steps it fires, and reads what it needs
    # there together: TensorBoard's logs are read with the next wait's check (no read of
    # their own), a checkpoint reads its state in one go after the wait it asks for, the
    # bar reads its newest finished step's metrics in one go.
    loop, data = new_loop(k)
    readme_hooks(loop, tmp_path)
    loop.run_steps(data, 40)  # warm-up: compiles, the first save
    record_dispatches(loop, asks)
    with asks:
        loop.run_steps(data, STEPS)
    waits = asks.count("wait")
    saves = len(range(64, 40 + STEPS + 1, CHECKPOINT_EVERY)) + 1  # global steps 64, 96; the end
    bar_refreshes = STEPS // BAR_EVERY + 1  # and the run's end
    # Each wait reads its check and the logs due with it; each save its state, and the
    # logs its flush hands out (the run's last, at its end); each refresh of the bar its
    # newest finished step's metrics, if newer than those shown.
    assert asks.reads <= waits + 2 * saves + bar_refreshes, asks.sites("read")
    assert loop.trainer.global_step == 40 + STEPS
    # Every TensorBoard point of the run was written: every TB_EVERY global steps, and the
    # run's last step.
    logged = [step for step, _ in loop.history["train/loss"] if step > 40]
    end = 40 + STEPS
    assert logged == sorted({*range(48, end + 1, TB_EVERY), end})


def test_a_log_of_several_metrics_is_one_read(asks):
    # A writer's point (the loss, its moving average, the learning rate) is read together.
    loop, data = new_loop(1)
    points = []
    loop.on_step(
        "log",
        lambda loop, metrics: loop.log_train_metrics(
            lambda step, values: points.append(values),
            {"train/learning_rate": loop.metrics["loss"] * 0 + 0.01},
        ),
        when=hooks.EveryNSteps(10),
    )
    loop.run_steps(data, 10)
    with asks:
        loop.run_steps(data, 10)
    assert len(points) == 2 and len(points[-1]) >= 3
    assert asks.reads <= asks.count("wait"), asks.sites("read")


def test_host_metrics_read_once_together(asks):
    loop, data = new_loop(1)
    loop.run_steps(data, 3)
    with asks:
        values = loop.host_metrics()
        again = loop.host_metrics()
    assert len(values) >= 2 and values == again
    assert asks.reads == 1


def test_state_dict_reads_its_leaves_together(asks):
    loop, data = new_loop(1)
    loop.run_steps(data, 3)
    leaves = len(jax.tree.leaves(loop.trainer.state))
    with asks:
        state = loop.trainer.state_dict()
    assert len(jax.tree.leaves(state)) == leaves > 2
    assert asks.reads == 1


def test_cpu_arrays_are_read_without_starting_copies(monkeypatch):
    # A CPU device's memory is the host's: a started copy there costs more than the read it
    # would batch (the README's hooks lost 1-2% of a fused run's steps/s to it), so loopax
    # starts none; the tests above count reads as an accelerator pays them.
    loop, data = new_loop(1)
    loop.run_steps(data, 3)
    asks = DeviceAsks(monkeypatch)
    with asks:
        values = loop.host_metrics()
        loop.trainer.state_dict()
    assert len(values) >= 2
    assert asks.count("start") == 0 and asks.reads > 1
    with host_copies_started_on_cpu(), asks:
        loop.trainer.state_dict()
    assert asks.count("start") > 2 and asks.reads == 1
