#!/usr/bin/env bash
# Where a one-sequence prefill spends its GPU time, kernel by kernel: ncu's
# duration of every kernel of `kvq bench` with one prefill and the shortest
# decode (kernels serialized, so overlap between launches is not in them),
# summed per kernel name. Binaries carried as for window_check.sh (carry/kvq).
#   CTX (16k), CODEC (none), EXTRA_ARGS (e.g. --no-wgmma-prefill), TAG
# Results: $OUT/prefill_profile$TAG.txt (the table), the raw csv in $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kvq-out}
mkdir -p "$OUT"
source .deps-run/debs.sh unpack .deps-run >/dev/null
for f in carry/*.tar.xz; do [ -e "$f" ] && tar -xJf "$f" -C carry && rm -f "$f"; done
mkdir -p /work
[ -e /work/main ] || ln -s "$PWD" /work/main
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
TAG=${TAG:-}
CSV="$OUT/prefill_profile$TAG.csv"
timeout "${PROFILE_TIMEOUT:-300}" "$NCU" --metrics gpu__time_duration.sum --csv --print-units base \
  carry/kvq bench -m synthetic:bonsai-8b --device cuda --codecs "${CODEC:-none}" --contexts "${CTX:-16k}" \
  --gen 2 --reps 1 --warmup 0 --prefill-reps 1 --kv-window 0 --home /tmp/kvq-prof --out /tmp/kvq-prof/x$TAG \
  --no-plots ${EXTRA_ARGS:-} >"$CSV" 2>"$OUT/prefill_profile$TAG.err"
python3 - "$CSV" <<'PY' | tee "$OUT/prefill_profile$TAG.txt"
import csv, sys, collections, re
tot = collections.defaultdict(float); cnt = collections.Counter()
rows = [l for l in open(sys.argv[1]) if l.startswith('"')]
for r in csv.DictReader(rows):
    if r.get("Metric Name") != "gpu__time_duration.sum": continue
    name = re.sub(r"\(.*", "", r["Kernel Name"])[:70]
    tot[name] += float(r["Metric Value"].replace(",", "")) * 1e-9; cnt[name] += 1
all_s = sum(tot.values())
print(f"{'kernel':70s} {'launches':>8s} {'seconds':>9s} {'share':>6s}")
for k, v in sorted(tot.items(), key=lambda kv: -kv[1])[:25]:
    print(f"{k:70s} {cnt[k]:8d} {v:9.4f} {100 * v / all_s:5.1f}%")
print(f"{'all':70s} {sum(cnt.values()):8d} {all_s:9.4f}")
PY
