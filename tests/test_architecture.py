"""The house rules of ARCHITECTURE.md, checked on the source: the floors (which package may
import which), classes composed of members rather than assembled from mixins, no reach into
another object's private attributes, modules of at most 400 lines of code, and the public
names and deprecated import paths users rely on."""

import ast
import importlib
import io
import pathlib
import sys
import tokenize
import warnings

import pytest

import loopax

PACKAGE = pathlib.Path(loopax.__file__).parent

# Lower floors first: a package imports only from floors below its own (and from itself).
FLOORS = {
    "_devices": 0,
    "_validate": 0,
    "_public": 0,
    "_compilation_cache": 0,
    "_distributed": 0,
    "_warnings": 0,
    "metrics": 1,
    "losses": 1,
    "optimizers": 1,
    "testing": 1,
    "data": 2,
    "trainer": 3,
    "loop": 4,
    "hooks": 5,
    "_params": 6,
    "__init__": 7,
}
# Names a namedtuple or a frozen dataclass offers with a leading underscore, and the
# interpreter's own that loopax calls on purpose.
ALLOWED_PRIVATE = {"_replace", "_asdict", "_fields", "_make", "_exit", "_getframe"}
# Lines of code: docstrings, comments and blank lines do not count, so documenting a module
# never forces a split; growing its code past this does (by responsibility, never mixins).
MAX_CODE_LINES = 400


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def room_of(path):
    """The top-level package or module of loopax that `path` belongs to."""
    parts = path.relative_to(PACKAGE).parts
    return parts[0].removesuffix(".py")


def imported_rooms(path, tree):
    """(line, room) for each import of another part of loopax, TYPE_CHECKING ones included."""
    depth = len(path.relative_to(PACKAGE).parts) - 1  # folders below loopax/
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                up = node.level - 1
                if up > depth:
                    continue
                if up < depth:  # inside the importer's own room
                    continue
                target = (node.module or "").split(".")[0]
                names = [alias.name for alias in node.names] if not node.module else [target]
                for name in names:
                    yield node.lineno, name
            elif node.module and node.module.split(".")[0] == "loopax":
                parts = node.module.split(".")
                names = [alias.name for alias in node.names] if len(parts) == 1 else [parts[1]]
                for name in names:
                    yield node.lineno, name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "loopax" and len(parts) > 1:
                    yield node.lineno, parts[1]


def test_every_room_has_a_floor():
    rooms = {room_of(path) for path, _ in modules()}
    assert rooms <= set(FLOORS), f"rooms without a floor in this test: {rooms - set(FLOORS)}"


def test_packages_import_only_from_lower_floors():
    upward = []
    for path, tree in modules():
        room = room_of(path)
        for line, target in imported_rooms(path, tree):
            if target in FLOORS and target != room and FLOORS[target] >= FLOORS[room]:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports loopax.{target}")
    assert not upward, "imports against the floors:\n" + "\n".join(upward)


def loopax_classes():
    classes = {}
    for path, tree in modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append((path, node))
    return classes


def test_no_class_is_assembled_from_loopax_mixins():
    classes = loopax_classes()
    assembled = []
    for name, places in classes.items():
        for path, node in places:
            own = [ast.unparse(b) for b in node.bases if ast.unparse(b).split(".")[-1] in classes]
            if len(own) >= 2 or (own and len(node.bases) >= 2):
                assembled.append(f"{name} ({path.relative_to(PACKAGE.parent)}) from {own}")
    assert not assembled, "classes assembled from mixins:\n" + "\n".join(assembled)


@pytest.mark.parametrize("cls", [loopax.Loop, loopax.Trainer])
def test_loop_and_trainer_have_no_loopax_base_class(cls):
    bases = [base for base in cls.__mro__[1:] if base.__module__.startswith("loopax")]
    assert bases == []


def test_loop_trainer_and_array_dataset_live_in_their_own_rooms():
    assert loopax.Loop.__module__.startswith("loopax.loop.")
    assert loopax.Trainer.__module__.startswith("loopax.trainer.")
    assert loopax.ArrayDataset.__module__.startswith("loopax.data.")


