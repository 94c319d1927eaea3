#!/usr/bin/env bash
# One GPU-machine call: build with CUDA (sm_90), run the `gpu` test label
# (every CUDA kernel vs its CPU reference), generate golden logits for the
# synthetic tiny models with transformers, cross-check the tokenizer reference
# ids with Hugging Face `tokenizers`, and run the kernel lab benchmarks.
# Usage on the device (after `source .deps/debs.sh unpack .deps`):
#   bash tools/device/gpu_check.sh [tests] [golden] [tokenizer] [lab] [run] [bench] [qwen3] [codecs]
#   (default: tests lab run bench)
#   codecs: `none` vs every codec with GPU kernels (CODECS, default "none k8v8")
#   on synthetic bonsai-8b at BENCH_L contexts, medians of 3.
# Results land in $OUT (log.txt, golden.tgz).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kvq-out}
W=/tmp/kvq-gpu-check
mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1
exec > >(tee "$OUT/log.txt") 2>&1
SECTIONS=${*:-tests lab run bench}
want() { [[ " $SECTIONS " == *" $1 "* ]]; }

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader
J=$(nproc)
source tools/device/pkgconfig_stubs.sh  # gnutls.pc for libmicrohttpd.pc
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVQ_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a >"$W/cmake.log" 2>&1 ||
  { tail -30 "$W/cmake.log"; exit 1; }
time cmake --build build-gpu -j "$J" --target kvq kvq_gpu_tests kvq_bench_gemv kvq_bench_attention 2>&1 | grep -E "error|FAILED" | head -20
if want tests; then
  echo "== gpu tests"
  (cd build-gpu && ctest -L gpu --output-on-failure -j 4 >"$OUT/gpu_tests.txt" 2>&1; tail -25 "$OUT/gpu_tests.txt")
  build-gpu/tests/kvq_gpu_tests --gtest_filter='*CudaForward*' 2>&1 | grep -iE "worst|bound|FAIL|OK \]|identical" | head -20
fi
if want sanitize; then
  echo "== compute-sanitizer on small attention cases"
  CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  for tool in memcheck racecheck; do
    timeout 120 "$CS" --tool $tool --error-exitcode 9 build-gpu/tests/kvq_gpu_tests \
      --gtest_filter="${SANITIZE_FILTER:-*CudaDecodeAttention*G5_kv3_d64_cap4100:*GemvFused*Q1_0_c512*:*QkRopeStore*}" 2>&1 | tail -3
    echo "$tool exit: $?"
  done
fi

if want golden; then
echo "== golden logits (transformers, fp32)"
K=build-gpu/kvq
G=tests/data/golden
ids() { python3 -c "import random; r=random.Random($1); print(','.join(str(r.randrange($2)) for _ in range($3)))"; }
gen() {  # name vocab synth-args...
  local name=$1 vocab=$2; shift 2
  mkdir -p "$W/golden/$name"
  $K synth "$@" -o "$W/golden/$name/model.gguf" || return 1
  python3 tools/golden/golden_logits.py --gguf "$W/golden/$name/model.gguf" --gguf-ref "$G/$name/model.gguf" \
    --ids "$(ids 1 "$vocab" 12)" --ids "$(ids 2 "$vocab" 40)" --ids "$(ids 3 "$vocab" 97)" \
    --out "$W/golden/$name" --set "synth=\"kvq synth $*\"" 2>&1 | tail -4
}
gen tiny 579 --shape tiny --seed 1
gen tiny-llama 579 --shape tiny-llama --seed 1
gen tiny-q1 579 --shape tiny --weights Q1_0 --seed 2
gen tiny-llama-q4 579 --shape tiny-llama --weights Q4_0 --seed 3
(cd "$W" && tar czf "$OUT/golden.tgz" golden)
fi

if want tokenizer; then
  echo "== tokenizer: HF tokenizers vs committed reference ids"
  python3 tools/tokref/hf_ref.py --tokenizer models/tokenizers/qwen3/tokenizer.json \
    --compare tests/data/tokenizer/qwen3_ref.jsonl --chat 2>&1 | tail -20
fi

if want lab; then
  echo "== kernel lab: GEMV"
  build-gpu/kvq_bench_gemv bonsai-8b 20
  build-gpu/kvq_bench_gemv qwen3-8b 10
  echo "== kernel lab: attention"
  timeout 120 build-gpu/kvq_bench_attention 20
