#!/usr/bin/env bash
# Builds and runs the host emulator of the prefill attention kernel (see emu.cpp).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$here/../.."
out="${TMPDIR:-/tmp}/kvq_prefill_emu"
mkdir -p "$out"
python3 "$here/extract.py" "$root/src/backend/cuda/attention_prefill.cu" "$out/kernel_body.inc"
g++ -std=c++17 -O2 -I"$root/src" -I"$out" -o "$out/emu" "$here/emu.cpp"
"$out/emu" late
"$out/emu" eager
