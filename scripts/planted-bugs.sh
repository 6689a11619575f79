#!/usr/bin/env bash
# Plants each bug of docs/planted-bugs/ in turn (a scratch change to ferry-core or to
# ferry-engine's EngineCore, reverted after), runs the simulation's seeds 0..N against it,
# and prints how many seeds caught it and which seed was first. The working tree must have no changes to the files the patches touch.
#
#   scripts/planted-bugs.sh [N]      # N seeds per bug, 2000 by default
set -euo pipefail
cd "$(dirname "$0")/.."
n="${1:-2000}"
for patch in docs/planted-bugs/*.patch; do
    git apply "$patch"
    trap 'git apply -R "$patch"' EXIT
    result="$(cargo run -q -p ferry-sim -- --seeds "0..$n" --quiet 2>/dev/null | tail -1)" || true
    git apply -R "$patch"
    trap - EXIT
    echo "$(basename "$patch" .patch): $result"
done
