#!/usr/bin/env bash
# Configure and build kvq into ./build (Release). Extra CMake args via KVQ_CMAKE_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${KVQ_BUILD_DIR:-build}
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release ${KVQ_CMAKE_ARGS:-}
cmake --build "$BUILD" -j "$(nproc)" --target kvq
