"""Optimizer factories: optax optimizers with an injectable learning rate and clipping.

Every factory returns a plain ``optax.GradientTransformation`` built with
``optax.inject_hyperparams``, so the learning rate lives in the optimizer state's
``hyperparams`` dict (``hyperparams["learning_rate"]``): readable for logging and
replaceable at run time without recompiling (see ``get_learning_rate`` /
``set_learning_rate``).

Every factory also takes ``clip_value`` (clip each gradient element to
``[-clip_value, clip_value]`` before the optimizer) and ``clip_global_norm`` (rescale the
gradients so that their global norm is at most ``clip_global_norm``, after ``clip_value``);
None (the default) for no clipping, a non-positive threshold raises ``ValueError``.

``learning_rate`` is a non-negative number or a schedule of the step count (e.g.
``cosine_decay(...)``); anything else raises ``ValueError`` when the factory is called.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from ._by_name import build_by_name

LearningRate = float | optax.Schedule


def _uncalled_factory(value: Any) -> bool:
    """Whether `value` is a schedule *factory* (e.g. `cosine_decay`) rather than a schedule.

    A schedule takes the step count alone; a factory is a module-level function of optax's
    or loopax's schedules, or any function that needs more than one argument.
    """
    module = getattr(value, "__module__", None) or ""
    qualname = getattr(value, "__qualname__", "") or ""
    if module.startswith(("optax.schedules", "optax._src.schedule", "loopax.optimizers")) and (
        "<locals>" not in qualname and "." not in qualname
    ):
        return True
    try:
        parameters = inspect.signature(value).parameters.values()
    except (TypeError, ValueError):
        return False
    required = [
        p
        for p in parameters
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return len(required) > 1


def _check_learning_rate(optimizer: str, learning_rate: Any) -> None:
    if callable(learning_rate):
        if _uncalled_factory(learning_rate):
            name = getattr(learning_rate, "__name__", repr(learning_rate))
            raise TypeError(
                f"{optimizer}: learning_rate={name} is a schedule factory, not a schedule: "
                f"call it with its arguments, e.g. learning_rate={name}(1e-3, 1000) for "
                "cosine_decay (a schedule is a function of the step count alone)."
            )
        return
    if isinstance(learning_rate, bool) or not (
        isinstance(learning_rate, numbers.Real)
        or (isinstance(learning_rate, (np.ndarray, jax.Array)) and np.ndim(learning_rate) == 0)
    ):
        raise ValueError(
            f"{optimizer}: learning_rate={learning_rate!r} must be a non-negative number "
            "or a schedule (a function of the step count, e.g. "
            "loopax.optimizers.cosine_decay(...))."
        )
    if learning_rate < 0:
        raise ValueError(f"{optimizer}: learning_rate={learning_rate!r} must be non-negative.")


def _clipping(
    optimizer: str, clip_value: float | None, clip_global_norm: float | None
) -> list[optax.GradientTransformation]:
    transforms = []
    for argument, threshold, clip, clipping_by in (
        ("clip_value", clip_value, optax.clip, "value"),
        ("clip_global_norm", clip_global_norm, optax.clip_by_global_norm, "global norm"),
    ):
        if threshold is None:
            continue
        if not threshold > 0:
            raise ValueError(
                f"{optimizer}: {argument}={threshold!r} must be positive, or None for no "
                f"clipping by {clipping_by}."
            )
        transforms.append(clip(threshold))
    return transforms


def _check_momentum(optimizer: str, momentum: float | None, nesterov: bool) -> None:
    if momentum is not None and not 0.0 <= momentum < 1.0:
        raise ValueError(
            f"{optimizer}: momentum={momentum!r} must be in [0, 1), or None for no momentum."
        )
    if nesterov and momentum is None:
        raise ValueError(f"{optimizer}: nesterov=True needs a momentum, e.g. momentum=0.9.")


def _build(
    optimizer: str,
    factory: Callable[..., optax.GradientTransformation],
    learning_rate: LearningRate,
    clip_value: float | None,
    clip_global_norm: float | None,
    static_args: tuple[str, ...] = (),
    **hyperparams: Any,
) -> optax.GradientTransformation:
    """`factory(learning_rate, **hyperparams)`, injected and after the clipping, if any."""
    _check_learning_rate(optimizer, learning_rate)
    clipping = _clipping(optimizer, clip_value, clip_global_norm)
    injected = optax.inject_hyperparams(factory, static_args=static_args)
    inner = injected(learning_rate=learning_rate, **hyperparams)
    if not clipping:
        return inner
    return optax.chain(*clipping, inner)


def sgd(
    learning_rate: LearningRate = 0.1,
    momentum: float | None = None,
    nesterov: bool = False,
    *,
    clip_value: float | None = None,
    clip_global_norm: float | None = None,
) -> optax.GradientTransformation:
    """Returns stochastic gradient descent, optionally with (Nesterov) momentum.

    Args:
        learning_rate: the step size (module docs).
        momentum: the momentum decay in ``[0, 1)``, or None for plain SGD.
        nesterov: use Nesterov momentum (needs ``momentum``).
        clip_value: see the module docs.
        clip_global_norm: see the module docs.

    Raises:
        ValueError: for a momentum outside ``[0, 1)`` or ``nesterov`` without one.

    Example:
        >>> import jax.numpy as jnp
        >>> from loopax.optimizers import sgd
        >>> optimizer = sgd(0.5)
        >>> params = jnp.array([1.0, 2.0])
        >>> updates, _ = optimizer.update(jnp.array([1.0, -1.0]), optimizer.init(params))
        >>> updates.tolist()
        [-0.5, 0.5]
    """
    _check_momentum("sgd", momentum, nesterov)
    return _build(
        "sgd",
        optax.sgd,
        learning_rate,
        clip_value,
        clip_global_norm,
        momentum=momentum,
        nesterov=nesterov,
    )


def adam(
    learning_rate: LearningRate = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    clip_value: float | None = None,
    clip_global_norm: float | None = None,
) -> optax.GradientTransformation:
    """Returns the Adam optimizer.

    Args:
        learning_rate: the step size (module docs).
        b1: exponential decay rate of the first moment estimate.
        b2: exponential decay rate of the second moment estimate.
        eps: added to the denominator for numerical stability.
        clip_value: see the module docs.
        clip_global_norm: see the module docs.

    Example:
        >>> import jax.numpy as jnp
        >>> from loopax.optimizers import adam
        >>> optimizer = adam(0.1)
        >>> updates, _ = optimizer.update(jnp.array([3.0, -0.5]), optimizer.init(jnp.zeros(2)))
        >>> [round(update, 4) for update in updates.tolist()]  # first Adam step: -lr * sign
        [-0.1, 0.1]
    """
    return _build(
        "adam",
        optax.adam,
        learning_rate,
        clip_value,
        clip_global_norm,
        b1=b1,
        b2=b2,
        eps=eps,
    )


def adamw(
    learning_rate: LearningRate = 1e-3,
    weight_decay: float = 1e-4,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    mask: Any = None,
    *,
    clip_value: float | None = None,
    clip_global_norm: float | None = None,
) -> optax.GradientTransformation:
    """Returns Adam with decoupled weight decay (AdamW).

    Each update subtracts ``learning_rate * weight_decay * params`` on top of the Adam
    step, so ``update`` must be given ``params``.

    Args:
        learning_rate: the step size (module docs).
        weight_decay: the decoupled weight-decay rate (non-negative).
        b1: as in ``adam``.
        b2: as in ``adam``.
        eps: as in ``adam``.
        mask: optional pytree of booleans (or a function of the params returning one)
            selecting which parameters are decayed; None decays all.
        clip_value: see the module docs.
        clip_global_norm: see the module docs.

    Raises:
        ValueError: for a negative weight decay.

    Example:
        >>> import jax.numpy as jnp
        >>> from loopax.optimizers import adamw
        >>> optimizer = adamw(0.1, weight_decay=0.5)
        >>> params = jnp.array([1.0, 2.0])
        >>> zero_grads = jnp.zeros(2)
        >>> updates, _ = optimizer.update(zero_grads, optimizer.init(params), params)
        >>> [round(update, 4) for update in updates.tolist()]  # -lr * weight_decay * params
        [-0.05, -0.1]
    """
    if weight_decay < 0:
        raise ValueError(f"adamw: weight_decay={weight_decay!r} must be non-negative.")
    return _build(
        "adamw",
        optax.adamw,
        learning_rate,
        clip_value,
        clip_global_norm,
        # A callable mask is a function of the params, not a schedule to inject.
        static_args=("mask",),
        mask=mask,
        weight_decay=weight_decay,
        b1=b1,
        b2=b2,
        eps=eps,
    )


def rmsprop(
    learning_rate: LearningRate = 1e-3,
    decay: float = 0.9,
    eps: float = 1e-8,
    momentum: float | None = None,
    centered: bool = False,
    nesterov: bool = False,
    *,
    clip_value: float | None = None,
    clip_global_norm: float | None = None,
) -> optax.GradientTransformation:
    """Returns the RMSProp optimizer.

    Each step divides the gradient by the root of a running average of its square (minus
    the square of its running average when ``centered``).

    Args:
        learning_rate: the step size (module docs).
        decay: decay rate of the running average of squared gradients.
        eps: added inside the square root for numerical stability.
        momentum: as in ``sgd``, or None for none.
        centered: normalize by the estimated variance instead of the second moment.
        nesterov: as in ``sgd``.
        clip_value: see the module docs.
        clip_global_norm: see the module docs.

    Raises:
        ValueError: as ``sgd`` for ``momentum`` and ``nesterov``.

    Example:
        >>> import jax.numpy as jnp
        >>> from loopax.optimizers import rmsprop
        >>> optimizer = rmsprop(0.01, decay=0.75)
        >>> params = jnp.array([1.0])
        >>> updates, _ = optimizer.update(jnp.array([2.0]), optimizer.init(params))
        >>> round(updates.tolist()[0], 4)  # -lr * g / sqrt((1 - decay) * g**2)
        -0.02
    """
    _check_momentum("rmsprop", momentum, nesterov)
    return _build(
        "rmsprop",
        optax.rmsprop,
        learning_rate,
        clip_value,
        clip_global_norm,
        decay=decay,
        eps=eps,
        momentum=momentum,
        centered=centered,
        nesterov=nesterov,
    )


_OPTIMIZERS: dict[str, Callable[..., optax.GradientTransformation]] = {
    "adam": adam,
    "adamw": adamw,
    "rmsprop": rmsprop,
    "sgd": sgd,
}


def from_name(name: str, **hparams: Any) -> optax.GradientTransformation:
    """Returns the optimizer called ``name`` built with the given hyperparameters.

    Args:
        name: one of ``"adam"``, ``"adamw"``, ``"rmsprop"``, ``"sgd"``
            (case-insensitive).
        **hparams: keyword arguments of that optimizer's factory, e.g.
            ``learning_rate``, ``clip_global_norm``.

    Returns:
        The ``optax.GradientTransformation`` built by that factory.

    Raises:
        ValueError: if ``name`` is not a known optimizer; the message lists the valid
            names.
        TypeError: if a hyperparameter is not accepted by that optimizer; the message
            names it and lists the valid ones.

    Example:
        >>> from loopax.optimizers import from_name, get_learning_rate
        >>> optimizer = from_name("adamw", learning_rate=0.5, weight_decay=0.1)
        >>> float(get_learning_rate(optimizer.init({"w": 1.0})))
        0.5
        >>> from_name("adagrad")
        Traceback (most recent call last):
        ...
        ValueError: unknown optimizer 'adagrad'; valid names are: adam, adamw, rmsprop, sgd.
    """
    return build_by_name("optimizer", name, _OPTIMIZERS, hparams)
