#!/usr/bin/env bash
# Build kvq (CPU backend; CUDA too when nvcc is present) and run the CPU test suite.
# The README's test command. GPU tests: ctest --test-dir build -L gpu
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${KVQ_BUILD_DIR:-build}
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release ${KVQ_CMAKE_ARGS:-}
cmake --build "$BUILD" -j "$(nproc)"
ctest --test-dir "$BUILD" -L cpu --output-on-failure -j "$(nproc)"
# Fuzz the GGUF reader + ModelConfig for a short fixed time (clang + libFuzzer;
# fails, never skips, when clang is missing). KVQ_FUZZ_SECONDS=0 is not a skip:
# it still builds the target and runs the seed corpus once.
bash tests/fuzz/run.sh "${KVQ_FUZZ_SECONDS:-60}" "$BUILD/fuzz"
