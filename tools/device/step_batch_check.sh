#!/usr/bin/env bash
# One GPU-machine call for the step batch (issue 25): build for sm_90, run the
# GPU tests that cover it (or all of them), the batched-GEMM lab, then
# `kvq bench --batch` on synthetic bonsai-8b and the one-sequence reference.
# Usage on the device (after `source .deps/debs.sh unpack .deps`):
#   bash tools/device/step_batch_check.sh [GTEST_FILTER]
#   BATCH_CODECS (default none,tsym3,k8vturbo2), BATCHES (1,8,32,64), BATCH_CTX (512),
#   GEN (128), REPS (3), REF_CONTEXTS (4k,16k,65408; empty: skip the one-sequence
#   reference), LAB=0 skips the lab, LAB_TYPES (Q1_0), TEST_TIMEOUT (150 s per shard).
# Every step writes its whole output to $OUT as it goes (a call cut by the
# time limit still returns what ran): log.txt, gpu_tests.txt, lab.txt,
# bench.txt, ref.txt, batch.tgz (report, cells.csv, runs.db).
# Time on an H200 machine: build ~2.5 min (-j16), full GPU suite ~3.5 min
# (4 at once), lab ~30 s, the default bench ~2-3 min: more than one call's
# 10 minutes together, so pass a filter or skip parts.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kvq-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader
source tools/device/pkgconfig_stubs.sh  # gnutls.pc for libmicrohttpd.pc
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVQ_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a >/tmp/cmake.log 2>&1 ||
  { tail -30 /tmp/cmake.log; exit 1; }
time cmake --build build-gpu -j "$(nproc)" --target kvq kvq_gpu_tests kvq_bench_gemm_tc 2>&1 | grep -E "error|FAILED" | head -20
echo "== gpu tests (${1:-all})"
if [ -n "${1:-}" ]; then
  pids=()
  for i in 0 1 2 3; do
    GTEST_TOTAL_SHARDS=4 GTEST_SHARD_INDEX=$i timeout "${TEST_TIMEOUT:-150}" build-gpu/tests/kvq_gpu_tests \
      --gtest_filter="$1" >"$OUT/gpu_tests_$i.txt" 2>&1 &
    pids+=($!)
  done
  # Wait for the shards only: a bare `wait` also waits for the tee of the
  # log (bash >= 5.1 waits for process substitutions), which never ends.
  wait "${pids[@]}"
  cat "$OUT"/gpu_tests_?.txt >"$OUT/gpu_tests.txt" && rm -f "$OUT"/gpu_tests_?.txt
  grep -h -E "^\[  FAILED|^\[  PASSED|Failure" "$OUT/gpu_tests.txt" | head -30
else
  (cd build-gpu && ctest -L gpu -j 4 >"$OUT/gpu_tests.txt" 2>&1)
  grep -E "tests passed|FAILED|Failed" "$OUT/gpu_tests.txt" | head -30
fi
if [ "${LAB:-1}" = 1 ]; then
  echo "== batched GEMM lab (gemm_tc with the workspace, per-CTA staging, gemv_batch)"
  LAB_BIN=$(find build-gpu -name kvq_bench_gemm_tc -type f | head -1)
  timeout 90 stdbuf -oL "$LAB_BIN" 10 ${LAB_TYPES:-Q1_0} >"$OUT/lab.txt" 2>&1
  grep -E "^[A-Z][A-Za-z0-9_]*$|^launch|^layer" "$OUT/lab.txt"
fi
K=build-gpu/kvq
H=/tmp/kvq-home
echo "== kvq bench --batch"
timeout 240 stdbuf -oL -eL $K bench -m synthetic:bonsai-8b --device cuda --codecs "${BATCH_CODECS:-none,tsym3,k8vturbo2}" \
  --contexts "${BATCH_CTX:-512}" --batch "${BATCHES:-1,8,32,64}" --gen "${GEN:-128}" --reps "${REPS:-3}" --home "$H" \
  --out "$H/batch" >"$OUT/bench.txt" 2>&1
grep -v "^\[" "$OUT/bench.txt" | tail -20
if [ -n "${REF_CONTEXTS-4k,16k,65408}" ]; then
  echo "== one sequence per step (reference)"
  timeout 150 stdbuf -oL -eL $K bench -m synthetic:bonsai-8b --device cuda --codecs none \
    --contexts "${REF_CONTEXTS-4k,16k,65408}" --gen "${GEN:-128}" --reps "${REPS:-3}" --home "$H" --out "$H/ref" \
    >"$OUT/ref.txt" 2>&1
  grep -v "^\[" "$OUT/ref.txt" | tail -6
fi
(cd "$H" && tar czf "$OUT/batch.tgz" .)
echo "== done"
