#!/usr/bin/env bash
# The NIXL transport's tests (`ferry serve --kv-transport nixl`), part of scripts/test.sh: a
# build with the `nixl` feature (bindgen needs libclang: Debian's libclang-dev, installed here
# when missing), NIXL's libraries from PyPI (scripts/fetch-nixl.sh), then ferry-kv's
# registration test, the P/D tests on loopback (crates/ferry/tests/pd_nixl.rs) and the host
# tests whose faults are on the P-D link, over NIXL (crates/ferry/tests/hosts, `over_nixl`).
# NIXL wants one agent per process: each test binary holds at most one, and the servers one each.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! ls /usr/lib/llvm-*/lib/libclang.so >/dev/null 2>&1 && ! ldconfig -p | grep -q 'libclang\.so'; then
    echo "installing libclang-dev (bindgen, for the nixl feature's build)" >&2
    if [ "$(id -u)" = 0 ]; then
        apt-get install -y -q libclang-dev >/dev/null ||
            { apt-get update -q >/dev/null && apt-get install -y -q libclang-dev >/dev/null; }
    else
        sudo apt-get install -y -q libclang-dev >/dev/null
    fi
fi
scripts/fetch-nixl.sh >/dev/null

status=0
cargo test --locked -p ferry-kv --features nixl --test nixl || status=$?
cargo test --locked -p ferry --features nixl --test pd_nixl || status=$?
cargo test --locked -p ferry --features nixl --test hosts -- over_nixl || status=$?
exit "$status"
