#!/usr/bin/env bash
# Run the training pipeline on the GPU machine and pack its results into $OUT
# (at most 8 files of <= 16 MiB come back): the GGUF in 15 MiB parts, the
# rest in one tarball.
#   bash tools/train/run_device.sh smoke   # ~4 min: tiny training, everything end to end
#   bash tools/train/run_device.sh full    # ~9 min: the real run (train.py defaults)
set -uo pipefail
cd "$(dirname "$0")/../.."
MODE=${1:-full}
OUT=${OUT:-/tmp/kvq-out}
W=/tmp/kvq-train
mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nproc
  if [ "$MODE" = smoke ]; then
    python3 tools/gguf_py/test_kvq_gguf.py
    python3 tools/golden/selftest.py
    python3 tools/train/train.py --out "$W" --corpus-mb 60 --tok-sample-mb 8 --train-end-s 150 \
      --bench-eager-steps 10 --eval-windows 16
  else
    python3 tools/train/train.py --out "$W" "${@:2}"
  fi
  echo "train.py exit: $?"
} 2>&1 | tee "$OUT/stdout.log"
cd "$W" || exit 1
ls -la . golden 2>/dev/null
[ -f kvq-tiny-code.gguf ] && split -b 15M -d kvq-tiny-code.gguf "$OUT/gguf.part"
tar czf "$OUT/misc.tgz" --ignore-failed-read train_log.json tokenizer.json kvq_tiny_code_ref.jsonl \
  corpus_files.txt.gz golden
ls -la "$OUT"
