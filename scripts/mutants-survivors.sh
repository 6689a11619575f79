#!/usr/bin/env bash
# The later stages of mutation testing: mutants that survived an earlier stage, run again.
#   core  every survivor of the shards (docs/mutants/shard-*/missed.txt) against ferry-core's
#         tests of today (tests written since the shard ran);
#   sim   every survivor of the core stage (docs/mutants/core-stage/missed.txt) against the
#         simulation (ferry-sim's tests, FERRY_SIM_SEEDS seeds per tier, 300 by default).
# Mutants are matched by what they change and in which function, not by line, so survivors
# found on an older tree still name their mutants. Results in docs/mutants/STAGE-stage/.
# Usage: scripts/mutants-survivors.sh core|sim   (needs `cargo install cargo-mutants
# --locked`). The files mutated are cargo-mutants' scope in .cargo/mutants.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
stage="${1:?usage: scripts/mutants-survivors.sh core|sim}"
case "$stage" in
    core)
        sources=(docs/mutants/shard-*-of-16/missed.txt)
        run=(--timeout 30)
        ;;
    sim)
        sources=(docs/mutants/core-stage/missed.txt)
        export FERRY_SIM_SEEDS="${FERRY_SIM_SEEDS:-300}"
        run=(--test-package ferry-sim --timeout 120)
        ;;
    *)
        echo "usage: scripts/mutants-survivors.sh core|sim" >&2
        exit 2
        ;;
esac
args=()
while IFS= read -r line; do
    # "path:line:col: replace X with Y in F" -> a regex for "replace X with Y in F".
    what="${line#*: }"
    args+=(-F "$(printf '%s' "$what" | sed -e 's/[][\.*^$(){}+?|/]/\\&/g')\$")
done < <(cat "${sources[@]}" | sort -u)
echo "$((${#args[@]} / 2)) survivor patterns"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
status=0
cargo mutants -p ferry-core "${run[@]}" "${args[@]}" --output "$out" || status=$?
dest="docs/mutants/$stage-stage"
rm -rf "$dest"
mkdir -p "$dest"
for f in caught.txt missed.txt timeout.txt unviable.txt; do
    if [[ -f "$out/mutants.out/$f" ]]; then cp "$out/mutants.out/$f" "$dest/"; fi
done
echo "$stage stage: cargo-mutants exit $status; results in $dest"
