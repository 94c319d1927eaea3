#!/usr/bin/env bash
# Build kvq and run the CPU test suite: the README's test command and CI's.
# GPU tests: ctest --test-dir build -L gpu
#
# Where a CUDA compiler exists the CUDA backend and the GPU tests are compiled
# too (-DKVQ_CUDA=ON), with or without a GPU: CI has none, and compiling is how
# it catches CUDA compile errors. KVQ_CMAKE_ARGS="-DKVQ_CUDA=OFF" skips that.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${KVQ_BUILD_DIR:-build}
CUDA_ARGS=""
if command -v nvcc >/dev/null 2>&1; then
  CUDA_ARGS="-DKVQ_CUDA=ON"
elif [ -x /usr/local/cuda/bin/nvcc ]; then
  CUDA_ARGS="-DKVQ_CUDA=ON -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc"
fi
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release $CUDA_ARGS ${KVQ_CMAKE_ARGS:-}
cmake --build "$BUILD" -j "$(nproc)"
# Fuzz the GGUF reader + ModelConfig for a short fixed time (clang + libFuzzer;
# fails, never skips, when clang is missing). KVQ_FUZZ_SECONDS=0 is not a skip:
# it still builds the target and runs the seed corpus once.
bash tests/fuzz/run.sh "${KVQ_FUZZ_SECONDS:-60}" "$BUILD/fuzz"
# The Python GGUF reader/writer used by tools/ (golden logits, training export).
python3 tools/gguf_py/test_kvq_gguf.py
# Last, so that ctest's summary closes the log.
ctest --test-dir "$BUILD" -L cpu --output-on-failure -j "$(nproc)"
