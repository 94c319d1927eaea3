#!/usr/bin/env bash
# One GPU-machine call for the serving must-shows (issue 26): build kvq for
# sm_90, then for each codec start `kvq serve` on synthetic bonsai-8b and
# measure it with `kvq bench serve` over loopback.
# Usage on the device (after `source .deps/debs.sh unpack .deps`):
#   bash tools/device/serve_check.sh [batch] [prefix] [rate] [soak]
#   (default: batch prefix)
#   batch   64 concurrent clients, 512-token prompts, 128 tokens (SERVE_CODECS,
#           default "none"), beside `kvq bench --batch 64` for the same codec
#   prefix  the same load with a shared 2,048-token prefix, prefix cache on and off
#   rate    a request-rate sweep (RATES, default 1,2,4,8,16,32,64) per codec
#   soak    SOAK_REQUESTS (10000) requests at concurrency 64 in two levels
#           with 10 % random disconnects (the server's pages and RSS after each),
#           SOAK_PROMPT / SOAK_GEN tokens each (default: the batch load's)
# SERVER_ARGS adds options to every `kvq serve` (e.g. --prefill-chunk 4096).
# PREBUILT=1 BUILD=DIR uses DIR/kvq as it is (a binary built for sm_90 on the
# development machine and carried, as tools/device/run_carried.sh describes:
# ~10 s of device time instead of a ~4 min build).
# SMOKE=1 runs the same steps on the CPU with the embedded model and tiny
# loads (a check of the script, not a measurement; BUILD=build-cpu to reuse a
# CPU build).
# Every step writes its output to $OUT as it runs (log.txt, one file per
# step, serve.tgz with the reports, runs.db and each server's log), so a call
# cut by the time limit still returns what ran.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kvq-out}
W=/tmp/kvq-serve-check
H=$W/home
mkdir -p "$OUT" "$W" "$H" "$H/logs"
exec > >(tee "$OUT/log.txt") 2>&1
SECTIONS=${*:-batch prefix}
want() { [[ " $SECTIONS " == *" $1 "* ]]; }

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
B=${BUILD:-build-gpu}
if [ "${SMOKE:-0}" = 1 ]; then
  MODEL_ARGS=(--device cpu)
  C=4 N=8 P=64 G=8 SP=256 CTX=1024 SOAK_REQUESTS=${SOAK_REQUESTS:-40}
else
  MODEL_ARGS=(-m synthetic:bonsai-8b --device cuda)
  C=64 N=128 P=512 G=128 SP=2048 CTX=4096
  if [ "${PREBUILT:-0}" = 1 ]; then
    [ -x "$B/kvq" ] || { echo "PREBUILT=1 but $B/kvq is missing"; exit 1; }
  else
    source tools/device/pkgconfig_stubs.sh  # gnutls.pc for libmicrohttpd.pc
    cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVQ_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a >"$W/cmake.log" 2>&1 ||
      { tail -30 "$W/cmake.log"; exit 1; }
    time cmake --build "$B" -j "$(nproc)" --target kvq 2>&1 | grep -E "error|FAILED" | head -20
  fi
fi
K=$PWD/$B/kvq
PORT=${PORT:-18080}
URL=http://127.0.0.1:$PORT

# GET /health answered 200 (bash's /dev/tcp: no curl needed).
healthy() {
  { exec 3<>"/dev/tcp/127.0.0.1/$PORT"; } 2>/dev/null || return 1
  printf 'GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
  local line
  IFS= read -r -t 2 line <&3
  exec 3<&- 3>&-
  [[ "$line" == *" 200"* ]]
}

# Starts `kvq serve` with the given options and waits for /health (bounded).
SERVER_PID=
start_server() {
  local log=$1
  shift
  # SERVER_ARGS: more options for every server (e.g. --prefill-chunk 4096)
  # shellcheck disable=SC2086
  "$K" serve "${MODEL_ARGS[@]}" --port "$PORT" --ctx "$CTX" --max-seqs "$C" --max-queue 256 ${SERVER_ARGS:-} "$@" \
    >"$log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 300); do
    if healthy; then return 0; fi
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then echo "server exited:"; tail -5 "$log"; return 1; fi
    sleep 0.5
  done
  echo "server did not become healthy"; return 1
}
stop_server() {
  [ -n "$SERVER_PID" ] || return 0
  kill -TERM "$SERVER_PID" 2>/dev/null
  for _ in $(seq 1 100); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.2; done
  kill -KILL "$SERVER_PID" 2>/dev/null
  SERVER_PID=
}
trap stop_server EXIT
bench_serve() {  # bench_serve NAME ARGS...: one kvq bench serve run into $OUT/NAME.txt
  local name=$1
  shift
  timeout "${STEP_TIMEOUT:-300}" stdbuf -oL -eL "$K" bench serve --url "$URL" --home "$H" --out "$H/$name" "$@" \
    >"$OUT/$name.txt" 2>&1
  grep -vE "^\[|^kvq bench serve: (report|csv|db)" "$OUT/$name.txt" | tail -8
}

for CODEC in ${SERVE_CODECS:-none}; do
  if want batch; then
    echo "== $CODEC: kvq bench --batch $C (the reference for 85 %)"
    timeout 200 stdbuf -oL -eL "$K" bench "${MODEL_ARGS[@]}" --codecs "$CODEC" --contexts "$P" --batch "$C" \
      --gen "$G" --reps 1 --home "$H" --out "$H/batch-$CODEC" >"$OUT/batch-$CODEC.txt" 2>&1
    grep -E "^$CODEC " "$OUT/batch-$CODEC.txt" | tail -2
    echo "== $CODEC: $C clients, prompt $P, gen $G"
    start_server "$H/logs/server-$CODEC.log" --kv "$CODEC" && bench_serve "serve64-$CODEC" --concurrency "$C" \
      --requests "$N" --prompt-len "$P" --gen "$G"
    stop_server
  fi
  if want prefix; then
    for PC in on off; do
      echo "== $CODEC: $C clients, shared prefix $SP, prefix cache $PC"
      flag=--prefix-cache
      [ $PC = off ] && flag=--no-prefix-cache
      start_server "$H/logs/server-$CODEC-prefix-$PC.log" --kv "$CODEC" $flag && bench_serve "prefix-$PC-$CODEC" \
        --concurrency "$C" --requests "$N" --prompt-len "$P" --gen "$G" --shared-prefix "$SP"
      stop_server
    done
  fi
  if want rate; then
    echo "== $CODEC: request-rate sweep"
    start_server "$H/logs/server-$CODEC-rate.log" --kv "$CODEC" && bench_serve "rate-$CODEC" \
      --rate "${RATES:-1,2,4,8,16,32,64}" --requests "${RATE_REQUESTS:-$N}" --prompt-len "$P" --gen "$G"
    stop_server
  fi
  if want soak; then
    echo "== $CODEC: soak, ${SOAK_REQUESTS:-10000} requests, 10 % disconnects"
    start_server "$H/logs/server-$CODEC-soak.log" --kv "$CODEC" && STEP_TIMEOUT=580 bench_serve "soak-$CODEC" \
      --concurrency "$C,$C" --requests "$(( ${SOAK_REQUESTS:-10000} / 2 ))" --prompt-len "${SOAK_PROMPT:-$P}" \
      --gen "${SOAK_GEN:-$G}" \
      --disconnect 0.1  # two levels: the first touches the pool, the second shows whether memory stays flat
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=memory.used --format=csv,noheader
    stop_server
  fi
done
(cd "$H" && tar czf "$OUT/serve.tgz" .)
echo "== done"
