#!/usr/bin/env bash
# Re-tune the Triton int-weight table of this GPU and check the result, in one go on the GPU machine.
#
#   bash scripts/gpu_retune_triton.sh            # from a throwaway copy of the repo (it overwrites
#                                                # qops/ops/triton/configs/<gpu>.json in the tree it runs in)
#
# Installs nothing. Steps, each teed into $OUT:
#   1. benchmarks/tune_triton_int_weight.py -> $OUT/tune/<gpu>.json and tune_rows.json (~350 s on an H100);
#   2. the W4 g128 benchmark, Triton lowering only, on the shipped table and on the new one (installed beside it
#      as configs/<gpu>new.json), asymmetric weights (QOPS_AB_SYM=1: symmetric too), and their A/B
#      (benchmarks/compare_bench.py: shipped / new, above 1 = the new table is faster);
#   3. the new table copied over the shipped one, then the Triton GPU file and the Triton opchecks.
# Ship the table with `tune_triton_int_weight.py --from-rows tune_rows.json` on any machine (benchmarks/README.md).
# The three steps take ~600 s, a device call's limit: tune in one call (step 1 alone: the tuner), then run
# this with QOPS_RETUNE_TABLE=<the tuned json, carried into the tree> for steps 2 and 3.
# Environment: OUT (default ./gpu_out), QOPS_COMMIT (recorded in the JSON of a snapshot without git),
# QOPS_TUNE_TIMEOUT=420, QOPS_AB_TIMEOUT=150 (each benchmark), QOPS_AB_SYM, and gpu_run.sh's QOPS_TEST_TIMEOUT.
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
export OUT=${OUT:-$ROOT/gpu_out} PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$OUT/tune"
PY=${PYTHON:-python3}
STEM=$($PY -c "import torch; from qops.ops.triton.int_weight import gpu_key; print(gpu_key(torch.cuda.get_device_name()))") || exit 2
SHIPPED=$STEM  # the table this GPU runs now: its own, or the generic one where it has none
[ -f "qops/ops/triton/configs/$STEM.json" ] || SHIPPED=default
echo "GPU table: $STEM (now running $SHIPPED); $(date -u)"
if [ -n "${QOPS_RETUNE_TABLE:-}" ]; then
    NEW=$QOPS_RETUNE_TABLE  # a table tuned by an earlier call: steps 2 and 3 only
else
    OUT=$OUT/tune timeout "${QOPS_TUNE_TIMEOUT:-420}" $PY benchmarks/tune_triton_int_weight.py > "$OUT/tune.log" 2>&1
    echo "tune rc=$?"; tail -25 "$OUT/tune.log"
    NEW=$(ls "$OUT"/tune/*.json 2>/dev/null | grep -v tune_rows | head -1)
fi
[ -f "$NEW" ] || { echo "no table: '$NEW'"; exit 1; }
cp "$NEW" "qops/ops/triton/configs/${STEM}new.json"
SHAPES=28672x4096,8192x28672,57344x8192,4096x14336
for sym in "" ${QOPS_AB_SYM:+--symmetric}; do
    tag=${sym:+-sym}
    for table in "$SHIPPED" "${STEM}new"; do
        timeout "${QOPS_AB_TIMEOUT:-150}" $PY benchmarks/bench_int_weight.py --shapes $SHAPES --ms 1,4,16,64,256,2048 \
            --lowerings triton_int_weight --triton-config "$table" --no-gemlite --no-torch-int4 $sym --trials 5 \
            --out "$OUT/ab-$table$tag.json" > "$OUT/ab-$table$tag.log" 2>&1
        echo "bench $table$tag rc=$?"
    done
    $PY benchmarks/compare_bench.py "$OUT/ab-$SHIPPED$tag.json" "$OUT/ab-${STEM}new$tag.json" --lowering triton_int_weight | tee "$OUT/ab$tag.txt"
done
cp "$NEW" "qops/ops/triton/configs/$STEM.json"
grep "test_gpu_triton_int_weight.py" scripts/gpu_test_groups.txt > "$OUT/triton-groups.txt"
echo 'tests/gpu/test_gpu_opcheck.py -k "triton"' >> "$OUT/triton-groups.txt"
QOPS_STEPS=pytest_gpu QOPS_TEST_JOBS=4 QOPS_TEST_GROUPS="$OUT/triton-groups.txt" QOPS_JUNIT=triton-tests.xml \
    bash scripts/gpu_run.sh > "$OUT/triton-tests.log" 2>&1
echo "tests rc=$?"; grep -E "passed|failed|merge_junit" "$OUT/triton-tests.log" | tail -6
echo "end $(date -u)"
