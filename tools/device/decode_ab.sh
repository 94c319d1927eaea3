#!/usr/bin/env bash
# One GPU-machine call that compares builds or lab settings of the decode
# attention (issue 28 item 3, docs/perf.md session 16) with binaries built on
# the development machine and carried (tools/device/run_carried.sh says how
# to pack carry/ and .deps-run/):
#   tests: kvq_gpu_tests (TEST_FILTER, 4 shards in parallel), if carried;
#   batch: per CTX:BATCHES set of BATCH_SETS (default 4k:32,64) and per
#          variant, `kvq bench --batch BATCHES` at CTX (each sequence's KV a
#          copy of sequence 0's: --batch-fill copy) for BATCH_CODECS, GEN
#          tokens, REPS runs;
#   batch2: the same for BATCH2_SETS (default 16k:32) and BATCH2_VARIANTS;
#   one:   per variant in ONE_VARIANTS, one sequence at ONE_CTX for ONE_CODECS;
#   ncu:   per variant in NCU_VARIANTS, NCU_COUNT flash_decode launches from
#          the NCU_SKIP + 1-th of `kvq bench --batch NCU_B` at NCU_CTX, tsym3:
#          duration, throughput, occupancy, scheduler and warp-state sections.
# VARIANTS: space-separated NAME=BINARY[,VAR=VALUE...] (BINARY under carry/;
# the VAR=VALUE pairs go into the environment of that variant's runs).
# Results in $OUT: log.txt (summary), tests.txt, ab.tgz (every output).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kvq-out}
mkdir -p "$OUT"
P=/tmp/kvq-ab
mkdir -p "$P"
exec > >(tee "$OUT/log.txt") 2>&1
source .deps-run/debs.sh unpack .deps-run >/dev/null
for f in carry/*.xz; do [ -e "$f" ] && xz -d -f "$f" && chmod +x "${f%.xz}"; done
mkdir -p /work
[ -e /work/main ] || ln -s "$PWD" /work/main
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv,noheader
SECTIONS=${SECTIONS:-tests batch ncu one}  # run in this order (tests first when named)
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
VARIANTS=${VARIANTS:-base=kvq}
pack() { (cd "$P" && tar czf "$OUT/ab.tgz" .); }
# run_variant SPEC CMD...: CMD with the variant's binary as $BIN and its environment.
bin_of() { echo "carry/${1#*=}" | cut -d, -f1; }
env_of() { local s=${1#*=}; [[ $s == *,* ]] && echo "${s#*,}" | tr ',' ' '; }
name_of() { echo "${1%%=*}"; }

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
  grep -h -E "^\[  FAILED|^\[  PASSED|^\[  SKIPPED|tests ran" "$OUT/tests.txt" | sort | uniq -c | head -30
fi

bench() {  # bench SPEC TAG ARGS...
  local spec=$1 tag=$2
  shift 2
  local n b e
  n=$(name_of "$spec")
  b=$(bin_of "$spec")
  e=$(env_of "$spec")
  echo "== $n ($b ${e:-default}) $tag: $*"
  env $e timeout "${BENCH_TIMEOUT:-240}" stdbuf -oL -eL "$b" bench -m synthetic:bonsai-8b --device cuda --home "$P/home" \
    --out "$P/home/${n}_$tag" --no-plots "$@" >"$P/bench_${n}_$tag.txt" 2>&1
  grep -E "^(codec|none|tsym|k8v|fp8|iso|rotor)" "$P/bench_${n}_$tag.txt" | grep -v "^fit" | cut -c1-100
  pack
}

sec_batch() {  # sec_batch SETS VARIANTS
  for set in $1; do
    for v in $2; do
      bench "$v" "batch_${set%%:*}" --codecs "${BATCH_CODECS:-none,tsym3,k8vturbo2}" --contexts "${set%%:*}" \
        --batch "${set#*:}" --batch-fill copy --gen "${GEN:-64}" --reps "${REPS:-3}"
    done
  done
}
sec_one() {
  for v in ${ONE_VARIANTS:-$VARIANTS}; do
    bench "$v" one --codecs "${ONE_CODECS:-none,tsym3,k8vturbo2}" --contexts "${ONE_CTX:-4k,65408}" --gen 128 --reps 3
  done
}
sec_ncu() {
  for v in ${NCU_VARIANTS:-$VARIANTS}; do
    n=$(name_of "$v")
    b=$(bin_of "$v")
    e=$(env_of "$v")
    echo "== ncu $n: flash_decode launches $((${NCU_SKIP:-72} + 1))-$((${NCU_SKIP:-72} + ${NCU_COUNT:-3})), B=${NCU_B:-32} ${NCU_CTX:-4k} ${NCU_CODEC:-tsym3}"
    env $e timeout 200 "$NCU" --clock-control none --section SpeedOfLight --section LaunchStats --section Occupancy \
      --section SchedulerStats --section WarpStateStats -k regex:flash_decode --launch-skip "${NCU_SKIP:-72}" \
      -c "${NCU_COUNT:-3}" "$b" bench -m synthetic:bonsai-8b --device cuda --codecs "${NCU_CODEC:-tsym3}" \
      --contexts "${NCU_CTX:-4k}" --batch "${NCU_B:-32}" --batch-fill copy --gen 8 --reps 1 --warmup 0 \
      --home /tmp/kvq-ncu --out "/tmp/kvq-ncu/$n" --no-plots >"$P/ncu_$n.txt" 2>&1
    grep -E "Duration|DRAM Throughput|Issue Slots Busy|Eligible Warps|Registers Per|Grid Size|Achieved Occupancy|Block Limit Registers" \
      "$P/ncu_$n.txt" | sed -E 's/ +/ /g' | sort | uniq -c | cut -c1-120 | head -16
    pack
  done
}
for sec in $SECTIONS; do
  case $sec in
    batch) sec_batch "${BATCH_SETS:-4k:32,64}" "${BATCH_VARIANTS:-$VARIANTS}" ;;
    batch2) sec_batch "${BATCH2_SETS:-16k:32}" "${BATCH2_VARIANTS:-$VARIANTS}" ;;
    one) sec_one ;;
    ncu) sec_ncu ;;
  esac
done
echo "== done"
