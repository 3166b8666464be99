#!/usr/bin/env bash
# The one script to run on the GPU machine, from anywhere in the repo: `bash scripts/gpu_run.sh`.
#
# Installs nothing. Puts the repo (and .whl/site, where gemlite is carried, when present) on
# PYTHONPATH, prints the GPU and versions, runs the W4A16 benchmark first (the results file that
# matters most), then the GPU tests (`pytest -m gpu tests/gpu`), then the fp8 and int8/NF4
# benchmarks, and prints the W4A16 table and TARGETS block last. Everything is teed into $OUT as it
# happens, so a run cut off by a time limit still returns what it did. On a one-GPU machine the
# tensor-parallel tests skip by design (tests/gpu/test_gpu_tp.py and test_gpu_model.py's TP tests need
# 2 GPUs, test_gpu_tp_wide.py 4 or 8): a green run there has not checked tensor parallelism.
# Files in $OUT (<= 8):
#   gpu_run.log (everything, in order), pytest_gpu.xml, bench_int_weight.json, bench_int_weight.txt,
#   bench_fp8.json, bench_bnb_int8.json, bench_decode.json, sweep_native.json, probe_layout_bw.json, profile_decode.json,
#   bench_fp8_sweep.json, nvrtc-builds.jsonl (only 8 come back from one device call: choose the steps per call)
#
# Environment:
#   QOPS_STEPS=a,b,...      the steps to run, in this order: sweep_native, profile_decode, probe_layout_bw, bench_int_weight,
#                           pytest_gpu, bench_fp8, bench_bnb_int8, bench_decode, bench_fp8_sweep
#                           (default: bench_int_weight, pytest_gpu, bench_fp8, bench_bnb_int8, bench_decode)
#   QOPS_TESTS="..."        what pytest_gpu runs (default: tests/gpu); QOPS_JUNIT names its XML (pytest_gpu.xml).
#                           The tests get SIGINT at the timeout, so pytest still writes the XML of what ran.
#   QOPS_BENCH_ARGS="..."   extra arguments for benchmarks/bench_int_weight.py (e.g. "--quick")
#   QOPS_PROFILE_ARGS="..." arguments for benchmarks/profile_decode.py (e.g. "--variants w4:sdpa,w4:matmul");
#                           QOPS_PROFILE_TIMEOUT=480 its time limit
#   QOPS_TEST_JOBS=N        (without QOPS_TESTS) run the suite as scripts/gpu_test_groups.txt's groups, N pytest
#                           processes at once, their XMLs merged into one (the suite is mostly host-side compiles);
#                           QOPS_TEST_GROUPS=<file> another groups file
#   QOPS_TEST_TIMEOUT=600   seconds before the tests are killed (coreutils timeout; no pytest-timeout needed)
#   QOPS_BENCH_TIMEOUT=240  seconds before the W4A16 benchmark is killed (its JSON is rewritten after every shape)
#   QOPS_FAMILY_BENCH_TIMEOUT=90  the same for each of the fp8 and int8/NF4 benchmarks
#   QOPS_DECODE_TIMEOUT=300 the same for the end-to-end decode benchmark; QOPS_DECODE_ARGS="..." its extra arguments
#   QOPS_SWEEP_TIMEOUT=300  the same for the native launch-plan sweep (benchmarks/sweep_native.py)
#   QOPS_COMMIT=<sha>       recorded in the JSON when git is not available here
#   QOPS_CACHE_DIR=<dir>    the NVRTC cache (default: .nvrtc-cache in the repo, so a carried copy is used);
#                           QOPS_RETURN_CACHE=1 also packs it into $OUT/nvrtc-cache.tgz (bring it back into
#                           the repo's .nvrtc-cache and carry it: the next cold machine skips the compiles)
#   QOPS_NVRTC_RECORD=<file> where every native build the run loads is recorded (default $OUT/nvrtc-builds.jsonl):
#                           commit it, and benchmarks/prefill_nvrtc_cache.py fills a cache from it on a CPU box
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
export QOPS_CACHE_DIR=${QOPS_CACHE_DIR:-$ROOT/.nvrtc-cache}
export QOPS_NVRTC_RECORD=${QOPS_NVRTC_RECORD:-$OUT/nvrtc-builds.jsonl}
PY=${PYTHON:-python3}
TEST_TIMEOUT=${QOPS_TEST_TIMEOUT:-600}
BENCH_TIMEOUT=${QOPS_BENCH_TIMEOUT:-240}
FAMILY_TIMEOUT=${QOPS_FAMILY_BENCH_TIMEOUT:-90}
DECODE_TIMEOUT=${QOPS_DECODE_TIMEOUT:-300}
SWEEP_TIMEOUT=${QOPS_SWEEP_TIMEOUT:-300}
LOG=$OUT/gpu_run.log
: > "$LOG"

