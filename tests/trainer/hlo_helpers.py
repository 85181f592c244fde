"""Reading a compiled program's optimized HLO (`compiled.as_text()`) in tests: its loops."""

import re

LOOP = re.compile(r" while\(.*?\), condition=%[\w.\-]+, body=%([\w.\-]+)(.*)")


def computation(text, name):
    """The lines of computation `name` of an HLO module's text (its header left out)."""
    start = text.index(f"\n%{name} ") + 1
    return text[start : text.index("\n}\n", start)].splitlines()[1:]


def gathers(text, line):
    """Whether an op is a gather or a fusion of one."""
    called = re.search(r"calls=%([\w.\-]+)", line)
    if called is None:
        return " gather(" in line
    return any(" gather(" in inner for inner in computation(text, called.group(1)))


def loop_bodies(text, rows=None):
    """Per `while` of a compiled module: its body's op counts, and its known trip count.

    Counted: the ops that compute (not parameters, tuples, their elements or constants),
    the fusions among them, the gathers (a fusion counts when it fuses one), the copies of
    an array of `rows` rows (e.g. a whole dataset's, when given), and whether XLA knows
    the trip count (`known_trip_count` in the loop's backend config).
    """
    bodies = []
    for match in LOOP.finditer(text):
        ops = [
            line
            for line in computation(text, match.group(1))
            if " = " in line
            and not re.search(r" (parameter|get-tuple-element|tuple|constant)\(", line)
        ]
        bodies.append(
            {
                "instructions": len(ops),
                "fusions": sum(" fusion(" in line for line in ops),
                "gathers": sum(gathers(text, line) for line in ops),
                "whole-array copies": sum(
                    rows is not None and " copy(" in line and f"[{rows}," in line for line in ops
                ),
                "known trip count": "known_trip_count" in match.group(2),
            }
        )
    return bodies


def entry_gathers(text):
    """The gathers of a compiled module's entry computation (outside its loops).

    One per gather op or fusion of one: the lines of the gather's own computation (the
    fusion's, or the op's line alone), so a test can read what is computed around it.
    """
    entry = text.index("\nENTRY ")
    lines = text[entry : text.index("\n}\n", entry)].splitlines()[1:]
    found = []
    for line in lines:
        if not gathers(text, line):
            continue
        called = re.search(r"calls=%([\w.\-]+)", line)
        found.append([line] if called is None else computation(text, called.group(1)))
    return found


def computes_on_vectors(lines, op):
    """Whether any of `lines` is an `op` (e.g. "select", "compare") on more than a scalar."""
    return any(re.search(rf" = \w+\[\d[\d,]*\]\S* {op}\(", line) for line in lines)
