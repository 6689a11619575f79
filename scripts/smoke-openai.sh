#!/usr/bin/env bash
# Smoke test with the official `openai` Python client: starts the already-built
# target/debug/ferry serving the built-in tiny model on a free loopback port, and a 1P1D pair
# (`--kv-role kv_producer` / `kv_consumer`) behind `ferry proxy`, waits for /health, runs
# scripts/smoke-openai.py against the server and against the proxy, and stops them all. Exits
# non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."

# The client version the smoke test is known to pass with; installed from PyPI if missing.
OPENAI_VERSION=3.51.0
# Where cargo put the binary (CARGO_TARGET_DIR, as cargo reads it, else target/).
BIN="${CARGO_TARGET_DIR:-target}/debug/ferry"
HEALTH_WAIT_S=120

# Failing before the Python checks run still counts as one failed test in test.sh's totals.
fail() {
    echo "smoke-openai: $*" >&2
    echo "test result: FAILED. 0 passed; 1 failed; 0 ignored (smoke-openai setup)"
    exit 1
}

if [[ ! -x "$BIN" ]]; then
    fail "$BIN is not built (cargo build -p ferry)"
fi
if ! python3 -c "import openai, sys; sys.exit(openai.__version__ != '$OPENAI_VERSION')" 2>/dev/null; then
    python3 -m pip install --quiet --disable-pip-version-check "openai==$OPENAI_VERSION" ||
        fail "could not install openai==$OPENAI_VERSION"
fi

# Ports the kernel says are free now; another process could take one before its server binds,
# in which case that server exits and this script says so below.
read -r port p_port d_port proxy_port < <(python3 -c '
import socket
socks = [socket.socket() for _ in range(4)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
url="http://127.0.0.1:$port"
proxy_url="http://127.0.0.1:$proxy_port"
# Both the client (httpx) and urllib honour proxy variables: the servers are on loopback.
export no_proxy="127.0.0.1,localhost${no_proxy:+,$no_proxy}" NO_PROXY="127.0.0.1,localhost${NO_PROXY:+,$NO_PROXY}"
log="$(mktemp)"
pids=()

stop_servers() {
    for pid in "${pids[@]}"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in "${pids[@]}"; do
        # Bounded: a server that ignores SIGTERM for 10 s is killed.
        for _ in $(seq 100); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    rm -f "$log"
}
trap stop_servers EXIT

# `start ARGS...`: runs `ferry ARGS...` in the background, its output into the log.
start() {
    "$BIN" "$@" >>"$log" 2>&1 &
    pids+=($!)
}

healthy() {
    python3 -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('$1/health', timeout=1).status != 200)" 2>/dev/null
}

# `wait_healthy URL WHAT`: until URL/health answers 200, or fails the run.
wait_healthy() {
    local deadline=$((SECONDS + HEALTH_WAIT_S))
    until healthy "$1"; do
        for pid in "${pids[@]}"; do
            if ! kill -0 "$pid" 2>/dev/null; then
                cat "$log" >&2
                fail "a server exited before $2 was healthy (the log is above)"
            fi
        done
        if ((SECONDS >= deadline)); then
            cat "$log" >&2
            fail "no healthy /health at $1 ($2) after ${HEALTH_WAIT_S}s (log above)"
        fi
        sleep 0.2
    done
}

status=0
# One server.
# Tool calls are read in hermes's format (the client's tool checks).
tools=(--enable-auto-tool-choice --tool-call-parser hermes)
start serve --model tiny --host 127.0.0.1 --port "$port" "${tools[@]}"
# The same checks through `ferry proxy` in front of one prefill and one decode server.
start serve --model tiny --host 127.0.0.1 --port "$p_port" --kv-role kv_producer "${tools[@]}"
start serve --model tiny --host 127.0.0.1 --port "$d_port" --kv-role kv_consumer "${tools[@]}"
start proxy --port "$proxy_port" --prefill "http://127.0.0.1:$p_port" --decode "http://127.0.0.1:$d_port"
wait_healthy "$url" "ferry serve"
wait_healthy "$proxy_url" "ferry proxy"

if ! python3 scripts/smoke-openai.py "$url"; then
    status=1
fi
if ! python3 scripts/smoke-openai.py "$proxy_url" proxy; then
    status=1
fi
if ((status != 0)); then
    echo "smoke-openai: failed; server log:" >&2
    tail -n 80 "$log" >&2
fi
exit "$status"