fi
K=build-gpu/kvq
if want run; then
  echo "== kvq run --device cuda: default model, greedy, CPU vs GPU text"
  $K run -p "def " -n 48 --temp 0 --device cpu 2>&1 | tail -3
  $K run -p "def " -n 48 --temp 0 --device cuda 2>&1 | tail -3
  $K synth --shape bonsai-8b -o "$W/bonsai.gguf" 2>&1 | tail -1
  echo "-- bonsai-8b, 4096-token random prompt, 128 generated, recorded steps off (1 run)"
  timeout 120 $K run -m "$W/bonsai.gguf" --device cuda --no-step-graphs --random-prompt 4096 -n 128 --temp 0 --repeat 1 2>&1 >/dev/null | tail -1
  $K run -m "$W/bonsai.gguf" --device cuda -p "hello" -n 4 --kv k8v4 2>&1 | tail -1
fi
# The issue's measurement: batch 1, an L-token prompt then 128 greedy tokens,
# medians of 3 runs on fresh caches (BENCH_L overrides the contexts).
if want bench; then
  [ -f "$W/bonsai.gguf" ] || $K synth --shape bonsai-8b -o "$W/bonsai.gguf" 2>&1 | tail -1
  for L in ${BENCH_L:-4096 16384 65408}; do
    echo "-- bonsai-8b, L=$L"
    timeout 300 $K run -m "$W/bonsai.gguf" --device cuda --random-prompt "$L" -n 128 --temp 0 --repeat 3 2>&1 >/dev/null |
      grep -E "run [0-9]|median|rror"
  done
fi
# Per-kernel time inside the recorded decode step (nsys traces graph nodes).
if want profile; then
  [ -f "$W/bonsai.gguf" ] || $K synth --shape bonsai-8b -o "$W/bonsai.gguf" 2>&1 | tail -1
  NSYS=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems*/bin/nsys 2>/dev/null | head -1)
  if [ -n "$NSYS" ]; then
    for L in ${PROFILE_L:-4096}; do
      echo "-- nsys: bonsai-8b, L=$L, 64 generated"
      timeout 240 "$NSYS" profile --cuda-graph-trace=node -o "$W/prof$L" --force-overwrite true \
        $K run -m "$W/bonsai.gguf" --device cuda --random-prompt "$L" -n 64 --temp 0 >/dev/null 2>&1
      "$NSYS" stats --report cuda_gpu_kern_sum --format csv "$W/prof$L.nsys-rep" 2>/dev/null |
        python3 -c "
import csv,sys
rows=[r for r in csv.reader(sys.stdin) if len(r)>8]
hdr=rows[0]; rows=rows[1:]
i_t=hdr.index('Total Time (ns)'); i_n=hdr.index('Instances'); i_a=hdr.index('Avg (ns)'); i_k=hdr.index('Name')
for r in rows[:14]: print(f'{float(r[i_t])/1e6:9.2f} ms {int(r[i_n]):7d} x {float(r[i_a])/1e3:8.2f} us  {r[i_k][:110]}')
"
    done
  else
    echo "nsys not found"
  fi
fi
if want codecs; then
  [ -f "$W/bonsai.gguf" ] || $K synth --shape bonsai-8b -o "$W/bonsai.gguf" 2>&1 | tail -1
  for L in ${BENCH_L:-4096 16384 65408}; do
    for KV in ${CODECS:-none k8v8}; do
      echo "-- bonsai-8b, L=$L, --kv $KV"
      timeout 300 $K run -m "$W/bonsai.gguf" --device cuda --kv "$KV" --random-prompt "$L" -n 128 --temp 0 --repeat 3 \
        2>&1 >/dev/null | grep -E "run [0-9]|median|KV|rror"
    done
  done
fi
if want qwen3; then
  echo "-- synthetic qwen3-8b (bf16 weights), L=4096"
  time $K synth --shape qwen3-8b -o "$W/qwen3.gguf" 2>&1 | tail -1
  timeout 300 $K run -m "$W/qwen3.gguf" --device cuda --random-prompt 4096 -n 128 --temp 0 --repeat 3 2>&1 >/dev/null |
    grep -E "run [0-9]|median|rror"
  rm -f "$W/qwen3.gguf"
fi
echo "== done"
