#!/usr/bin/env bash
# Resident memory of a `ferry serve` process around weight updates, as a trainer drives them:
# full pushes of a safetensors body over HTTP, then reloads from disk. Prints VmRSS idle and
# after every update, and the peak (VmHWM, reset through /proc/<pid>/clear_refs before each
# update) during each one, in MiB.
#
#   scripts/update-rss.sh [FERRY] [MODEL] [N]
#
# FERRY: the binary (default target/release/ferry); MODEL: the served model (default: the
# default model, fetched by scripts/fetch-model.sh); N: updates of each kind (default 8). The
# pushed body is the model converted to one f32 safetensors file (`ferry make-model convert`,
# kept in ${FERRY_CACHE:-$HOME/.cache/ferry}/update-rss/).
set -euo pipefail
cd "$(dirname "$0")/.."
FERRY=${1:-target/release/ferry}
MODEL=${2:-${FERRY_CACHE:-$HOME/.cache/ferry}/models/SmolLM2-135M-Instruct.Q4_1.gguf}
N=${3:-8}
PORT=${PORT:-8391}
CONVERTED=${FERRY_CACHE:-$HOME/.cache/ferry}/update-rss/$(basename "$MODEL")
BODY=$CONVERTED/model.safetensors

if [ ! -s "$BODY" ]; then
    "$FERRY" make-model convert --model "$MODEL" --out "$CONVERTED" >&2
fi
"$FERRY" serve --model "$MODEL" --enable-admin-api --port "$PORT" 2>/tmp/update-rss-serve.log &
PID=$!
trap 'kill $PID 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
    kill -0 $PID || { cat /tmp/update-rss-serve.log >&2; exit 1; }
    sleep 0.5
done

mib() { awk -v k="$1:" '$1 == k { printf "%.0f", $2 / 1024 }' "/proc/$PID/status"; }
update() {
    echo 5 >"/proc/$PID/clear_refs"
    local before; before=$(mib VmRSS)
    curl -sf "$@" >/dev/null
    # The replaced weights are freed on a blocking thread after the reply: let it finish.
    sleep 1
    printf '%-8s %3d  rss %6s MiB  peak %6s MiB  (+%s over the rss before)\n' \
        "$KIND" "$i" "$(mib VmRSS)" "$(mib VmHWM)" $(($(mib VmHWM) - before))
}

echo "idle     rss $(mib VmRSS) MiB  body $(($(stat -c %s "$BODY") >> 20)) MiB"
KIND=push
for i in $(seq 1 "$N"); do
    update -X POST "http://127.0.0.1:$PORT/update_weights" \
        -H 'content-type: application/octet-stream' --data-binary "@$BODY"
done
KIND=reload
for i in $(seq 1 "$N"); do
    update -X POST "http://127.0.0.1:$PORT/update_weights_from_disk" \
        -H 'content-type: application/json' -d "{\"model_path\": \"$MODEL\"}"
done
