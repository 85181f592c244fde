"""How loopax's public names present themselves to users."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def show_errors_under(module_name: str, namespace: Mapping[str, Any]) -> None:
    """Makes each public exception class of `namespace` show `module_name` as its module.

    A traceback then reads `loopax.HookError: ...` (where users import it from), not the
    private module that defines it.
    """
    for name in namespace.get("__all__", ()):
        value = namespace.get(name)
        if isinstance(value, type) and issubclass(value, BaseException):
            value.__module__ = module_name
