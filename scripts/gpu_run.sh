#!/usr/bin/env bash
# The one script to run on the GPU machine, from anywhere in the repo: `bash scripts/gpu_run.sh`.
#
# Installs nothing. Puts the repo (and .whl/site, where gemlite is carried, when present) on
# PYTHONPATH, prints the GPU and versions, runs the GPU tests (`pytest -m gpu`), then the W4A16
# benchmark, and prints the benchmark's table and TARGETS block last. Everything is teed into $OUT
# as it happens, so a run cut off by a time limit still returns its logs. Files left in $OUT (<= 8):
#   gpu_run.log            everything below, in order
#   pytest_gpu.log         pytest's output          pytest_gpu.xml   its junit XML
#   bench_int_weight.log   the benchmark's output   bench_int_weight.json, bench_int_weight.txt (table)
#
# Environment:
#   QOPS_GPU_TESTS=0        skip the tests
#   QOPS_BENCH=0            skip the benchmark
#   QOPS_BENCH_ARGS="..."   extra arguments for benchmarks/bench_int_weight.py (e.g. "--quick")
#   QOPS_TEST_TIMEOUT=150   seconds before the tests are killed (coreutils timeout; no pytest-timeout needed)
#   QOPS_BENCH_TIMEOUT=400  seconds before the benchmark is killed (its JSON is rewritten after every shape)
#   QOPS_COMMIT=<sha>       recorded in the JSON when git is not available here
#   PYTHON=python3          the interpreter
#   OUT=<dir>               where files go (default: ./gpu_out)
set -u -o pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
export OUT=${OUT:-$ROOT/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
if [ -d "$ROOT/.whl/site" ]; then
    export PYTHONPATH=$PYTHONPATH:$ROOT/.whl/site
fi
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
TEST_TIMEOUT=${QOPS_TEST_TIMEOUT:-150}
BENCH_TIMEOUT=${QOPS_BENCH_TIMEOUT:-400}
LOG=$OUT/gpu_run.log
: > "$LOG"

# with_timeout SECONDS CMD...: coreutils timeout when there is one (rc 124/137 when it fires).
with_timeout() {
    local s=$1; shift
    if command -v timeout >/dev/null 2>&1; then
        timeout -k 10 "$s" "$@"
    else
        "$@"
    fi
}

main() {
    local t0=$SECONDS test_rc=skipped bench_rc=skipped
    echo "== gpu_run.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) in $ROOT"
    echo "PYTHONPATH=$PYTHONPATH"
    nvidia-smi -L 2>&1 || echo "nvidia-smi not available"
    "$PY" - <<'EOF' 2>&1
import sys, torch
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(), "sm_%d%d" % torch.cuda.get_device_capability())
try:
    import triton; print("triton", triton.__version__)
except Exception as e:
    print("triton not importable:", e)
try:
    import importlib.util as u
    spec = u.find_spec("gemlite")
    print("gemlite at", spec.origin if spec else None, "(imported by the benchmark)")
except Exception as e:
    print("gemlite lookup failed:", e)
EOF
    with_timeout 60 "$PY" -m qops info 2>&1 || echo "python -m qops info failed (rc=$?)"

    if [ "${QOPS_GPU_TESTS:-1}" != "0" ]; then
        echo
        echo "== pytest -m gpu (timeout ${TEST_TIMEOUT}s)"
        with_timeout "$TEST_TIMEOUT" "$PY" -m pytest -m gpu -q -x -p no:cacheprovider \
            --junitxml="$OUT/pytest_gpu.xml" 2>&1 | tee "$OUT/pytest_gpu.log"
        test_rc=${PIPESTATUS[0]}
        case $test_rc in
            0) echo "tests: passed" ;;
            5) echo "tests: none collected (rc=5)" ;;
            124|137) echo "tests: killed after ${TEST_TIMEOUT}s (rc=$test_rc)" ;;
            *) echo "tests: FAILED (rc=$test_rc)" ;;
        esac
    fi

    if [ "${QOPS_BENCH:-1}" != "0" ]; then
        echo
        echo "== benchmarks/bench_int_weight.py ${QOPS_BENCH_ARGS:-} (timeout ${BENCH_TIMEOUT}s)"
        # shellcheck disable=SC2086  # QOPS_BENCH_ARGS is split on purpose
        with_timeout "$BENCH_TIMEOUT" "$PY" benchmarks/bench_int_weight.py ${QOPS_BENCH_ARGS:-} \
            2>&1 | tee "$OUT/bench_int_weight.log"
        bench_rc=${PIPESTATUS[0]}
    fi

    echo
    echo "== summary: tests rc=$test_rc, bench rc=$bench_rc, $((SECONDS - t0))s; files in \$OUT:"
    ls -la "$OUT"
    local n
    n=$(find "$OUT" -type f | wc -l)
    [ "$n" -le 8 ] || echo "WARNING: $n files in \$OUT; only 8 come back"
    # The table and TARGETS last, so they sit at the end of the output.
    if [ -s "$OUT/bench_int_weight.txt" ]; then
        cat "$OUT/bench_int_weight.txt"
    elif [ "$bench_rc" != skipped ]; then
        echo "(benchmark wrote no table: see the tail of bench_int_weight.log)"
    fi
    [ "$test_rc" = 0 ] || [ "$test_rc" = 5 ] || [ "$test_rc" = skipped ] || return 1
    [ "$bench_rc" = 0 ] || [ "$bench_rc" = skipped ] || return 1
    return 0
}

main 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