def test_no_reach_into_another_objects_private_attributes():
    reach = []
    for path, tree in modules():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            name = node.attr
            if not name.startswith("_") or name.startswith("__") or name in ALLOWED_PRIVATE:
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and getattr(owner.func, "id", "") == "super":
                continue
            if isinstance(owner, ast.Name) and owner.id in ("sys", "os", "threading"):
                continue  # the interpreter's own, e.g. sys._getframe
            reach.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {ast.unparse(node)}")
    assert not reach, "private attributes of other objects:\n" + "\n".join(reach)


# Writes of another object's attributes that are no member steering another, each with why
# (`path: target` as `ast.unparse` shows the target). Anything else gives the owner a method:
# a reader of one class then sees every change to its state.
FOREIGN_WRITES = {
    # A record its writer creates and keeps, the field documented as that writer's cache.
    "loopax/loop/_hook_registry.py: hook.next",
    "loopax/trainer/_executors.py: executor.key",
    "loopax/trainer/_executors.py: executor.hits",
    "loopax/trainer/_programs.py: executor.run",
    "loopax/trainer/_host_metrics.py: waiting.computed",
    # Public attributes and setters documented for this writer (API.md): a checkpoint hook
    # notes the step it saved; a hook that restores a state sets `Trainer.state`.
    "loopax/hooks/_checkpointing/_checkpointer.py: self.loop.checkpointed_step",
    "loopax/hooks/_early_stopping.py: trainer.state",
    "loopax/hooks/_lr_checks.py: trainer.state",
    # The constructor helper every metric calls on itself; a metric's host state, updated in
    # place by the `update_host` contract, and numpy's generator state it restores.
    "loopax/metrics/_base.py: metric.name",
    "loopax/metrics/_base.py: metric.short_name",
    "loopax/metrics/_base.py: metric.metric_type",
    "loopax/metrics/_median.py: state.count",
    "loopax/metrics/_median.py: state.seen",
    "loopax/metrics/_median.py: state.rng.bit_generator.state",
    # Other libraries' objects, set as those libraries document: tqdm's bar, ctypes' foreign
    # function signature, a flax variable's value.
    "loopax/hooks/_progress.py: self._bar_class.status",
    "loopax/hooks/_progress.py: bar.n",
    "loopax/hooks/_progress.py: bar.total",
    "loopax/hooks/_progress.py: bar.bar_format",
    "loopax/hooks/_progress.py: bar.status",
    "loopax/loop/_lost_process.py: libc.signal.restype",
    "loopax/loop/_lost_process.py: libc.signal.argtypes",
    "loopax/trainer/_context.py: self._variable.value",
    # `PlacedState.state` is a property: the write runs the placed state's own setter, which
    # places the new state and its step itself.
    "loopax/trainer/_creation.py: self._placed.state",
    "loopax/trainer/_trainer.py: self._placed.state",
}


def foreign_attribute_writes(tree):
    """(line, target) for each assignment to an attribute of an object other than `self` or
    `cls` (`x.a = v`, `self.member.a = v`, `x.a += v`, `x.a: T = v`, unpacked, `del x.a`).
    Dunders (`f.__name__`, `error.__cause__`) are the interpreter's metadata, not state."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        while targets:
            target = targets.pop()
            if isinstance(target, (ast.Tuple, ast.List)):
                targets.extend(target.elts)
                continue
            if isinstance(target, ast.Starred):
                target = target.value
            if not isinstance(target, ast.Attribute) or target.attr.startswith("__"):
                continue
            owner = target.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            yield node.lineno, ast.unparse(target)


def test_the_write_rule_sees_each_form_of_write():
    # The checker below must see each form an attribute write takes, or it passes on anything.
    text = (
        "self.a = 1\n"
        "cls.b = 2\n"
        "self.hooks.halted = True\n"
        "hooks.halted = False\n"
        "self.x, loop.y = 1, 2\n"
        "first, *other.rest = items\n"
        "count.value += 1\n"
        "record.field: int = 3\n"
        "del state.entry\n"
        "f.__name__ = 'g'\n"
        "items[0] = 1\n"
    )
    found = [target for _, target in foreign_attribute_writes(ast.parse(text))]
    assert sorted(found) == sorted(
        [
            "self.hooks.halted",
            "hooks.halted",
            "loop.y",
            "other.rest",
            "count.value",
            "record.field",
            "state.entry",
        ]
    )


def test_no_object_writes_another_objects_attributes():
    # Members change their own state through their own methods (issue 36): the registry's
    # `halted` is set by `HookRegistry.halt`, not by the runner that decides to halt.
    writes = []
    seen = set()
    for path, tree in modules():
        where = str(path.relative_to(PACKAGE.parent))
        for line, target in foreign_attribute_writes(tree):
            seen.add(f"{where}: {target}")
            if f"{where}: {target}" not in FOREIGN_WRITES:
                writes.append(f"{where}:{line} {target}")
    assert not writes, (
        "attributes of other objects written (give the owner a method, or add the write to "
        "FOREIGN_WRITES with why it is no steering):\n" + "\n".join(writes)
    )
    stale = FOREIGN_WRITES - seen
    assert not stale, "FOREIGN_WRITES lists writes no module makes now: " + ", ".join(sorted(stale))


def code_lines(text, tree):
    """How many lines hold code: not docstrings, comments or blank lines."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    docstrings.update(range(first.lineno, (first.end_lineno or 0) + 1))
    skipped = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type not in skipped and token.type != tokenize.ENDMARKER:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstrings)