# with_timeout SECONDS CMD...: coreutils timeout when there is one (rc 124/137 when it fires).
with_timeout() {
    local s=$1; shift
    if command -v timeout >/dev/null 2>&1; then
        timeout -s "${TIMEOUT_SIGNAL:-TERM}" -k 20 "$s" "$@"
    else
        "$@"
    fi
}

# pytest_groups JOBS TIMEOUT XML: the GPU suite as the groups of scripts/gpu_test_groups.txt (or $QOPS_TEST_GROUPS), JOBS
# pytest processes at once (each SIGINTed at TIMEOUT, so it still writes its XML); each group's log
# tail is printed when it ends and the XMLs are merged into XML. Fails if a group
# failed or its XML is missing.
pytest_groups() {
    local jobs=$1 s=$2 xml=$3 work i=0 line rc=0 running=0
    work=$(mktemp -d)
    local -a xmls=()
    while IFS= read -r line; do
        case "$line" in ''|'#'*) continue ;; esac
        i=$((i + 1))
        xmls+=("$work/group-$i.xml")
        if [ "$running" -ge "$jobs" ]; then wait -n || rc=1; running=$((running - 1)); fi
        (
            eval "set -- $line"
            TIMEOUT_SIGNAL=INT with_timeout "$s" "$PY" -m pytest -m gpu "$@" -q -rfE -p no:cacheprovider \
                --junitxml="$work/group-$i.xml" > "$work/group-$i.log" 2>&1
            r=$?
            echo "-- group $i (rc $r): $line"
            tail -n 40 "$work/group-$i.log"
            exit "$r"
        ) &
        running=$((running + 1))
    done < "${QOPS_TEST_GROUPS:-scripts/gpu_test_groups.txt}"
    while [ "$running" -gt 0 ]; do wait -n || rc=1; running=$((running - 1)); done
    "$PY" scripts/merge_junit.py "$xml" "${xmls[@]}" || rc=1
    echo "pytest_groups: $i groups, rc $rc"
    rm -rf "$work"
    return "$rc"
}

# step NAME TIMEOUT CMD...: one step, its output in the log; its exit code is remembered in RCS.
step() {
    local name=$1 s=$2; shift 2
    echo
    echo "== $name (timeout ${s}s)"
    with_timeout "$s" "$@" 2>&1
    RCS="$RCS $name=$?"
}

