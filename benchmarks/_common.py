"""Shared pieces of the benchmarks: workloads, the cycling dataset, baselines, timing.

Every benchmark here compares *rates* (steps/s) measured side by side in one process:
the candidates of a comparison run one after another inside a round, the order rotates
from round to round, and a figure is the median over rounds of the per-round ratio. On a
shared machine a slow drift (another job starting) then hits both sides of a ratio alike.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import loopax
from loopax import hooks

Run = Callable[[], Any]  # runs one round of `steps` steps and waits for the last one


# -- workloads ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workload:
    """An MLP classification task: `dims[0]` features -> hidden layers -> `dims[-1]` classes."""

    name: str
    dims: tuple[int, ...]
    batch_size: int
    learning_rate: float = 1e-3

    @property
    def description(self) -> str:
        return f"MLP {'-'.join(map(str, self.dims))}, batch {self.batch_size}, adam"

    @property
    def num_classes(self) -> int:
        return self.dims[-1]

    def model_fn(self, ctx: loopax.Context, spec: Any, inputs: list) -> jax.Array:
        """The loopax model function (Flax Linen layers created in place)."""
        x = inputs[0]
        for width in self.dims[1:-1]:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.dims[-1])(x)

    def module(self) -> nn.Module:
        """The same network as a Flax module, for the hand-written baselines."""
        layers: list[Any] = []
        for width in self.dims[1:-1]:
            layers += [nn.Dense(width), nn.relu]
        return nn.Sequential([*layers, nn.Dense(self.dims[-1])])

    def optimizer(self) -> optax.GradientTransformation:
        return optax.adam(self.learning_rate)


TINY = Workload("tiny", (64, 128, 10), 64)  # overhead-bound: ~0.1-0.3 ms a step on 2 cores
MEDIUM = Workload("medium", (784, 512, 512, 10), 128)  # compute-bound: ~5-8 ms a step
WORKLOADS = {w.name: w for w in (TINY, MEDIUM)}


def loss_fn(labels: list, predictions: list) -> jax.Array:
    """Loopax loss: softmax cross-entropy with integer labels (per example)."""
    return optax.softmax_cross_entropy_with_integer_labels(predictions[0], labels[0])


Batch = tuple[Any, list, list]  # (spec, inputs, labels), as a loopax dataset yields them


def make_batches(
    workload: Workload, count: int = 16, seed: int = 0, sharding: Any = None
) -> list[Batch]:
    """`count` random batches, placed on the device (or with `sharding`) once, up front."""
    rng = np.random.default_rng(seed)
    where = sharding if sharding is not None else jax.devices()[0]
    batches = []
    for _ in range(count):
        x = rng.normal(size=(workload.batch_size, workload.dims[0])).astype(np.float32)
        y = rng.integers(0, workload.num_classes, size=(workload.batch_size,)).astype(np.int32)
        batches.append((None, [jax.device_put(x, where)], [jax.device_put(y, where)]))
    return batches


def host_arrays(batches: Sequence[Batch], steps: int) -> tuple[np.ndarray, np.ndarray]:
    """The inputs and labels of `steps` cycled batches as two numpy arrays, in order.

    This is the data as a Keras or loopax user holds it before training (on the host).
    """
    order = [batches[index % len(batches)] for index in range(steps)]
    return (
        np.concatenate([np.asarray(batch[1][0]) for batch in order]),
        np.concatenate([np.asarray(batch[2][0]) for batch in order]),
    )


class CyclingDataset:
    """Yields the same device-resident batches over and over (no host work)."""

    name = "cycling"

    def __init__(self, batches: Sequence[Batch]):
        self.batches = list(batches)
        self.position = 0

    def yield_batch(self) -> Batch:
        batch = self.batches[self.position]
        self.position = (self.position + 1) % len(self.batches)
        return batch

    def reset(self) -> None:
        self.position = 0


# -- the hand-written baselines -----------------------------------------------------------


def _hand_written_step(
    workload: Workload,
    axis_name: str | None,
    moving_average: bool = False,
    ema_decay: float | None = None,
):
    """A step `(state, x, y) -> (state, loss)`.

    With `moving_average`, the state also keeps the loss's moving average as `Trainer.train_step`
    does (weight `max(0.01, 1/count)`) and the step returns `(loss, average)`: what every loopax
    step computes beyond it. With `ema_decay`, the state's last entry is the moving average of
    the parameters, `decay * ema + (1 - decay) * params` after each update (as
    `Trainer(ema_decay=...)` keeps it).
    """
    model = workload.module()
    optimizer = workload.optimizer()

    def step_with_average(state, x, y):
        (params, opt_state), (average, count) = state[:2], state[2]
        (params, opt_state), loss = step((params, opt_state), x, y)
        count = count + 1.0
        weight = jnp.maximum(0.01, 1.0 / count)
        average = average * (1.0 - weight) + loss * weight
        return (params, opt_state, jnp.stack([average, count])), (loss, average)

    def step_with_ema(state, x, y):
        (params, opt_state), loss = step(state[:2], x, y)
        ema = jax.tree.map(lambda e, p: ema_decay * e + (1 - ema_decay) * p, state[2], params)
        return (params, opt_state, ema), loss

    def step(state, x, y):
        params, opt_state = state[:2]

        def loss_of(p):
            logits = model.apply(p, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_of)(params)
        if axis_name is not None:
            loss, grads = jax.lax.pmean((loss, grads), axis_name)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    def init(x):
        params = model.init(jax.random.PRNGKey(0), x)
        if moving_average:
            return (params, optimizer.init(params), jnp.zeros((2,), jnp.float32))
        if ema_decay is not None:
            return (params, optimizer.init(params), jax.tree.map(jnp.copy, params))
        return (params, optimizer.init(params))

    if moving_average:
        return step_with_average, init
    return (step if ema_decay is None else step_with_ema), init


def _cycle(step, state, batches: Sequence[Batch], steps: int, in_flight: int | None) -> Run:
    """Compiles `step` on the first batch, then returns the timed loop over `batches`.

    `in_flight`: if set, wait for the loss of the step that many steps back before
    dispatching the next (None: never wait until the end).
    """
    state, loss = step(state, batches[0][1][0], batches[0][2][0])
    jax.block_until_ready(loss)
    count = len(batches)

    def run() -> None:
        nonlocal state
        loss = None
        for index in range(steps):
            _, inputs, labels = batches[index % count]
            state, loss = step(state, inputs[0], labels[0])
        jax.block_until_ready(loss)

    def run_bounded() -> None:
        nonlocal state
        pending: collections.deque = collections.deque()
        for index in range(steps):
            _, inputs, labels = batches[index % count]
            state, loss = step(state, inputs[0], labels[0])
            pending.append(loss)
            if len(pending) > in_flight:
                jax.block_until_ready(pending.popleft())
        jax.block_until_ready(pending[-1])

    return run if in_flight is None else run_bounded


def hand_written(
    workload: Workload,
    batches: Sequence[Batch],
    steps: int,
    moving_average: bool = False,
    ema_decay: float | None = None,
) -> Run:
    """The baseline: a jitted step with donated state, as a careful user writes it.

    `moving_average`: keeping the loss's moving average too; `ema_decay`: and a moving
    average of the parameters; see `_hand_written_step`.
    """
    step, init = _hand_written_step(workload, None, moving_average, ema_decay)
    return _cycle(jax.jit(step, donate_argnums=0), init(batches[0][1][0]), batches, steps, None)


def hand_written_shard_map(
    workload: Workload,
    batches: Sequence[Batch],
    steps: int,
    devices: Sequence[Any],
    in_flight: int = 4,
) -> Run:
    """The data-parallel baseline: `jax.jit(jax.shard_map(step))` over a 1-D mesh.

    State replicated and donated, batch split on axis 0, loss and gradients averaged.

    `batches` should already be sharded with `batch_sharding(devices)`. At most
    `in_flight` steps are dispatched ahead (the loss of the step that many back is waited
    for): with several simulated CPU devices on few cores an unbounded queue of dispatched
    steps deadlocks the all-reduce (XLA aborts after 40 s). loopax bounds its queue the
    same way, with the same default of 4.
    """
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    step, init = _hand_written_step(workload, "data")
    stepped = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P())),
        donate_argnums=0,
    )
    state = jax.device_put(
        init(np.asarray(batches[0][1][0][:1])), jax.sharding.NamedSharding(mesh, P())
    )
    return _cycle(stepped, state, batches, steps, in_flight)


def batch_sharding(devices: Sequence[Any]) -> Any:
    """A sharding that splits axis 0 over `devices` (how data-parallel batches arrive)."""
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    return jax.sharding.NamedSharding(mesh, P("data"))


# -- loopax -------------------------------------------------------------------------------


def noop_hooks(count: int) -> Callable[[loopax.Loop], None]:
    """Attaches `count` no-op `every_n_steps(1000)` hooks (they never fire in a round)."""

    def attach(loop: loopax.Loop) -> None:
        for index in range(count):
            hooks.every_n_steps(loop, 1000, f"noop{index}", lambda loop, metrics: None)

    return attach


def loopax_loop(
    workload: Workload,
    batches: Sequence[Batch],
    steps: int,
    *,
    attach: Callable[[loopax.Loop], Any] | None = None,
    devices: Sequence[Any] | None = None,
    parallel: str = "shard_map",
    dataset: Any = None,
    model: Any = None,
    **trainer_options: Any,
) -> Run:
    """Loopax's `Loop.run_steps` over the cycling batches, with `attach(loop)` hooks.

    It reads `dataset` instead when given (e.g. an `ArrayDataset` of numpy arrays) and trains
    `model` (a model function, a Linen or an NNX module; default: the workload's model function);
    `trainer_options` go to the `Trainer` (e.g. `ema_decay=0.999`).
    """
    trainer = loopax.Trainer(
        workload.model_fn if model is None else model,
        loss_fn,
        workload.optimizer(),
        devices=list(devices) if devices is not None else jax.devices()[:1],
        parallel=parallel,
        **trainer_options,
    )
    loop = loopax.Loop(trainer)
    if attach is not None:
        attach(loop)
    if dataset is None:
        dataset = CyclingDataset(batches)
    loop.run_steps(dataset, 2)  # compile

    def run() -> None:
        metrics = loop.run_steps(dataset, steps)
        metrics["loss"].block_until_ready()

    return run


# -- timing -------------------------------------------------------------------------------


def timed(run: Run) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


@dataclasses.dataclass
class Timings:
    """Per-round seconds of each candidate, all running the same number of steps."""

    steps: int
    seconds: dict[str, list[float]]

    def rate(self, name: str) -> float:
        """Median steps/s of `name`."""
        return self.steps / statistics.median(self.seconds[name])

    def paired_ratios(self, name: str, reference: str) -> list[float]:
        """Per-round steps/s of `name` over `reference` (> 1: `name` is faster)."""
        return [
            ref / own for own, ref in zip(self.seconds[name], self.seconds[reference], strict=True)
        ]

    def ratio(self, name: str, reference: str) -> float:
        """The median of the paired ratios."""
        return statistics.median(self.paired_ratios(name, reference))

    def spread(self, name: str, reference: str) -> float:
        """Half the interquartile range of the paired ratios: the noise of `ratio`."""
        ratios = self.paired_ratios(name, reference)
        if len(ratios) < 4:
            return (max(ratios) - min(ratios)) / 2
        quartiles = statistics.quantiles(ratios, n=4)
        return (quartiles[2] - quartiles[0]) / 2


def interleave(
    candidates: dict[str, Run],
    steps: int,
    rounds: int,
    warmup: int = 1,
    on_round: Callable[[int], None] | None = None,
) -> Timings:
    """Runs every candidate once per round, rotating the order; returns the timings.

    The first `warmup` rounds are run but not recorded (caches, allocator, clocks). A
    candidate may return `{"": seconds, suffix: seconds, ...}` to report its own timings
    (recorded under `name` and `name + suffix`) instead of being timed whole.
    """
    names = list(candidates)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(-warmup, rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            started = time.perf_counter()
            parts = candidates[name]()
            elapsed = time.perf_counter() - started
            if round_index < 0:
                continue
            if isinstance(parts, dict):  # sub-timings, {"": main, suffix: other}
                for suffix, part in parts.items():
                    seconds.setdefault(name + suffix, []).append(part)
            else:
                seconds[name].append(elapsed)
        if on_round is not None and round_index >= 0:
            on_round(round_index)
    return Timings(steps, seconds)


README_HOOKS = ("progress_bar", "tensorboard", "checkpoint")


def readme_hooks(
    directory: Path, **checkpoint_kwargs: Any
) -> tuple[Callable[[Any], None] | None, str]:
    """The README's hooks as an `attach(loop)`, or None and why they cannot be attached.

    The README saves checkpoints every `period_seconds=60`; `checkpoint_kwargs` overrides
    that (the frequent-saves row saves every 1000 steps, several times a second here).
    """
    checkpoint_kwargs = checkpoint_kwargs or {"period_seconds": 60}
    missing = [name for name in README_HOOKS if not hasattr(hooks, name)]
    if missing:
        return None, f"n/a (hook missing: {', '.join(missing)})"

    def attach(loop: Any) -> None:
        kwargs: dict[str, Any] = {}
        parameters = inspect.signature(hooks.progress_bar).parameters
        if "file" in parameters:
            kwargs["file"] = open(os.devnull, "w")  # noqa: SIM115 (lives as long as the loop)
        if "lines" in parameters:
            kwargs["lines"] = False  # the bar a terminal shows, not the lines a file gets
        hooks.progress_bar(loop, **kwargs)
        hooks.tensorboard(loop, str(directory / "tensorboard"))
        hooks.checkpoint(loop, str(directory / "checkpoints"), **checkpoint_kwargs)

    return attach, ""


def split_end_of_run(loop_run: Callable[[], None], loop: Any) -> Callable[[], dict[str, float]]:
    """Times `loop_run` whole and up to its first OnEnd hook.

    That is: all steps done, before the end-of-run checkpoint save and the other hooks' end work.
    """
    marks: list[float] = []
    loop.on_end(
        "benchmark: steps done",
        lambda loop, metrics: marks.append(time.perf_counter()),
        priority=-(10**9),
    )

    def run() -> dict[str, float]:
        started = time.perf_counter()
        loop_run()
        ended = time.perf_counter()
        return {"": marks[-1] - started, "whole": ended - started}

    return run
