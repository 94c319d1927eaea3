#!/usr/bin/env bash
# One GPU-machine call that profiles the batched weight products (issue 25)
# with binaries built on the development machine and carried (see
# tools/device/run_carried.sh for how to pack carry/ and .deps-run/):
#   1. the gemm_tc / gemv_batch GPU tests (no model needed);
#   2. the kernel lab (kvq_bench_gemm_tc) for LAB_TYPES (default Q1_0);
#   3. ncu of single gemm_tc launches (NCU_CASES, "LAUNCH:B" pairs, default
#      "O:8 gate:64"): every section plus the per-instruction SASS view
#      (stall reasons per instruction) as text;
#   4. `kvq bench --batch` (BATCH_CODECS, BATCHES, prompt 512, GEN, REPS;
#      BATCH_FLAGS adds options, e.g. --no-step-graphs for an A/B, and
#      BATCH_TAG names the run: bench_$BATCH_TAG.txt);
#   4b. `capacity`: `kvq bench --batch max` at CAP_CTX (32k) in CAP_BUDGET
#      (120G) of KV for CAP_CODECS (none,tsym3,k8vturbo2), CAP_GEN tokens;
#   5. ncu's duration of every kernel of a few decode steps of
#      `kvq bench --batch STEP_B` (a step's breakdown by kernel; kernels run
#      one at a time under ncu, so dependent-launch overlap is not seen);
#   6. the same for the first launches of a 4k one-sequence prefill
#      (`prefill`: where a prefill chunk's time goes).
# SECTIONS (default "tests lab ncu batch steps prefill") picks parts.
# Results in $OUT: log.txt, tests.txt, lab.txt, bench_*.txt, capacity.txt, profile.tgz (ncu
# reports and their text, the step breakdown, the bench home).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kvq-out}
mkdir -p "$OUT"
P=/tmp/kvq-profile
mkdir -p "$P"
exec > >(tee "$OUT/log.txt") 2>&1
source .deps-run/debs.sh unpack .deps-run >/dev/null
for f in carry/*.xz; do [ -e "$f" ] && xz -d -f "$f" && chmod +x "${f%.xz}"; done
mkdir -p /work
[ -e /work/main ] || ln -s "$PWD" /work/main
SECTIONS=${SECTIONS:-tests lab ncu batch steps prefill}
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
pack() { (cd "$P" && tar czf "$OUT/profile.tgz" .); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv,noheader

if want tests; then
  echo "== gemm tests"
  pids=()
  for i in 0 1 2 3; do
    GTEST_TOTAL_SHARDS=4 GTEST_SHARD_INDEX=$i timeout 200 carry/kvq_gpu_tests \
      --gtest_filter="${TEST_FILTER:-*GemmTc*:*GemvBatch*}" >"$P/tests_$i.txt" 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"
  cat "$P"/tests_?.txt >"$OUT/tests.txt"
  grep -h -E "^\[  FAILED|^\[  PASSED|Failure" "$OUT/tests.txt" | head -20
fi
if want lab; then
  echo "== lab"
  timeout 120 stdbuf -oL carry/kvq_bench_gemm_tc 20 ${LAB_TYPES:-Q1_0} >"$OUT/lab.txt" 2>&1
  grep -E "^[A-Z][A-Za-z0-9_]*$|^launch|^layer" "$OUT/lab.txt"
fi
if want ncu; then
  for c in ${NCU_CASES:-O:8 gate:64}; do
    name=${c%%:*}
    b=${c##*:}
    echo "== ncu $name B=$b"
    KVQ_LAB_BATCHES=$b KVQ_LAB_LAUNCHES=$name KVQ_LAB_PATHS=tc timeout 150 "$NCU" --clock-control none --set full \
      --import-source no -k regex:gemm_tc_kernel -c 1 -o "$P/ncu_${name}_$b" -f carry/kvq_bench_gemm_tc 2 Q1_0 \
      >"$P/ncu_${name}_$b.log" 2>&1
    "$NCU" -i "$P/ncu_${name}_$b.ncu-rep" --page details >"$P/ncu_${name}_$b.details.txt" 2>&1
    "$NCU" -i "$P/ncu_${name}_$b.ncu-rep" --page source --csv --print-source sass >"$P/ncu_${name}_$b.sass.csv" 2>&1
    grep -E "Duration|Issue Slots Busy|Eligible Warps|Warp Cycles Per Issued|Registers Per|No Eligible" \
      "$P/ncu_${name}_$b.details.txt" | head -12
    pack
  done
fi
K=carry/kvq
H=/tmp/kvq-home
if want batch; then
  T=${BATCH_TAG:-batch}
  echo "== kvq bench --batch ($T) ${BATCH_FLAGS:-}"
  timeout "${BATCH_TIMEOUT:-300}" stdbuf -oL -eL $K bench -m synthetic:bonsai-8b --device cuda \
    --codecs "${BATCH_CODECS:-none,tsym3,k8vturbo2}" --contexts 512 --batch "${BATCHES:-1,8,32,64}" --gen "${GEN:-128}" \
    --reps "${REPS:-3}" --home "$H" --out "$H/$T" ${BATCH_FLAGS:-} >"$OUT/bench_$T.txt" 2>&1
  grep -v "^\[" "$OUT/bench_$T.txt" | tail -20
  rm -rf "$P/home" && cp -r "$H" "$P/home"
  pack
fi
if want capacity; then
  echo "== kvq bench --batch max, ${CAP_CTX:-32k} in ${CAP_BUDGET:-120G}"
  timeout "${CAP_TIMEOUT:-400}" stdbuf -oL -eL $K bench -m synthetic:bonsai-8b --device cuda \
    --codecs "${CAP_CODECS:-none,tsym3,k8vturbo2}" --contexts "${CAP_CTX:-32k}" --batch max \
    --kv-budget "${CAP_BUDGET:-120G}" --gen "${CAP_GEN:-32}" --reps "${CAP_REPS:-3}" --home "$H" --out "$H/capacity" \
    >"$OUT/capacity.txt" 2>&1
  grep -v "^\[" "$OUT/capacity.txt" | tail -20
  rm -rf "$P/home" && cp -r "$H" "$P/home"
  pack
fi
if want steps; then
  for b in ${STEP_B:-8}; do
    echo "== kernels of decode steps, B=$b"
    timeout 200 "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv --launch-skip "${STEP_SKIP:-12000}" \
      --launch-count "${STEP_COUNT:-700}" $K bench -m synthetic:bonsai-8b --device cuda --codecs none --contexts 512 \
      --batch "$b" --gen 96 --reps 1 --home /tmp/kvq-steps --out /tmp/kvq-steps/r >"$P/steps_b$b.csv" 2>"$P/steps_b$b.err"
    tail -3 "$P/steps_b$b.err"
    pack
  done
fi
if want prefill; then
  echo "== kernels of a 4k prefill"
  timeout 200 "$NCU" --clock-control none --metrics gpu__time_duration.sum --csv --launch-count "${PREFILL_COUNT:-1500}" \
    $K bench -m synthetic:bonsai-8b --device cuda --codecs none --contexts 4k --gen 4 --reps 1 --home /tmp/kvq-pf \
    --out /tmp/kvq-pf/r >"$P/prefill_4k.csv" 2>"$P/prefill_4k.err"
  tail -3 "$P/prefill_4k.err"
  pack
fi
echo "== done"
