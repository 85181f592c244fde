#!/usr/bin/env bash
# The device run of issue 33 in one go: the device benchmark and the accelerator-safe tests.
#
#   bash benchmarks/device_run.sh OUTDIR
#
# On a GPU machine (docs/benchmarks.md, "On a GPU", says how to run it with the device tool):
#   1. installs nothing beyond the project: the wheels carried in .whl/ (packages the machine
#      lacks), with pip --no-index into a folder of their own; loopax itself is read from
#      this checkout (PYTHONPATH);
#   2. runs `benchmarks/run_all.py --device` (sizes: full on an accelerator, small on the CPU)
#      into OUTDIR/benchmarks.txt (the table), benchmarks.log (progress) and device.json;
#   3. runs the suite's tests that need no simulated CPU devices (`pytest --accelerator`)
#      into OUTDIR/tests.txt and tests.xml;
#   4. prints a summary (also OUTDIR/summary.txt), with the flag sweep's verdicts.
# Every part has a time limit, so the whole run ends within DEVICE_RUN_SECONDS (default 360:
# 6 minutes). A part stopped at its limit is interrupted (SIGINT: the benchmark keeps the
# sections it printed, pytest reports the tests it ran), then killed if it lingers.
#
# Environment: PYTHON (default python3), DEVICE_RUN_SECONDS (360), DEVICE_RUN_BENCH_SECONDS
# (the benchmark's share, 290: tiny, fused and enqueue ~40 s, the flag sweep at most 90 s,
# digits ~25 s, the LM's sections and first-step the rest; the tests then get at least
# 360 - 290 - 15 = 55 s, and what the benchmark leaves), DEVICE_RUN_TESTS (pytest arguments
# choosing the tests; default the whole suite), DEVICE_RUN_WORKERS (pytest-xdist workers,
# default auto), DEVICE_RUN_ARGS (more run_all.py arguments, e.g. "--size small" or
# "--only tiny,fused").
set -u

if [ $# -ne 1 ]; then
    echo "usage: bash benchmarks/device_run.sh OUTDIR" >&2
    exit 2
fi
OUT=$1
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2

START=$(date +%s)
BUDGET=${DEVICE_RUN_SECONDS:-360}
BENCH_SHARE=${DEVICE_RUN_BENCH_SECONDS:-290}
PYTHON=${PYTHON:-python3}
MARGIN=15 # seconds kept for the summary and for a part that lingers after its signal
export PYTHONUNBUFFERED=1

left() { echo $((BUDGET - ($(date +%s) - START) - MARGIN)); }

# -- 1. packages the machine lacks, from carried wheels --------------------------------------
SITE=""
if compgen -G ".whl/*.whl" >/dev/null; then
    SITE=$(mktemp -d /tmp/loopax-site.XXXXXX)
    if timeout -k 5 60 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target "$SITE" .whl/*.whl >"$OUT/install.log" 2>&1; then
        echo "installed $(ls .whl/*.whl | wc -l) carried wheels" >>"$OUT/install.log"
    else
        echo "carried wheels failed to install: see install.log" | tee -a "$OUT/install.log"
    fi
fi
export PYTHONPATH="$ROOT${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"

{
    echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    echo "commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "cores: $(nproc)"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
    timeout 60 "$PYTHON" -c "import sys, jax; print('python', sys.version.split()[0]); print('jax', jax.__version__, jax.default_backend(), jax.devices())"
    timeout 60 "$PYTHON" -m pip list 2>/dev/null | grep -iE "^(jax|jaxlib|jax-cuda|flax|optax|orbax|tensorboard|numpy|tqdm|grain|mlflow|keras|pytest|scikit-learn) "
} >"$OUT/environment.txt" 2>&1

# -- 2. the device benchmark -----------------------------------------------------------------
limit=$(left)
[ "$limit" -gt "$BENCH_SHARE" ] && limit=$BENCH_SHARE
bench_started=$(date +%s)
# shellcheck disable=SC2086  # DEVICE_RUN_ARGS is a list of arguments
timeout -s INT -k 10 "$limit" "$PYTHON" benchmarks/run_all.py --device --json "$OUT/device.json" \
    ${DEVICE_RUN_ARGS:-} >"$OUT/benchmarks.txt" 2>"$OUT/benchmarks.log"
bench_status=$?
bench_seconds=$(($(date +%s) - bench_started))

# -- 3. the tests that need no simulated CPU devices -----------------------------------------
limit=$(left)
tests_status=125
tests_seconds=0
if [ "$limit" -gt 20 ]; then
    options=()
    "$PYTHON" -c "import pytest_timeout" 2>/dev/null && options+=(--timeout=120)
    tests_started=$(date +%s)
    # shellcheck disable=SC2086  # DEVICE_RUN_TESTS is a list of arguments
    # -vv: one line a test (pyproject's addopts has -q), kept in tests.txt even if killed.
    timeout -s INT -k 10 "$limit" "$PYTHON" -m pytest --accelerator -p no:cacheprovider \
        -n "${DEVICE_RUN_WORKERS:-auto}" -vv -rfE --junitxml "$OUT/tests.xml" "${options[@]}" \
        ${DEVICE_RUN_TESTS:-} >"$OUT/tests.txt" 2>&1
    tests_status=$?
    tests_seconds=$(($(date +%s) - tests_started))
fi

# -- 4. summary ------------------------------------------------------------------------------
status_text() {
    case $1 in
    0) echo "done" ;;
    124 | 130 | 137) echo "stopped at its time limit (exit $1)" ;;
    125) echo "not run: no time left" ;;
    *) echo "exit $1" ;;
    esac
}
{
    echo "device run: $(($(date +%s) - START)) s in all (limit $BUDGET s), outputs in $OUT"
    grep -m1 "^device:" "$OUT/benchmarks.txt" || true
    echo
    echo "benchmark: $bench_seconds s, $(status_text $bench_status)"
    grep -E "PASS|FAIL|n/a|programs built during|examples/s|dispatches queued|verdict " "$OUT/benchmarks.txt" |
        sed -E 's/^ +/  /; s/ {3,}/  /g' || true
    echo
    echo "tests (pytest --accelerator): $tests_seconds s, $(status_text $tests_status)"
    if [ -f "$OUT/tests.txt" ]; then
        for outcome in PASSED FAILED ERROR SKIPPED XFAIL; do
            # `-v` lines: "[gw0] [ 3%] PASSED tests/a.py::b" (xdist), "tests/a.py::b PASSED" (-n 0)
            count=$(grep -cE "^\[gw[0-9]+\] .*\] $outcome |::[^ ]* $outcome( |$)" "$OUT/tests.txt")
            printf '  %s %s\n' "$count" "$outcome"
        done
        grep -E "^(FAILED|ERROR) " "$OUT/tests.txt" | head -40 | sed 's/^/  /'
        tail -n 1 "$OUT/tests.txt" | sed 's/^/  /'
    fi
} | tee "$OUT/summary.txt"
