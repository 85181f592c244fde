"""Learning-rate schedules: validated optax schedules and GoMLX's periodic cosine.

Each factory returns a plain ``optax.Schedule`` (a function of the update count), so any
loopax optimizer accepts it as ``learning_rate``. Invalid settings raise at construction
instead of optax's warn-and-fall-back behaviour. ``schedule_from_name`` builds any of them
from its name, as in configuration files.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

import jax.numpy as jnp
import optax

from ._by_name import build_by_name


def _require_steps(function: str, argument: str, steps: int, minimum: int = 1) -> None:
    """Raises unless `steps` is an int (not a bool) of at least `minimum` (1 or 0)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < minimum:
        sign = "positive" if minimum == 1 else "non-negative"
        raise ValueError(
            f"{function}: {argument}={steps!r} must be a {sign} integer number of steps."
        )


def constant_schedule(value: float) -> optax.Schedule:
    """Returns a schedule that always gives ``value``.

    Args:
        value: the learning rate at every step.

    Returns:
        An ``optax.Schedule`` mapping any step count to ``value``.

    Raises:
        ValueError: if ``value`` is negative.

    Example:
        >>> from loopax.optimizers import constant_schedule
        >>> schedule = constant_schedule(0.01)
        >>> float(schedule(0)), float(schedule(1000))
        (0.01, 0.01)
    """
    if value < 0:
        raise ValueError(f"constant_schedule: value={value!r} must be non-negative.")
    return optax.constant_schedule(value)


def cosine_decay(init_value: float, decay_steps: int, alpha: float = 0.0) -> optax.Schedule:
    """Returns a cosine decay from ``init_value`` to ``alpha * init_value``.

    The value at step ``t``, with ``progress = min(t, decay_steps) / decay_steps``, is
    ``init_value * ((1 - alpha) * 0.5 * (1 + cos(pi * progress)) + alpha)``.

    Args:
        init_value: the value at step 0.
        decay_steps: number of steps over which to decay; the value stays at
            ``alpha * init_value`` afterwards.
        alpha: final value as a fraction of ``init_value``, in ``[0, 1]``.

    Returns:
        An ``optax.Schedule``.

    Raises:
        ValueError: if ``decay_steps`` is not a positive integer or ``alpha`` is outside
            ``[0, 1]``.

    Example:
        >>> from loopax.optimizers import cosine_decay
        >>> schedule = cosine_decay(1.0, decay_steps=100, alpha=0.1)
        >>> [round(float(schedule(step)), 4) for step in (0, 50, 100, 200)]
        [1.0, 0.55, 0.1, 0.1]
    """
    _require_steps("cosine_decay", "decay_steps", decay_steps)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"cosine_decay: alpha={alpha!r} must be in [0, 1].")
    return optax.cosine_decay_schedule(init_value, decay_steps, alpha=alpha)


def warmup_cosine(
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    init_value: float = 0.0,
    end_value: float = 0.0,
) -> optax.Schedule:
    """Returns a linear warmup to ``peak_value`` followed by a cosine decay to ``end_value``.

    As in optax, ``decay_steps`` is the total length of the schedule *including* the
    warmup: the value rises linearly from ``init_value`` to ``peak_value`` over
    ``warmup_steps``, then follows a cosine from ``peak_value`` to ``end_value`` over the
    remaining ``decay_steps - warmup_steps`` steps, and stays at ``end_value`` afterwards.

    Args:
        peak_value: the value reached at the end of the warmup.
        warmup_steps: number of linear warmup steps (0 for none).
        decay_steps: total number of steps of warmup plus decay.
        init_value: the value at step 0.
        end_value: the value at and after step ``decay_steps``.

    Returns:
        An ``optax.Schedule``.

    Raises:
        ValueError: if ``warmup_steps`` is negative or ``decay_steps`` is not larger than
            ``warmup_steps``.

    Example:
        >>> from loopax.optimizers import warmup_cosine
        >>> schedule = warmup_cosine(1.0, warmup_steps=10, decay_steps=110)
        >>> [round(float(schedule(step)), 4) for step in (0, 5, 10, 60, 110)]
        [0.0, 0.5, 1.0, 0.5, 0.0]
    """
    _require_steps("warmup_cosine", "warmup_steps", warmup_steps, minimum=0)
    _require_steps("warmup_cosine", "decay_steps", decay_steps)
    if decay_steps <= warmup_steps:
        raise ValueError(
            f"warmup_cosine: decay_steps={decay_steps} must be larger than "
            f"warmup_steps={warmup_steps}, because decay_steps counts the warmup too; "
            f"use decay_steps={warmup_steps} + <number of decay steps>."
        )
    return optax.warmup_cosine_decay_schedule(
        init_value, peak_value, warmup_steps, decay_steps, end_value
    )


