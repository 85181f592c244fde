"""A griffe extension: loopax's docstrings head their doctests `Example:`, as Google's guide does.

griffe's Google parser knows only `Examples:` as the section of `>>>` examples and renders
`Example:` as a note, whose doctest lines Markdown then reads as text (`[1.0, 0.5]` becomes a
link). This extension renames the heading before griffe parses the docstring, so the examples
render as code.
"""

import re
from typing import Any

import griffe

_EXAMPLE_HEADING = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Renames each `Example:` section heading to `Examples:`."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrites the heading in `obj`'s docstring, if it has one."""
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE_HEADING.sub(r"\1Examples:", obj.docstring.value)
