#!/usr/bin/env bash
# A reload from disk (`POST /update_weights_from_disk`) against `cat` of the same files, with
# the page cache dropped before each (cold) and not (warm), in turn, ROUNDS rounds (10 unless
# set), then the medians of the ratios. Each reload twice: with the server running (read into
# new weights) and paused, as an RL loop reloads (read over the weights in place; the reload
# alone is timed). Needs root
# (it writes /proc/sys/vm/drop_caches, which empties the whole machine's page cache) and a
# release build. `ferry bench weight-sync` measures the warm case only, since it cannot drop
# caches. Usage: [ROUNDS=10] scripts/bench-cold-reload.sh [MODEL_FOLDER] (default: the default
# model converted to f32 in a temporary folder). Figures: docs/weight-sync.md.
set -euo pipefail
cd "$(dirname "$0")/.."
FERRY=target/release/ferry
PORT=${PORT:-18099}
if [ $# -ge 1 ]; then
    M=$1
else
    M=$(mktemp -d)
    trap 'rm -rf "$M"' EXIT
    "$FERRY" make-model convert --out "$M" >/dev/null
fi
"$FERRY" serve --model "$M" --host 127.0.0.1 --port "$PORT" --enable-admin-api \
    --kv-cache-bytes 64MiB --max-model-len 1024 >/dev/null 2>&1 &
SERVER=$!
OUT=$(mktemp)
trap 'kill $SERVER 2>/dev/null; rm -f "$OUT"; [ $# -ge 1 ] || rm -rf "$M"' EXIT
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
now() { date +%s.%N; }
# The reload's time is curl's own (`time_total`: request sent to answer read), so the start of
# the curl process is not counted.
reload() {
    curl -sf -o /dev/null -w '%{time_total}' -X POST \
        "http://127.0.0.1:$PORT/update_weights_from_disk" -H 'content-type: application/json' \
        -d "{\"model_path\":\"$M\",\"weight_version\":\"$1\"}"
}
paused_reload() {
    curl -sf -o /dev/null -X POST "http://127.0.0.1:$PORT/pause?mode=keep&clear_cache=false"
    reload "$1"
    curl -sf -o /dev/null -X POST "http://127.0.0.1:$PORT/resume"
}
cold() { sync; echo 3 >/proc/sys/vm/drop_caches; }
ROUNDS=${ROUNDS:-10}
for r in $(seq "$ROUNDS"); do
    cold; t0=$(now); cat "$M"/*.safetensors >/dev/null; t1=$(now)
    cold; cr=$(reload "cold-$r")
    cold; cp=$(paused_reload "cold-paused-$r")
    t4=$(now); cat "$M"/*.safetensors >/dev/null; t5=$(now)
    wr=$(reload "warm-$r")
    wp=$(paused_reload "warm-paused-$r")
    echo "$(echo "$t1 - $t0" | bc) $cr $(echo "$t5 - $t4" | bc) $wr $cp $wp" | tee -a "$OUT" | python3 -c "
c, r, wc, wr, cp, wp = map(float, input().split())
print(f'round $r: cold cat {c:.3f} s, reload {r:.3f} s ({r / c:.2f}x), paused {cp:.3f} s ({cp / c:.2f}x); warm cat {wc:.3f} s, reload {wr:.3f} s ({wr / wc:.2f}x), paused {wp:.3f} s ({wp / wc:.2f}x)')"
done
python3 - "$OUT" <<'PY'
import statistics, sys
rows = [list(map(float, line.split())) for line in open(sys.argv[1])]
def q(values):
    a, b, c = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return f"median {b:.2f}, quartiles {a:.2f}-{c:.2f}"
cold = [r / c for c, r, _, _, _, _ in rows]
warm = [wr / wc for _, _, wc, wr, _, _ in rows]
cold_paused = [cp / c for c, _, _, _, cp, _ in rows]
warm_paused = [wp / wc for _, _, wc, _, _, wp in rows]
median = lambda i: statistics.median(r[i] for r in rows)
print(f"cold reload / cold cat: {q(cold)}; cold cat median {median(0):.3f} s, cold reload median {median(1):.3f} s")
print(f"cold paused reload (in place) / cold cat: {q(cold_paused)}; median {median(4):.3f} s")
print(f"warm reload / warm cat: {q(warm)}; warm cat median {median(2):.3f} s, warm reload median {median(3):.3f} s")
print(f"warm paused reload (in place) / warm cat: {q(warm_paused)}; median {median(5):.3f} s")
PY
