#!/usr/bin/env bash
# Smoke test with the official `openai` Python client: starts the already-built
# target/debug/ferry serving the built-in tiny model on a free loopback port, waits for /health,
# runs scripts/smoke-openai.py against it and stops the server. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."

# The client version the smoke test is known to pass with; installed from PyPI if missing.
OPENAI_VERSION=3.51.0
BIN=target/debug/ferry
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

# A port the kernel says is free now; another process could take it before the server binds,
# in which case the server exits and this script says so below.
port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
url="http://127.0.0.1:$port"
# Both the client (httpx) and urllib honour proxy variables: the server is on loopback.
export no_proxy="127.0.0.1,localhost${no_proxy:+,$no_proxy}" NO_PROXY="127.0.0.1,localhost${NO_PROXY:+,$NO_PROXY}"
log="$(mktemp)"
"$BIN" serve --model tiny --host 127.0.0.1 --port "$port" >"$log" 2>&1 &
pid=$!

stop_server() {
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null || true
        # Bounded: a server that ignores SIGTERM for 10 s is killed.
        for _ in $(seq 100); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
    rm -f "$log"
}
trap stop_server EXIT

healthy() {
    python3 -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('$url/health', timeout=1).status != 200)" 2>/dev/null
}
deadline=$((SECONDS + HEALTH_WAIT_S))
until healthy; do
    if ! kill -0 "$pid" 2>/dev/null; then
        cat "$log" >&2
        fail "ferry serve exited before it was healthy (its log is above)"
    fi
    if ((SECONDS >= deadline)); then
        cat "$log" >&2
        fail "no healthy /health at $url after ${HEALTH_WAIT_S}s (server log above)"
    fi
    sleep 0.2
done

if ! python3 scripts/smoke-openai.py "$url"; then
    echo "smoke-openai: failed; server log:" >&2
    tail -n 50 "$log" >&2
    exit 1
fi
