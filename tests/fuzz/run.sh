#!/usr/bin/env bash
# Build the fuzz targets with clang (libFuzzer + ASan + UBSan), write seed
# corpora of valid small files, and fuzz each for a fixed time: the GGUF
# reader for SECONDS, tokenizer.json import for min(SECONDS, 40). Fails loudly when
# clang or the libFuzzer runtime is missing (tools/install-deps.sh installs
# clang and libclang-rt-14-dev): a fuzz step that silently skips is no test.
#   usage: tests/fuzz/run.sh [SECONDS] [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
SECONDS_TO_RUN=${1:-60}
OUT=${2:-build/fuzz}
CXX_FUZZ=""
for c in clang++ clang++-14 clang++-15 clang++-16; do
  if command -v "$c" >/dev/null 2>&1; then CXX_FUZZ=$c; break; fi
done
if [ -z "$CXX_FUZZ" ]; then
  echo "fuzz: ERROR: clang++ not found; install clang and libclang-rt-14-dev (bash tools/install-deps.sh)" >&2
  exit 1
fi
mkdir -p "$OUT"
SRCS="src/gguf/gguf.cpp src/gguf/types.cpp src/gguf/quant.cpp src/core/error.cpp src/core/file_io.cpp src/model/config.cpp"
FLAGS="-std=c++20 -O1 -g -Isrc -fno-omit-frame-pointer"
echo "fuzz: building with $CXX_FUZZ"
if ! $CXX_FUZZ $FLAGS -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    tests/fuzz/fuzz_gguf.cpp $SRCS -o "$OUT/fuzz_gguf"; then
  echo "fuzz: ERROR: building the fuzz target failed (is libclang-rt-14-dev installed?)" >&2
  exit 1
fi
$CXX_FUZZ $FLAGS tests/fuzz/make_corpus.cpp $SRCS -o "$OUT/make_corpus"
rm -rf "$OUT/seeds" && mkdir -p "$OUT/seeds" "$OUT/corpus"
"$OUT/make_corpus" "$OUT/seeds"
echo "fuzz: $(ls "$OUT/seeds" | wc -l) seed files; fuzzing for ${SECONDS_TO_RUN}s"
# -rss_limit_mb: a "huge allocation" is a finding. -timeout: a hang is a finding.
# libFuzzer reads -max_total_time=0 as "no limit"; 0 here means "seeds only".
if [ "$SECONDS_TO_RUN" -gt 0 ]; then LIMIT="-max_total_time=$SECONDS_TO_RUN"; else LIMIT="-runs=0"; fi
"$OUT/fuzz_gguf" $LIMIT -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=1024 \
  -max_len=65536 -print_final_stats=1 -artifact_prefix="$OUT/" "$OUT/corpus" "$OUT/seeds"
echo "fuzz: gguf: no findings in ${SECONDS_TO_RUN}s"

# tokenizer.json import (kvq tokenize --tokenizer-json, kvq synth --vocab) and
# the tokenizer it builds, on the text of the input.
TOK_SECONDS=$(( SECONDS_TO_RUN < 40 ? SECONDS_TO_RUN : 40 ))
TOK_SRCS="src/tokenizer/hf_import.cpp src/tokenizer/tokenizer.cpp src/tokenizer/unicode.cpp src/tokenizer/pretokenizer.cpp src/core/error.cpp src/core/file_io.cpp"
if ! $CXX_FUZZ $FLAGS -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    tests/fuzz/fuzz_tokenizer_json.cpp $TOK_SRCS -o "$OUT/fuzz_tokenizer_json" -licuuc -licudata -lpcre2-8; then
  echo "fuzz: ERROR: building the tokenizer.json fuzz target failed (libicu-dev, libpcre2-dev installed?)" >&2
  exit 1
fi
rm -rf "$OUT/tok_seeds" && mkdir -p "$OUT/tok_corpus"
python3 tests/fuzz/make_tokenizer_seeds.py "$OUT/tok_seeds"
echo "fuzz: tokenizer.json: $(ls "$OUT/tok_seeds" | wc -l) seed files; fuzzing for ${TOK_SECONDS}s"
if [ "$TOK_SECONDS" -gt 0 ]; then LIMIT="-max_total_time=$TOK_SECONDS"; else LIMIT="-runs=0"; fi
"$OUT/fuzz_tokenizer_json" $LIMIT -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=1024 \
  -max_len=16384 -print_final_stats=1 -artifact_prefix="$OUT/tok-" "$OUT/tok_corpus" "$OUT/tok_seeds"
echo "fuzz: tokenizer.json: no findings in ${TOK_SECONDS}s"