def exponential_decay(
    init_value: float,
    transition_steps: int,
    decay_rate: float,
    transition_begin: int = 0,
    staircase: bool = False,
    end_value: float | None = None,
) -> optax.Schedule:
    """Returns an exponential decay by ``decay_rate`` every ``transition_steps`` steps.

    The value at step ``t >= transition_begin`` is
    ``init_value * decay_rate ** ((t - transition_begin) / transition_steps)`` (the
    exponent is floored when ``staircase``), bounded by ``end_value`` when given; before
    ``transition_begin`` it is ``init_value``.

    Args:
        init_value: the value until ``transition_begin``.
        transition_steps: number of steps over which the value is multiplied by
            ``decay_rate``.
        decay_rate: the multiplier per ``transition_steps``; must be positive.
        transition_begin: the step at which the decay starts.
        staircase: decay in discrete jumps every ``transition_steps`` steps.
        end_value: a lower bound (upper bound when ``decay_rate > 1``), or None.

    Returns:
        An ``optax.Schedule``.

    Raises:
        ValueError: if ``transition_steps`` is not a positive integer, ``decay_rate`` is
            not positive or ``transition_begin`` is negative.

    Example:
        >>> from loopax.optimizers import exponential_decay
        >>> schedule = exponential_decay(1.0, transition_steps=10, decay_rate=0.5)
        >>> float(schedule(20))  # halved every 10 steps
        0.25
        >>> round(float(schedule(25)), 4)  # 0.5 ** 2.5: smooth between the halvings
        0.1768
    """
    _require_steps("exponential_decay", "transition_steps", transition_steps)
    if not decay_rate > 0:
        raise ValueError(f"exponential_decay: decay_rate={decay_rate!r} must be positive.")
    if transition_begin < 0:
        raise ValueError(
            f"exponential_decay: transition_begin={transition_begin!r} must be non-negative."
        )
    # The same arguments in the same order as optax's.
    return optax.exponential_decay(
        init_value, transition_steps, decay_rate, transition_begin, staircase, end_value
    )


