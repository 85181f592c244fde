"""Building an optimizer or a schedule from its name and keyword arguments."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

Built = TypeVar("Built")


def build_by_name(
    kind: str, name: str, registry: Mapping[str, Callable[..., Built]], hparams: dict[str, Any]
) -> Built:
    """Calls the factory registered as `name` (case-insensitive) with `hparams`.

    Raises:
        ValueError: if `name` is not in `registry`; the message lists the valid names.
        TypeError: if a keyword is not a parameter of that factory; the message names it,
            suggests the closest valid one and lists them all.
    """
    key = name.lower() if isinstance(name, str) else name
    if key not in registry:
        raise ValueError(
            f"unknown {kind} {name!r}; valid names are: {', '.join(sorted(registry))}."
        )
    factory = registry[key]
    valid = list(inspect.signature(factory).parameters)
    unknown = [keyword for keyword in hparams if keyword not in valid]
    if unknown:
        hints = []
        for keyword in unknown:
            close = difflib.get_close_matches(keyword, valid, n=1)
            if close:
                hints.append(f" (did you mean {close[0]!r} for {keyword!r}?)")
        raise TypeError(
            f"{kind} {key!r} got unknown hyperparameter(s) "
            f"{', '.join(repr(keyword) for keyword in unknown)}{''.join(hints)}; "
            f"valid ones are: {', '.join(valid)}."
        )
    return factory(**hparams)