main() {
    local t0=$SECONDS n
    RCS=""
    echo "== gpu_run.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) in $ROOT"
    echo "PYTHONPATH=$PYTHONPATH"
    nvidia-smi -L 2>&1 || echo "nvidia-smi not available"
    "$PY" -c 'import sys, torch, triton; print("python", sys.version.split()[0], "| torch", torch.__version__, "| triton", triton.__version__, "| gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None)' 2>&1
    with_timeout 60 "$PY" -m qops info 2>&1 || echo "python -m qops info failed (rc=$?)"

    # Most important first: the W4A16 results file, then correctness, then the other families and
    # the end-to-end decode. QOPS_STEPS picks a subset (a whole run needs ~15 min of GPU time).
    local steps=${QOPS_STEPS:-bench_int_weight,pytest_gpu,bench_fp8,bench_bnb_int8,bench_decode}
    case ",$steps," in *,sweep_native,*)
        step sweep_native "$SWEEP_TIMEOUT" "$PY" benchmarks/sweep_native.py --budget-s $((SWEEP_TIMEOUT - 60)) ;;
    esac
    case ",$steps," in *,profile_decode,*)
        # shellcheck disable=SC2086  # QOPS_PROFILE_ARGS is split on purpose
        step profile_decode "${QOPS_PROFILE_TIMEOUT:-480}" "$PY" benchmarks/profile_decode.py ${QOPS_PROFILE_ARGS:-} ;;
    esac
    case ",$steps," in *,probe_layout_bw,*)
        step probe_layout_bw 120 "$PY" benchmarks/probe_layout_bw.py ;;
    esac
    case ",$steps," in *,bench_int_weight,*)
        # shellcheck disable=SC2086  # QOPS_BENCH_ARGS is split on purpose
        step bench_int_weight "$BENCH_TIMEOUT" "$PY" benchmarks/bench_int_weight.py ${QOPS_BENCH_ARGS:-} ;;
    esac
    case ",$steps," in *,pytest_gpu,*)
        if [ "${QOPS_TEST_JOBS:-1}" -gt 1 ] && [ -z "${QOPS_TESTS:-}" ]; then
            echo
            echo "== pytest_gpu (scripts/gpu_test_groups.txt, $QOPS_TEST_JOBS groups at once, timeout ${TEST_TIMEOUT}s each)"
            pytest_groups "$QOPS_TEST_JOBS" "$TEST_TIMEOUT" "$OUT/${QOPS_JUNIT:-pytest_gpu.xml}" 2>&1
            RCS="$RCS pytest_gpu=$?"
        else
            # shellcheck disable=SC2086  # QOPS_TESTS is split on purpose
            TIMEOUT_SIGNAL=INT step pytest_gpu "$TEST_TIMEOUT" "$PY" -m pytest -m gpu ${QOPS_TESTS:-tests/gpu} -q -rfE -p no:cacheprovider \
                --junitxml="$OUT/${QOPS_JUNIT:-pytest_gpu.xml}"
        fi ;;
    esac
    case ",$steps," in *,bench_fp8,*)
        step bench_fp8 "$FAMILY_TIMEOUT" "$PY" benchmarks/bench_fp8.py --quick --out "$OUT/bench_fp8.json" ;;
    esac
    case ",$steps," in *,bench_bnb_int8,*)
        step bench_bnb_int8 "$FAMILY_TIMEOUT" "$PY" benchmarks/bench_bnb_int8.py --out "$OUT/bench_bnb_int8.json" ;;
    esac
    case ",$steps," in *,bench_decode,*)
        # shellcheck disable=SC2086  # QOPS_DECODE_ARGS is split on purpose
        step bench_decode "$DECODE_TIMEOUT" "$PY" benchmarks/bench_decode.py ${QOPS_DECODE_ARGS:-} ;;
    esac
    case ",$steps," in *,bench_fp8_sweep,*)
        step bench_fp8_sweep 150 "$PY" benchmarks/bench_fp8.py --sweep ;;
    esac

    if [ "${QOPS_RETURN_CACHE:-0}" = 1 ] && [ -d "$QOPS_CACHE_DIR" ]; then
        tar czf "$OUT/nvrtc-cache.tgz" -C "$QOPS_CACHE_DIR" . && echo "NVRTC cache: $(du -h "$OUT/nvrtc-cache.tgz" | cut -f1) in nvrtc-cache.tgz"
    fi
    echo
    echo "== summary:$RCS; $((SECONDS - t0))s; files in \$OUT:"
    ls -la "$OUT"
    n=$(find "$OUT" -type f | wc -l)
    [ "$n" -le 8 ] || echo "WARNING: $n files in \$OUT; only 8 come back"
    # The W4A16 table and TARGETS last, so they sit at the end of the output.
    [ -s "$OUT/bench_int_weight.txt" ] && cat "$OUT/bench_int_weight.txt"
    case "$RCS" in *=[1-9]*) return 1 ;; esac
    return 0
}

main 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
