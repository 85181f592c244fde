"""A pytest plugin that counts XLA compilations and their seconds per test file (not a test file).

Over half of the suite's CPU is XLA compiling; this tells where. Run the tests with it, then
print the table it wrote, heaviest file first:

    PYTHONPATH=tests COMPILE_CENSUS=/tmp/census.jsonl python -m pytest -p compile_census ...
    python tests/compile_census.py /tmp/census.jsonl  # --programs: which programs compiled

Each test process (each xdist worker, or the one process of `-n 0`) appends one JSON line:
per file and per test, the programs handed to XLA (`compiles`), how many of them loaded from
the run's persistent compilation cache (`cache_hits`, tests/conftest.py) rather than
compiling, the seconds of each kind (`miss_s` compiling, `hit_s` loading), and the seconds
spent tracing and lowering to XLA (`trace_s`, `lower_s`). Processes that a test starts are
not counted. JAX is imported at `pytest_configure`, after tests/conftest.py set up the run's
cache: a plugin that imports it on loading leaves JAX without it (and loopax then turns on
its per-user cache, whose programs from earlier runs would count as hits).
"""

import collections
import json
import os
import sys
import time

import pytest

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # compiled or loaded
CACHE_HIT = "/jax/compilation_cache/cache_hits"  # recorded just before its BACKEND_COMPILE
TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"

_now = ["<collection>"]  # the test running (its node id)
_hit = [False]
_tests = collections.defaultdict(lambda: collections.defaultdict(float))
_compiled = collections.defaultdict(list)  # test: names of the programs compiled (not loaded)


def _on_duration(event, seconds, **kwargs):
    counts = _tests[_now[0]]
    if event == BACKEND_COMPILE:
        counts["compiles"] += 1
        counts["hit_s" if _hit[0] else "miss_s"] += seconds
        if not _hit[0]:
            _compiled[_now[0]].append(str(kwargs.get("fun_name", "?")))
        _hit[0] = False
    elif event == TRACE:
        counts["trace_s"] += seconds
    elif event == LOWER:
        counts["lower_s"] += seconds


def _on_event(event, **kwargs):
    if event == CACHE_HIT:
        _tests[_now[0]]["cache_hits"] += 1
        _hit[0] = True


def pytest_configure(config):
    import jax  # noqa: PLC0415  (only now: see the module's docstring)

    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    jax.monitoring.register_event_listener(_on_event)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _now[0] = item.nodeid
    start = time.perf_counter()
    yield
    _tests[item.nodeid]["wall_s"] += time.perf_counter() - start
    _now[0] = "<between tests>"


def pytest_sessionfinish(session, exitstatus):
    if not _tests:
        return  # the xdist controller runs no test
    path = os.environ.get("COMPILE_CENSUS", "compile-census.jsonl")
    with open(path, "a") as out:
        out.write(json.dumps({"tests": _tests, "compiled": _compiled}) + "\n")


def by_file(paths):
    """{file: totals} over every line of the census files at `paths`."""
    files = collections.defaultdict(collections.Counter)
    for path in paths:
        with open(path) as lines:
            for line in lines:
                for test, counts in json.loads(line)["tests"].items():
                    files[test.split("::")[0]].update(counts)
    return files


def compiled_by_file(paths):
    """{file: Counter of the names of the programs compiled} over the census files."""
    files = collections.defaultdict(collections.Counter)
    for path in paths:
        with open(path) as lines:
            for line in lines:
                for test, names in json.loads(line).get("compiled", {}).items():
                    files[test.split("::")[0]].update(names)
    return files


def main(arguments):
    """Prints the table of the census files named; with `--programs`, what each compiled."""
    programs = "--programs" in arguments
    paths = [argument for argument in arguments if argument != "--programs"]
    files = by_file(paths)
    columns = ("compiles", "cache_hits", "miss_s", "hit_s", "trace_s", "lower_s", "wall_s")
    print(f"{'file':58}" + "".join(f"{name:>11}" for name in columns))
    total = collections.Counter()
    for name, counts in sorted(files.items(), key=lambda item: -item[1]["miss_s"]):
        total.update(counts)
        print(f"{name:58}" + "".join(f"{counts[column]:11.1f}" for column in columns))
    print(f"{'total':58}" + "".join(f"{total[column]:11.1f}" for column in columns))
    if programs:
        for name, names in sorted(compiled_by_file(paths).items()):
            listed = ", ".join(f"{count} {program}" for program, count in names.most_common())
            print(f"{name}: {listed}")


if __name__ == "__main__":
    main(sys.argv[1:])