def _check_value(function: str, argument: str, value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{function}: {argument}={value!r} must be a non-negative finite number.")
    return float(value)


def periodic_cosine(
    init_value: float,
    period_steps: int | None = None,
    min_value: float = 0.0,
    warmup_steps: int = 0,
    *,
    num_cycles: int | None = None,
    total_steps: int | None = None,
) -> optax.Schedule:
    """Returns GoMLX's cosine annealing schedule, which restarts at every period.

    At step ``t`` (the number of updates done so far), with ``a = t - warmup_steps``:

    - during the warmup (``a < 0``), the value rises linearly:
      ``min_value + (init_value - min_value) * t / warmup_steps``;
    - afterwards, with ``fraction = (a mod period) / period`` in ``[0, 1)``, it is
      ``min_value + (init_value - min_value) * (1 + cos(pi * fraction)) / 2``.

    So the value falls from ``init_value`` towards ``min_value`` over each period and jumps
    back to ``init_value`` at the start of the next one (unlike ``cosine_decay``, which
    stays at its end value). As in GoMLX (``cosineschedule``), give either the period in
    steps or a number of cycles over ``total_steps`` (then
    ``period = (total_steps - warmup_steps) / num_cycles``, possibly fractional), and the
    warmup starts at ``min_value``.

    Args:
        init_value: the value at the start of each period (the peak).
        period_steps: the length of one period in steps; a positive integer. Exclusive
            with ``num_cycles``.
        min_value: the value the cosine approaches at the end of each period; in
            ``[0, init_value]``.
        warmup_steps: the number of linear warmup steps before the first period (0 for
            none).
        num_cycles: the number of periods in ``total_steps`` after the warmup; a positive
            integer. Exclusive with ``period_steps``.
        total_steps: the number of steps of the whole training; needed with ``num_cycles``.

    Returns:
        An ``optax.Schedule``; any loopax optimizer takes it as ``learning_rate``, and
        ``get_learning_rate`` reads the value of the last update.

    Raises:
        ValueError: if neither or both of ``period_steps`` and ``num_cycles`` are given,
            ``total_steps`` is missing or not larger than ``warmup_steps`` with
            ``num_cycles`` (or given without it), a step count is not an integer of the
            right sign, or ``min_value`` is outside ``[0, init_value]``.

    Example:
        >>> from loopax.optimizers import periodic_cosine
        >>> schedule = periodic_cosine(1.0, period_steps=100, min_value=0.001)
        >>> [round(float(schedule(step)), 4) for step in (0, 50, 99, 100, 150)]
        [1.0, 0.5005, 0.0012, 1.0, 0.5005]
        >>> warm = periodic_cosine(1.0, period_steps=100, warmup_steps=10)
        >>> [round(float(warm(step)), 4) for step in (0, 5, 10, 60, 110)]
        [0.0, 0.5, 1.0, 0.5, 1.0]
    """
    function = "periodic_cosine"
    init_value = _check_value(function, "init_value", init_value)
    min_value = _check_value(function, "min_value", min_value)
    if min_value > init_value:
        raise ValueError(
            f"{function}: min_value={min_value!r} must not exceed init_value={init_value!r}."
        )
    _require_steps(function, "warmup_steps", warmup_steps, minimum=0)
    if period_steps is not None and num_cycles is None:
        _require_steps(function, "period_steps", period_steps)
        if total_steps is not None:
            raise ValueError(
                f"{function}: total_steps={total_steps!r} is only used with num_cycles; "
                "drop it, or give num_cycles instead of period_steps."
            )
        period = float(period_steps)
    elif num_cycles is not None and period_steps is None:
        _require_steps(function, "num_cycles", num_cycles)
        if total_steps is None:
            raise ValueError(
                f"{function}: num_cycles={num_cycles!r} needs total_steps, the number of "
                "training steps the cycles split (after the warmup)."
            )
        _require_steps(function, "total_steps", total_steps)
        if total_steps <= warmup_steps:
            raise ValueError(
                f"{function}: total_steps={total_steps} must be larger than "
                f"warmup_steps={warmup_steps}, so that the cycles have steps to split."
            )
        period = (total_steps - warmup_steps) / num_cycles
    else:
        raise ValueError(
            f"{function}: give exactly one of period_steps (the length of a period in steps) "
            f"or num_cycles (with total_steps); got period_steps={period_steps!r} and "
            f"num_cycles={num_cycles!r}."
        )
    span = init_value - min_value

    def schedule(count: Any) -> Any:
        step = jnp.asarray(count, jnp.float32)
        after_warmup = step - warmup_steps
        # fmod is exact in floating point, so the phase stays accurate on long runs.
        fraction = jnp.mod(after_warmup, period) / period
        value = min_value + span * 0.5 * (1.0 + jnp.cos(jnp.pi * fraction))
        if warmup_steps > 0:
            warming = min_value + span * jnp.minimum(step / warmup_steps, 1.0)
            value = jnp.where(after_warmup < 0, warming, value)
        return value

    return schedule


def _stepped_boundaries(boundaries_and_scales: Any) -> list[tuple[int, float]]:
    """The `(step, scale)` pairs of `stepped`, validated and sorted by step."""
    function = "stepped"
    if isinstance(boundaries_and_scales, Mapping):
        items = list(boundaries_and_scales.items())
    elif isinstance(boundaries_and_scales, (str, bytes)) or not isinstance(
        boundaries_and_scales, Iterable
    ):
        raise TypeError(
            f"{function}: boundaries_and_scales={boundaries_and_scales!r} must be a dict "
            "{step: scale} or a sequence of (step, scale) pairs, e.g. {30: 0.1, 60: 0.1}."
        )
    else:
        items = []
        for pair in boundaries_and_scales:
            if isinstance(pair, (str, bytes)) or not isinstance(pair, Iterable):
                raise TypeError(
                    f"{function}: boundaries_and_scales entry {pair!r} must be a (step, scale) "
                    "pair."
                )
            pair = tuple(pair)
            if len(pair) != 2:
                raise TypeError(
                    f"{function}: boundaries_and_scales entry {pair!r} must be a (step, scale) "
                    "pair."
                )
            items.append(pair)
    result: dict[int, float] = {}
    for key, scale in items:
        # Configuration files written as JSON have string keys: "30" means step 30.
        if isinstance(key, str) and key.strip().isdigit():
            key = int(key)
        if isinstance(key, numbers.Integral) and not isinstance(key, bool):
            key = int(key)
        _require_steps(function, "a boundaries_and_scales step", cast(int, key), minimum=0)
        step = int(key)
        if step in result:
            raise ValueError(
                f"{function}: boundary step {step} appears twice in boundaries_and_scales; "
                "give each step once with the product of its scales."
            )
        result[step] = _check_value(function, f"boundaries_and_scales[{step}]", scale)
    return sorted(result.items())


def stepped(
    init_value: float,
    boundaries_and_scales: Mapping[int, float] | Iterable[tuple[int, float]],
    warmup_steps: int = 0,
) -> optax.Schedule:
    """Returns a piecewise-constant ("stepped") schedule, optionally after a linear warmup.

    The value at step ``t`` (the number of updates done so far) is ``init_value`` times
    the product of every scale whose boundary step is at most ``t``: the scales multiply,
    as in optax's ``piecewise_constant_schedule`` (same argument, same values), so
    ``{30: 0.1, 60: 0.1}`` gives ``init_value`` for steps 0-29, ``init_value / 10`` for
    30-59 and ``init_value / 100`` from 60 on. ``flax.training.lr_schedule``'s stepped
    schedule gives each step its *absolute* factor and counts epochs: its
    ``lr_sched_steps=[[30, 0.1], [60, 0.01]]`` is ``{30 * steps_per_epoch: 0.1,
    60 * steps_per_epoch: 0.1}`` here.

    With ``warmup_steps``, the value is multiplied by ``min(1, t / warmup_steps)`` (a
    linear warmup from 0, as flax's ``warmup_length``); boundaries count from step 0,
    warmup included, as ``warmup_cosine``'s ``decay_steps`` does.

    Args:
        init_value: the value before the first boundary; a non-negative finite number.
        boundaries_and_scales: a dict ``{step: scale}`` (or a sequence of ``(step, scale)``
            pairs): from ``step`` on, the value is multiplied by ``scale``. Steps are
            non-negative integers (strings of digits, as JSON keys, are accepted); scales
            non-negative finite numbers. May be empty (a constant schedule).
        warmup_steps: the number of linear warmup steps (0 for none).

    Returns:
        An ``optax.Schedule``; any loopax optimizer takes it as ``learning_rate``.

    Raises:
        ValueError: if a step is negative, not an integer or given twice, a scale or
            ``init_value`` is negative or not finite, or ``warmup_steps`` is negative.
        TypeError: if ``boundaries_and_scales`` is not a dict or a sequence of pairs.

    Example:
        >>> from loopax.optimizers import stepped
        >>> schedule = stepped(1.0, {3: 0.1, 5: 0.5})
        >>> [round(float(schedule(step)), 4) for step in range(7)]
        [1.0, 1.0, 1.0, 0.1, 0.1, 0.05, 0.05]
        >>> warm = stepped(1.0, {6: 0.1}, warmup_steps=4)
        >>> [round(float(warm(step)), 4) for step in range(8)]
        [0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 0.1, 0.1]
    """
    function = "stepped"
    init_value = _check_value(function, "init_value", init_value)
    _require_steps(function, "warmup_steps", warmup_steps, minimum=0)
    pairs = _stepped_boundaries(boundaries_and_scales)
    boundaries = jnp.asarray([step for step, _ in pairs], jnp.int32)
    # values[i] is the value once i boundaries are passed.
    values_list = [init_value]
    for _, scale in pairs:
        values_list.append(values_list[-1] * scale)
    values = jnp.asarray(values_list, jnp.float32)

    def schedule(count: Any) -> Any:
        step = jnp.asarray(count)
        passed = jnp.sum(boundaries <= step) if pairs else jnp.asarray(0, jnp.int32)
        value = values[passed]
        if warmup_steps > 0:
            warming = jnp.minimum(jnp.asarray(step, jnp.float32) / warmup_steps, 1.0)
            value = value * warming
        return value

    return schedule


_SCHEDULES: dict[str, Callable[..., optax.Schedule]] = {
    "constant": constant_schedule,
    "constant_schedule": constant_schedule,
    "cosine_decay": cosine_decay,
    "exponential_decay": exponential_decay,
    "periodic_cosine": periodic_cosine,
    "stepped": stepped,
    "warmup_cosine": warmup_cosine,
}


def schedule_from_name(name: str, **kwargs: Any) -> optax.Schedule:
    """Returns the learning-rate schedule called ``name`` built with ``kwargs``.

    Args:
        name: one of ``"constant"`` (or ``"constant_schedule"``), ``"cosine_decay"``,
            ``"exponential_decay"``, ``"periodic_cosine"``, ``"stepped"``,
            ``"warmup_cosine"`` (case-insensitive).
        **kwargs: the arguments of that schedule's factory, e.g. ``init_value`` and
            ``period_steps`` for ``"periodic_cosine"``.

    Returns:
        The ``optax.Schedule``, to pass as any loopax optimizer's ``learning_rate``.

    Raises:
        ValueError: if ``name`` is unknown (the message lists the valid names), or the
            factory rejects the values.
        TypeError: if an argument is not one of that factory's (the message names it and
            lists the valid ones).

    Example:
        >>> from loopax.optimizers import get_learning_rate, schedule_from_name, sgd
        >>> schedule = schedule_from_name("periodic_cosine", init_value=0.5, period_steps=4)
        >>> [round(float(schedule(step)), 4) for step in range(6)]
        [0.5, 0.4268, 0.25, 0.0732, 0.5, 0.4268]
        >>> float(get_learning_rate(sgd(schedule).init({"w": 0.0})))
        0.5
        >>> schedule_from_name("cosine")
        Traceback (most recent call last):
        ...
        ValueError: unknown schedule 'cosine'; valid names are: constant, constant_schedule, \
cosine_decay, exponential_decay, periodic_cosine, stepped, warmup_cosine.
    """
    return build_by_name("schedule", name, _SCHEDULES, kwargs)
