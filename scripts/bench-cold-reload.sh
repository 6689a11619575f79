#!/usr/bin/env bash
# A reload from disk (`POST /update_weights_from_disk`) against `cat` of the same files, with
# the page cache dropped before each (cold) and not (warm), in turn, five rounds. Needs root
# (it writes /proc/sys/vm/drop_caches, which empties the whole machine's page cache) and a
# release build. `ferry bench weight-sync` measures the warm case only, since it cannot drop
# caches. Usage: scripts/bench-cold-reload.sh [MODEL_FOLDER] (default: the default model
# converted to f32 in a temporary folder). Figures: docs/weight-sync.md.
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
trap 'kill $SERVER 2>/dev/null; [ $# -ge 1 ] || rm -rf "$M"' EXIT
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
now() { date +%s.%N; }
reload() {
    curl -sf -X POST "http://127.0.0.1:$PORT/update_weights_from_disk" \
        -H 'content-type: application/json' \
        -d "{\"model_path\":\"$M\",\"weight_version\":\"$1\"}" >/dev/null
}
cold() { sync; echo 3 >/proc/sys/vm/drop_caches; }
for r in 1 2 3 4 5; do
    cold; t0=$(now); cat "$M"/*.safetensors >/dev/null; t1=$(now)
    cold; t2=$(now); reload "cold-$r"; t3=$(now)
    t4=$(now); cat "$M"/*.safetensors >/dev/null; t5=$(now)
    t6=$(now); reload "warm-$r"; t7=$(now)
    python3 -c "
c, r, wc, wr = $t1 - $t0, $t3 - $t2, $t5 - $t4, $t7 - $t6
print(f'round $r: cold cat {c:.3f} s, cold reload {r:.3f} s ({r / c:.2f}x); warm cat {wc:.3f} s, warm reload {wr:.3f} s ({wr / wc:.2f}x)')"
done
