#!/usr/bin/env bash
# Install kvq's build dependencies from Debian/Ubuntu packages (needs root or sudo).
set -euo pipefail
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
PKGS="build-essential cmake ninja-build pkg-config libgtest-dev nlohmann-json3-dev libcli11-dev \
  libsqlite3-dev libpcre2-dev libcpp-httplib-dev gnuplot-nox clang libclang-rt-14-dev nodejs npm"
missing=""
for p in $PKGS; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing
fi
