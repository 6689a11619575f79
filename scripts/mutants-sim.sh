#!/usr/bin/env bash
# The second stage of mutation testing: every mutant that ferry-core's own tests let survive
# (docs/mutants/shard-*/missed.txt) is tested again against the simulation (ferry-sim's
# tests, with FERRY_SIM_SEEDS seeds per tier, 300 by default). Mutants are matched by what
# they change and in which function, not by line, so survivors found on an older tree still
# name their mutants. Results in docs/mutants/sim-stage/.
# Usage: scripts/mutants-sim.sh   (needs `cargo install cargo-mutants --locked`). The files
# mutated are cargo-mutants' scope in .cargo/mutants.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
export FERRY_SIM_SEEDS="${FERRY_SIM_SEEDS:-300}"
args=()
while IFS= read -r line; do
    # "path:line:col: replace X with Y in F" -> a regex for "replace X with Y in F".
    what="${line#*: }"
    args+=(-F "$(printf '%s' "$what" | sed -e 's/[][\.*^$(){}+?|/]/\\&/g')\$")
done < <(cat docs/mutants/shard-*-of-16/missed.txt | sort -u)
echo "$((${#args[@]} / 2)) survivor patterns"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
status=0
cargo mutants -p ferry-core --test-package ferry-sim \
    "${args[@]}" --timeout 120 --output "$out" || status=$?
dest="docs/mutants/sim-stage"
mkdir -p "$dest"
for f in caught.txt missed.txt timeout.txt unviable.txt; do
    if [[ -f "$out/mutants.out/$f" ]]; then cp "$out/mutants.out/$f" "$dest/"; fi
done
echo "sim stage: cargo-mutants exit $status; results in $dest"
