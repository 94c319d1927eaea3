#!/usr/bin/env bash
# One GPU-machine call with binaries built HERE (the CI-like machine, CUDA
# compiled for sm_90) instead of building on the device: saves minutes of
# device time per call. The tracked tree plus the carried binaries must stay
# under the device tool's 64 MiB, so only what the GPU needs travels:
#   mkdir -p carry && cp tests/data/kv/heldout_code.txt carry/ &&
#     for b in build/kvq build/tests/kvq_gpu_tests; do strip -o /tmp/$(basename $b) $b &&
#       xz -9 -T1 -c /tmp/$(basename $b) > carry/$(basename $b).xz; done
#   (binaries travel stripped and packed: with every codec's kernel instances
#   they are ~36 MB each, ~22-23 MB packed in session 13; strip cannot write
#   to a pipe; unpacked below)
#   mkdir -p .deps-run && cp .deps/debs.sh .deps/libicu72_*.deb .deps/libpcre2-8-0_*.deb .deps/libsqlite3-0_*.deb \
#     .deps/libcpp-httplib0.11_*.deb .deps/libbrotli1_*.deb .deps/libmicrohttpd12_*.deb .deps-run/
#   (carry .deps-run and carry; untrack tests/data and models/tokenizers for the call if the tree is too large)
#   (the GPU tests need models/kvq-tiny-code.gguf, 31 MB and barely
#   compressible: a tests call has room for kvq_gpu_tests alone; the lab and
#   kvq travel together in a call that leaves the model out too: two packed
#   binaries, .deps-run (11 MB) and the tree without the model (6 MB) made
#   ~62 MB in session 13, and such a call took 10-17 s of device time)
# On the device:  bash tools/device/run_carried.sh [tests] [sanitize] [kquant] [lab] [bench] [serve] [eval]
#   (serve: tools/device/serve_check.sh with carry/kvq, SERVE_SECTIONS="batch prefix rate soak", SERVE_CODECS)
# Results: $OUT (gpu_tests_*.txt, bench.tgz, ...); a summary on stdout.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kvq-out}
mkdir -p "$OUT"
source .deps-run/debs.sh unpack .deps-run >/dev/null
for f in carry/*.xz; do [ -e "$f" ] && xz -d -f "$f" && chmod +x "${f%.xz}"; done
# The binaries look for the embedded model under the source path they were built in.
mkdir -p /work
[ -e /work/main ] || ln -s "$PWD" /work/main
SECTIONS=${*:-tests bench}
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv,noheader
B=carry

if want tests; then
  echo "== gpu tests (4 shards in parallel)"
  for i in 0 1 2 3; do
    GTEST_TOTAL_SHARDS=4 GTEST_SHARD_INDEX=$i timeout 400 $B/kvq_gpu_tests >"$OUT/gpu_tests_$i.txt" 2>&1 &
  done
  wait
  grep -h -E "^\[  PASSED|^\[  FAILED" "$OUT"/gpu_tests_*.txt
fi
if want sanitize; then
  CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  for t in memcheck racecheck; do
    timeout 200 "$CS" --tool $t --error-exitcode 9 $B/kvq_gpu_tests \
      --gtest_filter="${SANITIZE_FILTER:-*CudaCodecDecode*k8v8_G5_kv3_d64*:*CudaKvStore*k8v8_kv3*:*CudaCodecPrefill*}" \
      >"$OUT/san_$t.txt" 2>&1
    echo "$t exit $?: $(tail -1 "$OUT/san_$t.txt")"
  done
fi
if want kquant; then
  echo "== K-quant GEMV lab"
  for s in q4k-8b q5k-8b q6k-8b q2k-8b q3k-8b; do
    echo "== $s" >>"$OUT/kquant.txt"
    timeout 60 $B/kvq_bench_gemv $s 20 >>"$OUT/kquant.txt" 2>&1
    echo "-- $s"; grep -E "all GEMVs of one decode step|^fused:" "$OUT/kquant.txt" | tail -2
  done
fi
if want lab; then
  echo "== KV decode lab (${LAB_ARGS:-20})"
  timeout 120 $B/kvq_bench_kv_decode ${LAB_ARGS:-20} >"$OUT/lab.txt" 2>&1
  tail -40 "$OUT/lab.txt"
fi
if want bench; then
  echo "== kvq bench on the GPU (${BENCH_CODECS:-none,k8v8} x ${BENCH_CONTEXTS:-4k,16k,65408})"
  H=/tmp/kvq-home
  timeout 400 $B/kvq bench -m synthetic:bonsai-8b --device cuda --codecs "${BENCH_CODECS:-none,k8v8}" \
    --contexts "${BENCH_CONTEXTS:-4k,16k,65408}" --gen 128 --reps 3 --home "$H" --out "$H/report" 2>&1 | tail -25
  (cd "$H" && tar czf "$OUT/bench.tgz" .)
fi
if want serve; then
  echo "== serving (tools/device/serve_check.sh ${SERVE_SECTIONS:-batch prefix}) with carry/kvq"
  PREBUILT=1 BUILD=carry OUT="$OUT/serve" bash tools/device/serve_check.sh ${SERVE_SECTIONS:-batch prefix} |
    grep -E "^==|^concurrency|^rate|failures|server idle"
fi
if want eval; then
  echo "== kvq eval on the GPU"
  for dev in cuda cpu; do
    timeout 200 $B/kvq eval kl --device $dev --codecs k8v8,tsym3 --ctx 1024 --no-record \
      -f "${EVAL_FILE:-carry/heldout_code.txt}" 2>&1 | tail -6
  done
fi
echo "== done"
