"""Learning-rate schedules: thin, validated factories over optax schedules.

Each factory returns a plain ``optax.Schedule`` (a function of the update count), so any
loopax optimizer accepts it as ``learning_rate``. Invalid settings raise at construction
instead of optax's warn-and-fall-back behaviour.
"""

from __future__ import annotations

import optax


def _require_positive_steps(function: str, argument: str, steps: int) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0:
        raise ValueError(
            f"{function}: {argument}={steps!r} must be a positive integer number of steps."
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

    The value at step ``t`` is
    ``init_value * ((1 - alpha) * 0.5 * (1 + cos(pi * min(t, decay_steps) / decay_steps)) + alpha)``.

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
    _require_positive_steps("cosine_decay", "decay_steps", decay_steps)
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
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(
            f"warmup_cosine: warmup_steps={warmup_steps!r} must be a non-negative integer."
        )
    _require_positive_steps("warmup_cosine", "decay_steps", decay_steps)
    if decay_steps <= warmup_steps:
        raise ValueError(
            f"warmup_cosine: decay_steps={decay_steps} must be larger than "
            f"warmup_steps={warmup_steps}, because decay_steps counts the warmup too; "
            f"use decay_steps={warmup_steps} + <number of decay steps>."
        )
    return optax.warmup_cosine_decay_schedule(
        init_value=init_value,
        peak_value=peak_value,
        warmup_steps=warmup_steps,
        decay_steps=decay_steps,
        end_value=end_value,
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
        >>> [round(float(schedule(step)), 4) for step in (0, 10, 20, 25)]
        [1.0, 0.5, 0.25, 0.1768]
    """
    _require_positive_steps("exponential_decay", "transition_steps", transition_steps)
    if not decay_rate > 0:
        raise ValueError(f"exponential_decay: decay_rate={decay_rate!r} must be positive.")
    if transition_begin < 0:
        raise ValueError(
            f"exponential_decay: transition_begin={transition_begin!r} must be non-negative."
        )
    return optax.exponential_decay(
        init_value=init_value,
        transition_steps=transition_steps,
        decay_rate=decay_rate,
        transition_begin=transition_begin,
        staircase=staircase,
        end_value=end_value,
    )
