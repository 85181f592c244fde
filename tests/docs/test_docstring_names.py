"""Docstrings and comments in loopax/ name only members that exist.

A rename or a removal leaves the prose behind it naming the old member (`Trainer._state`
after the state moved out of the Trainer). Two forms are checked, which name their class
without doubt: `Class.member` for a class defined in loopax (`trainer.member` and
`loop.member` stand for `Trainer` and `Loop`), and `self.member` inside a class. A member
exists when the class or a base has it (`dir`), declares it (an annotation), or a method of
the class or of a loopax base assigns it (`self.member = ...`).
"""

import ast
import importlib
import inspect
import io
import pathlib
import re
import tokenize

import pytest

import loopax

PACKAGE = pathlib.Path(loopax.__file__).parent
# Instances the prose names by their usual variable name.
INSTANCE_NAMES = {"trainer": "Trainer", "loop": "Loop"}
DOTTED = re.compile(r"(?<![\w.])([A-Za-z_]\w*)\.(_{0,2}[A-Za-z]\w*)(?![\w*])")  # `run_*`: a glob


def module_name(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def assigned_members(node):
    """The names a class's body declares and its methods assign to `self.<name>`."""
    names = set()
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.add(item.target.id)
    for item in ast.walk(node):
        if (
            isinstance(item, ast.Attribute)
            and isinstance(item.ctx, ast.Store)
            and isinstance(item.value, ast.Name)
            and item.value.id == "self"
        ):
            names.add(item.attr)
    return names


def prose(source):
    """(line, text) of each comment and each triple-quoted string, `>>>` examples left out."""
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        is_docstring = token.type == tokenize.STRING and token.string.lstrip("rbuRBU").startswith(
            ('"""', "'''")
        )
        if token.type == tokenize.COMMENT or is_docstring:
            for offset, line in enumerate(token.string.splitlines()):
                if not line.strip().startswith((">>>", "...")):
                    yield token.start[0] + offset, line


def sources():
    return {path: path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}


def class_members(trees):
    """Each loopax class's name -> the members each class of that name has (all of them)."""
    assigned = {}  # (module, class name) -> names assigned in its body
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                assigned[module_name(path), node.name] = assigned_members(node)
    members = {}
    for module_path, name in assigned:
        cls = getattr(importlib.import_module(module_path), name, None)
        if not inspect.isclass(cls):  # a class defined inside a function
            members.setdefault(name, []).append(None)
            continue
        known = set(dir(cls))
        for base in cls.__mro__:
            known |= set(getattr(base, "__annotations__", {}))
            known |= assigned.get((base.__module__, base.__qualname__), set())
        members.setdefault(name, []).append(known)
    return members


def stale_names(texts):
    """`path:line: name` for each name in the prose of `texts` that its class does not have."""
    trees = {path: ast.parse(text) for path, text in texts.items()}
    members = class_members(trees)

    def exists(class_name, member):
        # A name several classes share (or one defined in a function) is checked leniently:
        # any of them having the member will do.
        return any(known is None or member in known for known in members[class_name])

    stale = []
    for path, tree in trees.items():
        lines = dict(prose(texts[path]))
        where = path.relative_to(PACKAGE.parent)
        for number, text in lines.items():
            for match in DOTTED.finditer(text):
                owner, member = match.groups()
                owner = INSTANCE_NAMES.get(owner, owner)
                if owner in members and not exists(owner, member):
                    stale.append(f"{where}:{number}: {match.group(0)}")
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            for number in range(node.lineno, (node.end_lineno or node.lineno) + 1):
                for match in re.finditer(
                    r"(?<![\w.])self\.(_{0,2}[A-Za-z]\w*)", lines.get(number, "")
                ):
                    if not exists(node.name, match.group(1)):
                        stale.append(f"{where}:{number}: {match.group(0)} (in {node.name})")
    return stale


def test_docstrings_and_comments_name_only_existing_members():
    stale = stale_names(sources())
    assert not stale, (
        "docstrings or comments name members that do not exist (renamed or removed?); "
        "name the member as it is now:\n" + "\n".join(stale)
    )


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("`Trainer._state` holds it", True),  # gone: the check must see it
        ("# trainer.not_a_member is read", True),
        ("`Trainer.global_step` and `loop.run_steps`", False),
        ("`Trainer.run_*` and `loopax.Trainer`", False),  # a glob and a module path
    ],
)
def test_the_check_sees_a_stale_name(text, found):
    probe = PACKAGE / "_stale_name_probe.py"  # not written: its text is given
    source = f"{text}\n" if text.startswith("#") else f'"""{text}"""\n'
    stale = stale_names({**sources(), probe: source})
    assert any("_stale_name_probe" in line for line in stale) is found, stale


@pytest.mark.parametrize(("member", "found"), [("_gone", True), ("limit", False)])
def test_the_check_sees_a_stale_self_name(member, found):
    path = PACKAGE / "trainer" / "_inflight.py"
    text = path.read_text()
    assert "class InFlight:\n" in text
    probed = text.replace("class InFlight:\n", f"class InFlight:\n    # self.{member} is read\n")
    stale = stale_names({**sources(), path: probed})
    assert any(f"self.{member} (in InFlight)" in line for line in stale) is found, stale