def test_code_lines_counts_code_alone():
    text = '"""Module doc."""\n\n# a comment\ndef f(x):\n    """Doc\n    on two lines."""\n'
    text += "    return (x +\n            1)  # why\n"
    assert code_lines(text, ast.parse(text)) == 3


def test_no_module_is_over_400_lines_of_code():
    long = {
        str(path.relative_to(PACKAGE.parent)): count
        for path, tree in modules()
        if (count := code_lines(path.read_text(), tree)) > MAX_CODE_LINES
    }
    assert not long, (
        f"modules over {MAX_CODE_LINES} lines of code (split by responsibility): {long}"
    )


def test_import_loopax_stays_light():
    # Checkpoints and TensorBoard load with the hooks that need them, not with `import loopax`.
    code = (
        "import sys, loopax\n"
        "heavy = [m for m in ('orbax.checkpoint', 'tensorboard') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    import subprocess

    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("name", "home"),
    [
        ("Loop", "loopax.loop"),
        ("History", "loopax.loop"),
        ("Hook", "loopax.loop"),
        ("HookError", "loopax.loop"),
        ("Priority", "loopax.loop"),
        ("Schedule", "loopax.loop"),
        ("Evaluation", "loopax.loop"),
        ("NonFiniteLossError", "loopax.loop"),
        ("ArrayDataset", "loopax.data"),
        ("Dataset", "loopax.data"),
        ("IterableDataset", "loopax.data"),
    ],
)
def test_old_import_paths_still_work_with_a_deprecation_warning(name, home):
    trainer_package = importlib.import_module("loopax.trainer")
    with pytest.warns(DeprecationWarning, match=rf"loopax\.trainer\.{name} moved to {home}"):
        moved = getattr(trainer_package, name)
    assert moved is getattr(loopax, name) is getattr(importlib.import_module(home), name)


def test_unknown_names_of_the_trainer_package_still_raise():
    trainer_package = importlib.import_module("loopax.trainer")
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        trainer_package.Nothing  # noqa: B018


@pytest.mark.parametrize(
    "package", ["loopax", "loopax.loop", "loopax.data", "loopax.trainer", "loopax.hooks"]
)
def test_every_public_name_resolves_without_warnings(package):
    module = importlib.import_module(package)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in module.__all__:
            assert getattr(module, name) is not None, name
    assert list(module.__all__) == sorted(module.__all__)


def test_only_one_module_reads_jax_private_state():
    # JAX's private modules change without notice: loopax reads them in one place.
    readers = []
    for path, tree in modules():
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            if any(name == "jax._src" or name.startswith("jax._src.") for name in names):
                readers.append(str(path.relative_to(PACKAGE.parent)))
    assert set(readers) == {"loopax/_distributed.py"}, readers


def module_name(path):
    """The dotted name of the loopax module at `path` (a package's is its `__init__`'s)."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path, tree):
    """(line, dotted name) of each loopax module `path` imports, TYPE_CHECKING and
    function-level imports included; `from package import module` names the module."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = (node.module or "").split(".") if node.module else []
            if node.level:
                base = package[: len(package) - (node.level - 1)] + base
            if not base or base[0] != "loopax":
                continue
            for alias in node.names:
                below = ".".join([*base, alias.name])
                is_module = (PACKAGE.parent / below.replace(".", "/")).with_suffix(".py").exists()
                is_package = (PACKAGE.parent / below.replace(".", "/") / "__init__.py").exists()
                yield node.lineno, below if is_module or is_package else ".".join(base)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "loopax":
                    yield node.lineno, alias.name


