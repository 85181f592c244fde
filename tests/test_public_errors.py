"""Public errors show their public module in a traceback, never a private file's."""

import importlib
import inspect
import traceback

import pytest

PACKAGES = ["loopax", "loopax.hooks", "loopax.testing", "loopax.loop"]


def public_errors():
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            value = getattr(module, name)
            if inspect.isclass(value) and issubclass(value, BaseException):
                yield package, name, value


@pytest.mark.parametrize(("package", "name", "error"), list(public_errors()))
def test_a_public_error_is_shown_under_a_public_module(package, name, error):
    assert not any(part.startswith("_") for part in error.__module__.split("."))
    assert getattr(importlib.import_module(error.__module__), name) is error


def test_a_hook_error_in_a_traceback_reads_loopax_hook_error():
    import loopax

    try:
        raise loopax.HookError("OnStep", "bad", 3, ValueError("boom"))
    except loopax.HookError as err:
        shown = traceback.format_exception_only(err)[-1]
    assert shown.startswith("loopax.HookError: OnStep hook 'bad' failed at step 3: ValueError")
