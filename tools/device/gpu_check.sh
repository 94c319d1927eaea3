#!/usr/bin/env bash
# One GPU-machine call: build with CUDA (sm_90), run the `gpu` test label
# (every CUDA kernel vs its CPU reference), generate golden logits for the
# synthetic tiny models with transformers, cross-check the tokenizer reference
# ids with Hugging Face `tokenizers`, and run the kernel lab benchmarks.
# Usage on the device (after `source .deps/debs.sh unpack .deps`):
#   bash tools/device/gpu_check.sh [tests] [golden] [tokenizer] [lab] [run]   (default: all)
# Results land in $OUT (log.txt, golden.tgz).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kvq-out}
W=/tmp/kvq-gpu-check
mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1
exec > >(tee "$OUT/log.txt") 2>&1
SECTIONS=${*:-tests golden tokenizer lab run}
want() { [[ " $SECTIONS " == *" $1 "* ]]; }

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader
J=$(nproc)
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVQ_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 >"$W/cmake.log" 2>&1 ||
  { tail -30 "$W/cmake.log"; exit 1; }
time cmake --build build-gpu -j "$J" --target kvq kvq_gpu_tests kvq_bench_gemv kvq_bench_attention 2>&1 | tail -3
if want tests; then
  echo "== gpu tests"
  (cd build-gpu && ctest -L gpu --output-on-failure -j 4 >"$OUT/gpu_tests.txt" 2>&1; tail -25 "$OUT/gpu_tests.txt")
  build-gpu/tests/kvq_gpu_tests --gtest_filter='*CudaForward*' 2>&1 | grep -iE "worst|bound|FAIL|OK \]" | head -20
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
  timeout 90 build-gpu/kvq_bench_attention 20
fi
if want run; then
  echo "== kvq run --device cuda"
  words() { python3 -c "import random; r=random.Random(1); w='the quick brown fox jumps over lazy dog and then runs into a forest where many trees grow tall while birds sing songs of morning light'.split(); print(' '.join(r.choice(w) for _ in range($1)))"; }
  build-gpu/kvq run -p "def " -n 48 --temp 0 --device cpu 2>&1 | tail -4
  build-gpu/kvq run -p "def " -n 48 --temp 0 --device cuda 2>&1 | tail -4
  build-gpu/kvq synth --shape bonsai-8b -o "$W/bonsai.gguf" 2>&1 | tail -1
  for L in 4000 16000; do
    words $((L * 10 / 27)) > "$W/p$L.txt"
    echo "-- bonsai-8b, about $L prompt tokens, 128 generated"
    timeout 120 build-gpu/kvq run -m "$W/bonsai.gguf" --device cuda -f "$W/p$L.txt" -n 128 --temp 0 2>&1 >/dev/null | tail -2
  done
  build-gpu/kvq run -m "$W/bonsai.gguf" --device cuda -p "hello" -n 4 --kv k8v4 2>&1 | tail -1
fi
echo "== done"
