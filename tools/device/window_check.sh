#!/usr/bin/env bash
# One GPU-machine call for the exact recent window (issue 28 item 1,
# docs/architecture.md "The exact recent window"), with binaries built on the
# development machine and carried (tools/device/run_carried.sh says how to
# pack carry/ and .deps-run/):
#   build: with .deps carried instead of binaries, builds kvq and
#          kvq_gpu_tests there (build-gpu/, sm_90) and runs those (~3.5 min);
#   tests: kvq_gpu_tests (TEST_FILTER, 4 shards in parallel), if carried;
#   one:   `kvq bench` of one sequence at ONE_CTX for ONE_CODECS, once per
#          window size in WINDOWS (0: none; auto: the default), GEN tokens,
#          REPS runs;
#   batch: the same for BATCH_SETS (CTX:BATCHES ...), each sequence's KV a
#          copy of sequence 0's (--batch-fill copy);
#   lab:   kvq_bench_gemv bonsai-8b (the decode step's GEMVs alone), if
#          carried.
# EXTRA_ARGS are added to every kvq bench call and TAG to its output names
# (A/B knobs, several invocations in one call).
# Results in $OUT: log.txt (summary), tests.txt, bench.tgz (every output).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kvq-out}
mkdir -p "$OUT"
P=/tmp/kvq-window
mkdir -p "$P"
exec > >(tee -a "$OUT/log.txt") 2>&1  # appends: several invocations in one call
SECTIONS=${SECTIONS:-tests one batch}
WINDOWS=${WINDOWS:-0 1}
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
mkdir -p /work
[ -e /work/main ] || ln -s "$PWD" /work/main
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv,noheader
if want build; then
  source .deps/debs.sh unpack .deps >/dev/null
  source tools/device/pkgconfig_stubs.sh
  echo "== build"
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVQ_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a \
    >"$P/cmake.txt" 2>&1 && cmake --build build-gpu -j16 --target kvq kvq_gpu_tests >"$P/build.txt" 2>&1 ||
    { tail -30 "$P/cmake.txt" "$P/build.txt"; exit 1; }
  mkdir -p carry && cp build-gpu/kvq build-gpu/tests/kvq_gpu_tests carry/
else
  source .deps-run/debs.sh unpack .deps-run >/dev/null
  # Binaries: carry/NAME.xz each, or both in one carry/*.tar.xz packed with a
  # dictionary larger than one binary (xz --lzma2=preset=9,dict=192MiB): their
  # kernels are the same bytes, so kvq and kvq_gpu_tests travel in ~37 MB.
  for f in carry/*.tar.xz; do [ -e "$f" ] && tar -xJf "$f" -C carry && rm -f "$f"; done
  for f in carry/*.xz; do [ -e "$f" ] && xz -d -f "$f" && chmod +x "${f%.xz}"; done
fi
pack() { (cd "$P" && tar czf "$OUT/bench.tgz" .); }

if want tests && [ -x carry/kvq_gpu_tests ]; then
  echo "== gpu tests: ${TEST_FILTER:-*}"
  pids=()
  for i in 0 1 2 3; do
    GTEST_TOTAL_SHARDS=4 GTEST_SHARD_INDEX=$i timeout "${TEST_TIMEOUT:-300}" carry/kvq_gpu_tests \
      --gtest_filter="${TEST_FILTER:-*}" >"$P/tests_$i.txt" 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"
  cat "$P"/tests_?.txt >"$OUT/tests.txt"
  grep -h -E "^\[  FAILED|^\[  PASSED|^\[  SKIPPED|tests ran" "$OUT/tests.txt" | sort | uniq -c | head -40
fi

if want lab && [ -x carry/kvq_bench_gemv ]; then
  echo "== lab: kvq_bench_gemv bonsai-8b"
  timeout 300 carry/kvq_bench_gemv bonsai-8b 20 2>&1 | tee "$P/lab_gemv.txt"
fi

bench() {  # bench TAG ARGS...
  local tag=$1
  shift
  echo "== $tag: $*"
  timeout "${BENCH_TIMEOUT:-300}" stdbuf -oL -eL carry/kvq bench -m synthetic:bonsai-8b --device cuda \
    --home "$P/home" --out "$P/home/$tag" --no-plots "$@" >"$P/bench_$tag.txt" 2>&1
  grep -E "^(codec|none|tsym|k8v|fp8|iso|rotor|turbo|q8|planar|k_|rot_|error|kvq:)" "$P/bench_$tag.txt" | grep -v "^fit" | cut -c1-110
  pack
}
TAG=${TAG:-}  # appended to the bench tags (A/B runs in one call)
if want one; then
  for w in $WINDOWS; do
    bench "one_win$w$TAG" --codecs "${ONE_CODECS:-none,tsym3,k8vturbo2,fp8,k8v8}" --contexts "${ONE_CTX:-4k,16k,65408}" \
      --gen "${GEN:-128}" --reps "${REPS:-3}" --kv-window "$w" ${EXTRA_ARGS:-}
  done
fi
if want batch; then
  for set in ${BATCH_SETS:-4k:32,64}; do
    for w in $WINDOWS; do
      bench "batch_${set%%:*}_win$w$TAG" --codecs "${BATCH_CODECS:-none,tsym3,k8vturbo2}" --contexts "${set%%:*}" \
        --batch "${set#*:}" --batch-fill copy --gen "${GEN:-64}" --reps "${REPS:-3}" --kv-window "$w" ${EXTRA_ARGS:-}
    done
  done
fi
echo "== done"
