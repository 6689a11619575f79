#!/usr/bin/env bash
# Mutation testing of ferry-core's lifecycle, scheduler and connector modules, outside CI
# (each mutant is a rebuild plus ferry-core's tests: about an hour on 2 cores for the whole set;
# the tests take about a second, so a mutant still running after 30 s is a hang).
# Usage: scripts/mutants.sh K N   runs shard K of N (0-based, cargo-mutants' --shard K/N) and
# keeps its outcome in docs/mutants/shard-K-of-N/ (caught.txt, missed.txt, timeout.txt,
# unviable.txt). Needs `cargo install cargo-mutants --locked`. The files mutated are
# cargo-mutants' scope in .cargo/mutants.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
k="${1:?usage: scripts/mutants.sh K N}"
n="${2:?usage: scripts/mutants.sh K N}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
status=0
cargo mutants -p ferry-core \
    --shard "$k/$n" --timeout 30 --output "$out" || status=$?
# cargo-mutants exits 2 when some mutants were missed, 3 on timeouts: results, not failures.
dest="docs/mutants/shard-$k-of-$n"
mkdir -p "$dest"
for f in caught.txt missed.txt timeout.txt unviable.txt; do
    if [[ -f "$out/mutants.out/$f" ]]; then cp "$out/mutants.out/$f" "$dest/"; fi
done
echo "shard $k/$n: cargo-mutants exit $status; results in $dest"