def test_packages_share_private_helpers_only_through_their_internal_seam():
    # Another package's private modules are its own business: what it shares with the floors
    # above goes through its public `__init__` or its one `_internal` module, so a change to a
    # shared helper shows whom it touches. The floor-0 modules (loopax/_validate.py, ...) are
    # shared by all and imported directly.
    floor_0 = {room for room, floor in FLOORS.items() if floor == 0}
    reach = []
    for path, tree in modules():
        room = room_of(path)
        for line, target in imported_modules(path, tree):
            parts = target.split(".")
            if len(parts) < 2 or parts[1] == room or parts[1] in floor_0:
                continue
            if parts[2:] in ([], ["_internal"]):
                continue
            reach.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}")
    assert not reach, "private modules of another package (use its _internal):\n" + "\n".join(reach)


def test_the_seam_rule_sees_private_imports():
    # The checker above must see each form a private import takes, or it passes on anything.
    text = (
        "from ..data._datasets import as_list\n"
        "from ..data import _reader\n"
        "import loopax.trainer._state\n"
        "def f():\n    from ..trainer._steps import SKIPPED_STEPS\n"
        "from ..data._internal import as_list\n"
        "from ..data import Dataset\n"
        "from .. import _validate\n"
    )
    path = PACKAGE / "loop" / "_example.py"
    found = [target for _, target in imported_modules(path, ast.parse(text))]
    assert found == [
        "loopax.data._datasets",
        "loopax.data._reader",
        "loopax.trainer._state",
        "loopax.data._internal",
        "loopax.data",
        "loopax._validate",
        "loopax.trainer._steps",
    ]


def import_cycles(graph):
    """The cycles of `graph` ({module: {imported module, ...}}), each as a sorted list: its
    strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []

    def visit(module):
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in sorted(graph.get(module, ())):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def test_import_cycles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}}
    assert import_cycles(graph) == [["a", "b", "c"], ["e", "f"]]
    assert import_cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_no_import_cycle_among_loopax_modules():
    # A cycle hidden in a function-level or TYPE_CHECKING import is still two modules that
    # cannot be understood (or moved) one without the other: the shared piece belongs in a
    # module both import.
    graph, edges = {}, {}
    for path, tree in modules():
        importer = module_name(path)
        for line, target in imported_modules(path, tree):
            if target != importer:
                graph.setdefault(importer, set()).add(target)
                edges.setdefault((importer, target), line)
    cycles = import_cycles(graph)
    shown = []
    for cycle in cycles:
        inside = [
            f"{a}:{line} imports {b}"
            for (a, b), line in sorted(edges.items())
            if a in cycle and b in cycle
        ]
        shown.append(f"{', '.join(cycle)}: {'; '.join(inside)}")
    assert not cycles, "import cycles among loopax's modules:\n" + "\n".join(shown)


# Fields that one member owns and changes through its own methods only; other objects read
# them (the Programs run a step and hand its state to `PlacedState.advance`; a `StepBuilder`
# keeps what its traces saw).
OWNED_FIELDS = {
    "device_state",
    "global_step",
    "aux_names",
    "aux_traced",
    "traced_prediction_shapes",
}


def stores_into_others(tree, fields):
    """(line, target) of each store into one of `fields` of an object other than `self`."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and node.attr in fields
            and not (isinstance(node.value, ast.Name) and node.value.id == "self")
        ):
            yield node.lineno, ast.unparse(node)


def test_owned_fields_are_written_only_by_their_owner():
    stores = [
        f"{path.relative_to(PACKAGE.parent)}:{line} {target}"
        for path, tree in modules()
        for line, target in stores_into_others(tree, OWNED_FIELDS)
    ]
    assert not stores, "another object's owned field written:\n" + "\n".join(stores)


def test_the_owned_field_rule_sees_each_store():
    text = (
        "placed.global_step += 1\n"
        "self._placed.device_state, values = run()\n"
        "self.global_step = 0\n"
        "steps = placed.global_step\n"
        "self.device_state: int = 0\n"
    )
    found = sorted(target for _, target in stores_into_others(ast.parse(text), OWNED_FIELDS))
    assert found == ["placed.global_step", "self._placed.device_state"]
